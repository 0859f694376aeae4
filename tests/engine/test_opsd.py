"""opsd against a float64 reference written here from the formula in whitney/engine/losses/opsd.py.

Per row: ce_coef * CE_sum / N_CE + kl_coef * KL_sum / N_KL with CE_sum = -sum_{loss_mask} l_t and
KL_sum = sum over the K id-paired positions of KL(teacher || student) over the full vocabulary; an
empty component contributes zero; the loss is the sum over rows; the teacher gets no gradient.
Metrics: opsd_objective_sum:sum (the loss), opsd_kl:mean (mean KL over all KL tokens of the request),
ce_loss:mean (mean CE over all loss_mask tokens of the request).

Function level: opsd.objective on random log-prob tensors. Engine level: forward and forward_backward
on the tiny models, the reference computed by a float64 Hugging Face model (student stream =
token_ids, teacher stream = a hint prefix + the same continuation, through the same weights).
Then one test per validation rule.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.engine.test_losses import (assert_grads_match, hf64, leaf_adapter64, lora_weights, new_run_id, randomize_B,
                                      ref_logits, ref_target_logprobs)
from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.losses import opsd
from whitney.engine.losses.builtin import loss_spec
from whitney.errors import InvalidInput

# ---- function level -------------------------------------------------------------------------------


def make_rows(seed: int = 0):
    """Three rows: CE and KL; KL only (ce mask empty); CE only (no KL pairs). V = 11."""
    gen = torch.Generator().manual_seed(seed)
    V = 11
    rows = []
    for n, ce_on, kl_pos in [(7, [0, 1, 5], [4, 2, 3]), (5, [], [0, 1, 2, 3]), (4, [0, 2], [])]:
        lp = (-torch.rand(n, generator=gen) * 4).requires_grad_(True)
        z = (torch.randn(len(kl_pos), V, generator=gen) * 2).requires_grad_(True)  # student logits
        teacher = torch.log_softmax(torch.randn(len(kl_pos), V, generator=gen) * 2, -1)
        mask = torch.zeros(n)
        mask[ce_on] = 1.0
        rows.append((lp, z, teacher, mask, torch.tensor(kl_pos, dtype=torch.int64)))
    return rows


def objective_reference(rows, ce_coef: float, kl_coef: float):
    """Plain float64 formula: total, per-token contributions, d/dl, d/dz (student logits), metrics."""
    total, per_token, g_lp, g_z = 0.0, [], [], []
    ce_all, kl_all = [], []
    for lp, z, teacher, mask, pos in rows:
        L, M = lp.detach().double().tolist(), mask.double().tolist()
        n_ce, n_kl = int(sum(M)), len(pos)
        contrib = [0.0] * len(L)
        gl = [0.0] * len(L)
        if n_ce:
            for t in range(len(L)):
                if M[t]:
                    ce_all.append(-L[t])
                    contrib[t] += ce_coef * -L[t] / n_ce
                    gl[t] = -ce_coef / n_ce
                    total += ce_coef * -L[t] / n_ce
        gz = []
        for k in range(n_kl):
            # s = log_softmax(z) recomputed in float64 from the float32 logits; p_t = exp(teacher).
            zk = z.detach().double()[k].tolist()
            m = max(zk)
            lse = m + math.log(math.fsum(math.exp(v - m) for v in zk))
            s = [v - lse for v in zk]
            tk = teacher.double()[k].tolist()
            kl = math.fsum(math.exp(tv) * (tv - sv) for tv, sv in zip(tk, s))
            kl_all.append(kl)
            contrib[int(pos[k])] += kl_coef * kl / n_kl
            total += kl_coef * kl / n_kl
            # d KL / d z_v = softmax(z)_v - p_t(v)
            gz.append([kl_coef / n_kl * (math.exp(sv) - math.exp(tv)) for sv, tv in zip(s, tk)])
        per_token.extend(contrib)
        g_lp.append(gl)
        g_z.append(gz)
    metrics = {"opsd_objective_sum:sum": total,
               "opsd_kl:mean": sum(kl_all) / len(kl_all) if kl_all else 0.0,
               "ce_loss:mean": sum(ce_all) / len(ce_all) if ce_all else 0.0}
    return total, per_token, g_lp, g_z, metrics


@pytest.mark.parametrize("ce_coef,kl_coef", [(1.0, 1.0), (0.3, 2.5), (0.0, 1.0), (1.0, 0.0)])
def test_objective_value_and_gradient(ce_coef, kl_coef):
    rows = make_rows()
    config = opsd.SPEC.config({"ce_coef": ce_coef, "kl_coef": kl_coef})
    out = opsd.objective([r[0] for r in rows], [torch.log_softmax(r[1], -1) for r in rows], [r[2] for r in rows],
                         [r[3] for r in rows], [r[4] for r in rows], config)
    total, per_token, g_lp, g_z, metrics = objective_reference(rows, ce_coef, kl_coef)
    leaves = [r[0] for r in rows] + [r[1] for r in rows]
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    assert float(out.loss.detach()) == pytest.approx(total, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(out.elementwise.double(), torch.tensor(per_token, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logprobs, torch.cat([r[0].detach() for r in rows]))
    for i, (g, ref) in enumerate(zip(grads[:3], g_lp)):
        got = torch.zeros(len(ref), dtype=torch.float64) if g is None else g.double()
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, i=i: f"d/dlp row {i}: {m}")
    for i, (g, ref, r) in enumerate(zip(grads[3:], g_z, rows)):
        got = torch.zeros(r[1].shape, dtype=torch.float64) if g is None else g.double()
        exp = torch.tensor(ref, dtype=torch.float64).reshape(r[1].shape)
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-7, msg=lambda m, i=i: f"d/dz row {i}: {m}")
    for key, value in metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert out.metrics["tokens:sum"] == sum(r[0].numel() for r in rows)
    assert total > 0 and metrics["opsd_kl:mean"] > 0 and metrics["ce_loss:mean"] > 0  # the reference is not vacuous


def test_table_entry_on_the_engine_contract_equals_the_row_objective():
    """What the engine hands the table's entry (the rows concatenated, datum_index, kl_index, [P, V] log-probs)
    gives the same loss, per-token loss, metrics and gradients as `objective` on the rows, and against the
    float64 reference. Row 2 has no KL pair, row 1 no CE token."""
    rows = make_rows(seed=3)
    config = opsd.SPEC.config({"ce_coef": 0.7, "kl_coef": 1.3})
    assert loss_spec("opsd").fn is opsd.loss and loss_spec("opsd").teacher == opsd.TEACHER
    lengths = [r[0].numel() for r in rows]
    starts = [sum(lengths[:i]) for i in range(len(rows))]
    inputs = {"datum_index": torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths)),
              "loss_mask": torch.cat([r[3] for r in rows]),
              "kl_index": torch.cat([r[4] + s for r, s in zip(rows, starts)]),
              "student_kl": torch.cat([torch.log_softmax(r[1], -1) for r in rows]),
              "teacher_kl": torch.cat([r[2] for r in rows])}
    lp = torch.cat([r[0] for r in rows])
    out = opsd.loss(lp, inputs, config)
    ref = opsd.objective([r[0] for r in rows], [torch.log_softmax(r[1], -1) for r in rows], [r[2] for r in rows],
                         [r[3] for r in rows], [r[4] for r in rows], config)
    total, per_token, _, _, metrics = objective_reference(rows, 0.7, 1.3)
    assert float(out.loss.detach()) == pytest.approx(total, rel=1e-5)
    torch.testing.assert_close(out.elementwise, ref.elementwise)
    torch.testing.assert_close(out.elementwise.double(), torch.tensor(per_token, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert out.metrics == pytest.approx(ref.metrics) and out.mean_counts == ref.mean_counts
    leaves = [r[0] for r in rows] + [r[1] for r in rows]
    got = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    want = torch.autograd.grad(ref.loss, leaves, allow_unused=True)
    for g, w, leaf in zip(got, want, leaves):  # row 1's lp takes no gradient (no CE token)
        zero = torch.zeros_like(leaf)
        torch.testing.assert_close(zero if g is None else g, zero if w is None else w)
    assert sum(g is not None and g.numel() > 0 and float(g.abs().max()) > 0 for g in got) == 4  # lp 0, 2; z 0, 1


def test_objective_is_a_sum_of_row_means_not_a_token_mean():
    """Duplicating a row doubles the loss; a row with twice the CE tokens of equal l has the same CE term."""
    rows = make_rows(seed=1)
    config = opsd.SPEC.config({})

    def loss(rs):
        return float(opsd.objective([r[0] for r in rs], [torch.log_softmax(r[1], -1) for r in rs],
                                    [r[2] for r in rs], [r[3] for r in rs], [r[4] for r in rs], config).loss.detach())

    assert loss(rows + rows) == pytest.approx(2 * loss(rows), rel=1e-6)
    lp = torch.full((6,), -2.0)
    empty = (torch.zeros(0, 11), torch.zeros(0, 11), torch.zeros(0, dtype=torch.int64))
    one = (lp, empty[0], empty[1], torch.tensor([1.0, 0, 0, 0, 0, 0]), empty[2])
    many = (lp, empty[0], empty[1], torch.tensor([1.0, 1, 1, 1, 0, 0]), empty[2])
    assert loss([one]) == pytest.approx(2.0) and loss([many]) == pytest.approx(2.0)


def test_objective_teacher_is_a_constant_of_the_student_gradient():
    """The KL gradient w.r.t. the student logits is softmax(s) - p_teacher, the teacher entering only as a
    constant; and the engine passes a teacher that carries no graph (see the engine-level test)."""
    rows = make_rows(seed=2)
    lp, z, teacher, mask, pos = rows[1]
    out = opsd.objective([lp], [torch.log_softmax(z, -1)], [teacher], [mask], [pos], opsd.SPEC.config({"ce_coef": 0}))
    (gz,) = torch.autograd.grad(out.loss, [z])
    expected = (torch.softmax(z.detach().double(), -1) - teacher.double().exp()) / len(pos)
    torch.testing.assert_close(gz.double(), expected, rtol=1e-5, atol=1e-7)
    assert not teacher.requires_grad


# ---- engine level ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


LORA = LoraConfig(rank=4, alpha=8.0, seed=2)


def stream_datum(prompt, completion, hint, ce_positions, student_ids=None, teacher_ids=None, trailing=0):
    """A datum whose student is prompt + completion and teacher hint + prompt + completion.

    KL positions are those predicting the completion tokens in each stream; student_ids / teacher_ids
    give their kl_ids in stream order (default 0..K-1). ce_positions get loss_mask = 1.
    """
    s = prompt + completion
    t = hint + prompt + completion
    K = len(completion)
    s_kl = list(range(len(prompt) - 1, len(s) - 1))
    t_kl = list(range(len(hint) + len(prompt) - 1, len(t) - 1))
    student_ids = student_ids if student_ids is not None else list(range(K))
    teacher_ids = teacher_ids if teacher_ids is not None else list(range(K))
    kl_mask, kl_ids = [0.0] * len(s), [0] * len(s)
    for p, i in zip(s_kl, student_ids):
        kl_mask[p], kl_ids[p] = 1.0, i
    tkl_mask, tkl_ids = [0.0] * len(t), [0] * len(t)
    for p, i in zip(t_kl, teacher_ids):
        tkl_mask[p], tkl_ids[p] = 1.0, i
    loss_mask = [1.0 if p in ce_positions else 0.0 for p in range(len(s))]
    return {
        "token_ids": s,
        "target_tokens": s[1:] + [trailing],
        "loss_mask": loss_mask,
        "kl_mask": kl_mask,
        "kl_ids": kl_ids,
        "teacher_token_ids": t,
        "teacher_target_tokens": t[1:] + [trailing],
        "teacher_kl_mask": tkl_mask,
        "teacher_kl_ids": tkl_ids,
    }


def rows_for_engine() -> list[dict]:
    return [
        # CE on the prompt, KL on the completion.
        stream_datum([11, 250, 3000], [42, 7, 900, 1234, 5], [77, 78, 79, 80], ce_positions={0, 1}),
        # Repeated completion tokens: pairs are matched by kl_id, not by stream order (student k pairs with
        # the teacher position predicting completion[(k + 2) % 4], which has the same target).
        stream_datum([500, 600], [31, 32, 31, 32], [9, 10], ce_positions={0},
                     student_ids=[0, 1, 2, 3], teacher_ids=[2, 3, 0, 1]),
        # CE only: no KL pairs (its KL component is empty and contributes zero).
        stream_datum([21, 22, 23, 24], [], [40000], ce_positions={0, 1, 2}),
    ]


def to_datum(row: dict, wire: bool = False) -> Datum:
    inputs = {k: v for k, v in row.items() if k != "token_ids"}
    if wire:  # the {dtype, shape, values} form for some fields
        inputs["kl_mask"] = {"dtype": "float32", "shape": [len(row["kl_mask"])], "values": row["kl_mask"]}
        inputs["teacher_kl_ids"] = {"dtype": "int64", "shape": [len(row["teacher_kl_ids"])],
                                    "values": row["teacher_kl_ids"]}
    return Datum(row["token_ids"], inputs)


def engine_reference(model, rows: list[dict], ce_coef: float, kl_coef: float, A=None, B=None, scale=1.0,
                     teacher_grad: bool = False):
    """Float64 opsd through the HF model; teacher under no_grad unless teacher_grad (a wrong variant)."""
    weights = lora_weights(model, A, B, scale) if A is not None else None
    total = torch.zeros((), dtype=torch.float64)
    ce_all, kl_all, lps, per_tokens = [], [], [], []
    for row in rows:
        s_logits = ref_logits(model, row["token_ids"], weights)
        with torch.set_grad_enabled(teacher_grad and torch.is_grad_enabled()):
            t_logits = ref_logits(model, row["teacher_token_ids"], weights)
        lp = ref_target_logprobs(s_logits, torch.tensor(row["target_tokens"]))
        mask = torch.tensor(row["loss_mask"], dtype=torch.float64)
        per_token = torch.zeros(len(lp), dtype=torch.float64)
        n_ce = int(mask.sum())
        if n_ce:
            total = total + ce_coef * -(lp * mask).sum() / n_ce
            per_token = per_token + ce_coef * -(lp.detach() * mask) / n_ce
            ce_all += (-(lp.detach())[mask.bool()]).tolist()
        s_pos = {i: p for p, (m, i) in enumerate(zip(row["kl_mask"], row["kl_ids"])) if m}
        t_pos = {i: p for p, (m, i) in enumerate(zip(row["teacher_kl_mask"], row["teacher_kl_ids"])) if m}
        n_kl = len(s_pos)
        for k in range(n_kl):
            s = torch.log_softmax(s_logits[s_pos[k]], -1)
            t = torch.log_softmax(t_logits[t_pos[k]], -1)
            kl = (t.exp() * (t - s)).sum()
            total = total + kl_coef * kl / n_kl
            per_token[s_pos[k]] += kl_coef * float(kl.detach()) / n_kl
            kl_all.append(float(kl.detach()))
        lps.append(lp.detach())
        per_tokens.append(per_token)
    metrics = {"opsd_objective_sum:sum": float(total.detach()), "opsd_kl:mean": sum(kl_all) / len(kl_all),
               "ce_loss:mean": sum(ce_all) / len(ce_all)}
    return total, lps, per_tokens, metrics


def check_result(res, ref_total, lps, per_tokens, metrics):
    assert res.loss == pytest.approx(float(ref_total.detach()), rel=1e-4, abs=1e-5)
    for key, value in metrics.items():
        assert res.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert res.metrics["loss:sum"] == pytest.approx(res.loss)
    for o, lp, pt in zip(res.outputs, lps, per_tokens):
        torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), lp, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(torch.tensor(o.elementwise_loss, dtype=torch.float64), pt, rtol=1e-4, atol=1e-5)


def test_engine_forward_matches_float64_reference(engine, tiny_model):
    """A fresh run (B = 0) is the base model: loss, metrics, log-probs and per-token loss equal HF's."""
    rid = new_run_id("opsd")
    engine.create_run(rid, tiny_model, LORA)
    rows = rows_for_engine()
    res = engine.forward(rid, [to_datum(r, wire=i == 1) for i, r in enumerate(rows)], loss_fn="opsd")
    with torch.no_grad():
        ref = engine_reference(hf64(tiny_model), rows, 1.0, 1.0)
    check_result(res, *ref)
    assert ref[3]["opsd_kl:mean"] > 1e-3  # teacher and student really differ (hint-conditioned)
    # Pairing by kl_id matters: pairing row 1 in stream order would give a different loss.
    swapped = copy.deepcopy(rows)
    swapped[1]["teacher_kl_ids"] = stream_datum([500, 600], [31, 32, 31, 32], [9, 10], set())["teacher_kl_ids"]
    with torch.no_grad():
        other = engine_reference(hf64(tiny_model), swapped, 1.0, 1.0)[0]
    assert abs(float(other) - res.loss) > 1e-3
    engine.delete_run(rid)


@pytest.mark.parametrize("ce_coef,kl_coef", [(0.7, 1.3)])
def test_engine_gradient_matches_float64_reference(engine, tiny_llama, ce_coef, kl_coef):
    """forward_backward's gradient for every LoRA A and B equals autograd of the float64 reference with
    the teacher stream as a constant (same weights, no gradient). (The Qwen3 gradient path is covered by
    test_losses.py; opsd's own machinery does not depend on the architecture.)"""
    tiny_model = tiny_llama
    rid = new_run_id("opsd")
    run = engine.create_run(rid, tiny_model, LORA)
    randomize_B(run, seed=5)
    rows = rows_for_engine()
    res = engine.forward_backward(rid, [to_datum(r) for r in rows], loss_fn="opsd",
                                  loss_config={"ce_coef": ce_coef, "kl_coef": kl_coef})
    model = hf64(tiny_model)
    A, B = leaf_adapter64(run)
    ref = engine_reference(model, rows, ce_coef, kl_coef, A, B, run.adapter.scale)
    check_result(res, *ref)
    assert_grads_match(run, A, B, ref[0])
    # The check can tell: letting gradient flow through the teacher too gives clearly different gradients.
    A2, B2 = leaf_adapter64(run)
    wrong = engine_reference(model, rows, ce_coef, kl_coef, A2, B2, run.adapter.scale, teacher_grad=True)[0]
    key = next(iter(B2))
    (g_wrong,) = torch.autograd.grad(wrong, [B2[key]])
    got = run.grads[f"{key}.lora_B"].double()
    assert float((got - g_wrong).abs().max()) > 1e-2 * float(g_wrong.abs().max())
    engine.delete_run(rid)


def test_engine_kl_only_matches_reference(engine, tiny_llama):
    """ce_coef = 0: rows need KL tokens but not loss_mask; the CE term vanishes from the loss."""
    rid = new_run_id("opsd")
    engine.create_run(rid, tiny_llama, LORA)
    rows = rows_for_engine()[:2]
    rows[1]["loss_mask"] = [0.0] * len(rows[1]["loss_mask"])
    res = engine.forward(rid, [to_datum(r) for r in rows], loss_fn="opsd", loss_config={"ce_coef": 0.0})
    with torch.no_grad():
        total, lps, per_tokens, metrics = engine_reference(hf64(tiny_llama), rows, 0.0, 1.0)
    check_result(res, total, lps, per_tokens, metrics)
    # The loss is the KL part alone: the sum over rows of each row's mean KL.
    assert res.loss == pytest.approx(float(total), rel=1e-4) and metrics["ce_loss:mean"] > 0
    engine.delete_run(rid)


# ---- validation: one test per rule ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vrun(engine, tiny_llama) -> str:
    rid = new_run_id("opsd-validate")
    engine.create_run(rid, tiny_llama, LORA)
    return rid


def good() -> dict:
    return stream_datum([11, 250, 3000], [42, 7, 900, 1234, 5], [77, 78, 79, 80], ce_positions={0, 1})


def assert_rejected(engine, rid, bad: dict, field: str, config: dict | None = None, datum_index: int | None = 1,
                    text: str | None = None):
    """The request [good, bad] is rejected with InvalidInput naming the field and datum; no gradient is left."""
    with pytest.raises(InvalidInput) as e:
        engine.forward_backward(rid, [to_datum(good()), to_datum(bad)], loss_fn="opsd", loss_config=config or {})
    assert e.value.field == field, e.value.message
    assert e.value.datum_index == datum_index, e.value.message
    if text:
        assert text in e.value.message
    assert all(float(g.abs().sum()) == 0 for g in engine.runs[rid].grads.values())


def test_valid_pair_is_accepted(engine, vrun):
    res = engine.forward(vrun, [to_datum(good()), to_datum(good())], loss_fn="opsd")
    assert res.loss > 0 and math.isfinite(res.loss)


def test_kl_ids_duplicate(engine, vrun):
    d = good()
    d["kl_ids"][3] = d["kl_ids"][2]
    assert_rejected(engine, vrun, d, "kl_ids")


def test_kl_ids_gap(engine, vrun):
    d = good()
    d["kl_ids"][6] = 5  # ids 0,1,2,3,5
    assert_rejected(engine, vrun, d, "kl_ids")


def test_teacher_kl_ids_not_0_to_k_minus_1(engine, vrun):
    d = good()
    on = [p for p, m in enumerate(d["teacher_kl_mask"]) if m]
    d["teacher_kl_ids"][on[0]] = 7
    assert_rejected(engine, vrun, d, "teacher_kl_ids")


def test_teacher_kl_count_differs(engine, vrun):
    d = good()
    last = max(p for p, m in enumerate(d["teacher_kl_mask"]) if m)  # holds id 4: ids stay 0..3
    d["teacher_kl_mask"][last] = 0.0
    assert_rejected(engine, vrun, d, "teacher_kl_mask")


def test_paired_target_tokens_differ(engine, vrun):
    d = good()
    on = [p for p, m in enumerate(d["teacher_kl_mask"]) if m]
    for p, i in zip(on, reversed(range(len(on)))):  # pair student k with teacher K-1-k: targets differ
        d["teacher_kl_ids"][p] = i
    assert_rejected(engine, vrun, d, "teacher_target_tokens", text="paired")


@pytest.mark.parametrize("mask", ["loss_mask", "kl_mask", "teacher_kl_mask"])
def test_mask_nonzero_at_trailing_position(engine, vrun, mask):
    d = good()
    d[mask][-1] = 1.0
    assert_rejected(engine, vrun, d, mask, text="trailing")


def test_loss_mask_and_kl_mask_overlap(engine, vrun):
    d = good()
    d["loss_mask"][3] = 1.0  # position 3 is a KL position
    assert_rejected(engine, vrun, d, "loss_mask", text="overlap")


@pytest.mark.parametrize("field,position", [("target_tokens", 0), ("target_tokens", 4),
                                            ("teacher_target_tokens", 8)])
def test_targets_not_next_token_ids(engine, vrun, field, position):
    d = good()
    mask = d["teacher_kl_mask"] if field.startswith("teacher") else [a + b for a, b in zip(d["loss_mask"], d["kl_mask"])]
    assert mask[position] == 1.0
    d[field][position] = 12345
    assert_rejected(engine, vrun, d, field, text="next")


def test_target_mismatch_outside_masks_is_allowed(engine, vrun):
    d = good()
    d["teacher_target_tokens"][0] = 12345  # teacher position 0 is not a KL position: never used
    res = engine.forward(vrun, [to_datum(good()), to_datum(d)], loss_fn="opsd")
    assert math.isfinite(res.loss)


def test_ce_coef_positive_needs_loss_mask_tokens(engine, vrun):
    d = good()
    d["loss_mask"] = [0.0] * len(d["loss_mask"])
    assert_rejected(engine, vrun, d, "loss_mask")
    del d["loss_mask"]  # absent defaults to all zero: the same rule
    assert_rejected(engine, vrun, d, "loss_mask")


def test_ce_coef_zero_needs_kl_tokens(engine, vrun):
    d = good()
    d["kl_mask"] = [0.0] * len(d["kl_mask"])
    d["teacher_kl_mask"] = [0.0] * len(d["teacher_kl_mask"])
    assert_rejected(engine, vrun, d, "kl_mask", config={"ce_coef": 0.0})


@pytest.mark.parametrize("config,field", [
    ({"ce_coef": -0.1}, "loss_config.ce_coef"),
    ({"kl_coef": -1}, "loss_config.kl_coef"),
    ({"ce_coef": float("nan")}, "loss_config.ce_coef"),
    ({"kl_coef": float("inf")}, "loss_config.kl_coef"),
    ({"kl_coef": None}, "loss_config.kl_coef"),
    ({"ce_coef": True}, "loss_config.ce_coef"),
    ({"ce_coef": 0, "kl_coef": 0.0}, "loss_config.kl_coef"),
    ({"beta": 0.1}, "loss_config.beta"),
    ({"ce_coef": 1.0, "teacher_coef": 1.0}, "loss_config.teacher_coef"),
])
def test_bad_config(engine, vrun, config, field):
    assert_rejected(engine, vrun, good(), field, config=config, datum_index=None)


def test_config_defaults():
    assert loss_spec("opsd").config({}) == {"ce_coef": 1.0, "kl_coef": 1.0}
    assert opsd.SPEC.config({"ce_coef": 0, "kl_coef": 2}) == {"ce_coef": 0.0, "kl_coef": 2.0}


@pytest.mark.parametrize("missing", ["teacher_token_ids", "kl_ids", "kl_mask", "teacher_kl_mask",
                                     "teacher_kl_ids", "teacher_target_tokens", "target_tokens"])
def test_missing_required_field(engine, vrun, missing):
    d = good()
    del d[missing]
    assert_rejected(engine, vrun, d, missing, text="required")


def test_teacher_field_sized_by_teacher_stream(engine, vrun):
    d = good()
    d["teacher_kl_mask"] = d["teacher_kl_mask"][:-1]  # [M - 1], not [M]
    assert_rejected(engine, vrun, d, "teacher_kl_mask", text="shape")


def test_micro_batches_merge_to_one_pass(tiny_llama):
    """opsd in micro-batches (one row each, gradients staged) equals one pass: its KL and CE means are
    merged by their own counts (KL pairs, supervised tokens), not by tokens."""
    from whitney.engine import ForwardRequest, merge_results

    engine = Engine()
    engine.create_run("whole", tiny_llama, LORA)
    engine.create_run("split", tiny_llama, LORA)
    data = [to_datum(r) for r in rows_for_engine()]
    config = {"ce_coef": 0.5, "kl_coef": 1.0}
    whole = engine.forward_backward("whole", data, "opsd", config)
    parts = [engine.run_batch([ForwardRequest("split", [d], "opsd", config, stage="op")], backward=True)[0]
             for d in data]
    engine.commit_gradients("split", "op")
    merged = merge_results(parts)
    assert merged.loss == pytest.approx(whole.loss, rel=1e-5)
    assert merged.metrics.keys() == whole.metrics.keys()
    for name, value in whole.metrics.items():
        assert merged.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    tokens_weighted = sum(p.metrics["opsd_kl:mean"] * p.metrics["tokens:sum"] for p in parts) / sum(
        p.metrics["tokens:sum"] for p in parts)
    assert abs(tokens_weighted - whole.metrics["opsd_kl:mean"]) > 1e-4  # the counts matter
    for name, g in engine.runs["whole"].grads.items():
        # float32 rounding: the split sums its rows' gradients in another order (a few ulp at 1)
        torch.testing.assert_close(engine.runs["split"].grads[name], g, rtol=1e-5, atol=1e-6)
