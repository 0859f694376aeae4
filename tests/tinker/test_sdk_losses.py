"""Every loss's metrics through the real tinker SDK on a real server: once in one request, once chunked.

The SDK splits a forward_backward into requests of at most `fwdbwd_max_chunk_len` datums (1024; also at
most `fwdbwd_max_chunk_bytes_count`, 5 MB of estimated proto bytes; Whitney's client/config keeps both
defaults) and combines their results in `tinker/lib/chunked_fwdbwd_helpers._metrics_reduction`: every
metric name must be `<name>:<reduction>`; a `:sum` adds up over the chunks, a `:mean` is the mean of the
chunks' means weighted by their datums. So a user gets exact sums, and per-chunk means averaged by datums
(exact for a mean over datums, such as `custom/<name>:mean`; a mean over tokens or KL pairs is the
server's own only within one chunk).

Unchunked, each loss's metrics are the set the server reports and equal a float64 reference computed here
from the returned log-probs (and, for opsd, the per-token loss). Chunked, 1024 copies of a short datum F
and then the three datums U go out as two requests (the store shows it); the combined metrics equal
1024 * m(F) + m(U) for sums and (1024 m(F) + 3 m(U)) / 1027 for means, from the one-request results.
One model, never stepped, serves every case, so its log-probs do not change between calls.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.tinker.helpers import close

CHUNK = types.ClientConfigResponse().fwdbwd_max_chunk_len  # datums per request; the server keeps the default
SEQS = [[1, 17, 250, 4000, 12, 99, 3071, 8], [5, 6, 7, 8, 9, 10], [300, 301, 302, 303]]  # the datums U
FILLER = [40, 41, 42, 43]  # the datum F, repeated to fill the first chunk
HINT = [900, 901, 902]  # opsd's teacher stream: the hint, then the student's sequence
K = 3  # soft-target candidates
LOW, HIGH = 0.8, 1.2  # the ratio bounds ppo, gspo and (on the Tinker wire) cispo default to
DRO_BETA = 0.05
OPSD_CONFIG = {"ce_coef": 0.5, "kl_coef": 2.0}
RTOL = 1e-4  # float32 on the server against float64 here

BASE = {"loss:sum", "tokens:sum"}
CASES = {  # case -> (loss_fn, loss_fn_config, the metrics beyond BASE)
    "cross_entropy": ("cross_entropy", None, set()),
    "soft_cross_entropy": ("cross_entropy", None, set()),
    "importance_sampling": ("importance_sampling", None, {"ratio:mean"}),
    "ppo": ("ppo", None, {"clipped_fraction:mean"}),
    "cispo": ("cispo", None, {"clipped_fraction:mean"}),
    "dro": ("dro", None, set()),
    "gspo": ("gspo", None, {"clipped_fraction:mean"}),
    "opsd": ("opsd", OPSD_CONFIG, {"opsd_objective_sum:sum", "opsd_kl:mean", "ce_loss:mean"}),
    "custom": ("custom", None, {"custom/adv:mean", "custom/lp:sum"}),
}


def custom_loss(logprobs, advantages):
    """Per datum: -sum_t l_t A_t, a mean over datums and a sum over datums."""
    return -(logprobs * advantages).sum(), {"custom/adv:mean": advantages.mean(), "custom/lp:sum": logprobs.sum()}


# ---- data -----------------------------------------------------------------------------------------

def row(case: str, seq: list[int], rng: np.random.Generator) -> tuple[list[int], dict[str, np.ndarray]]:
    """One datum of a case: its model input and loss_fn_inputs (N targets for len(seq) - 1 inputs)."""
    if case == "opsd":
        return opsd_row(seq)
    tokens, targets = seq[:-1], np.array(seq[1:], dtype=np.int64)
    n = len(tokens)
    if case == "cross_entropy":
        return tokens, {"target_tokens": targets, "weights": rng.uniform(0.1, 1.0, n).astype(np.float32)}
    if case == "soft_cross_entropy":
        candidates = np.stack([targets + 7 * k for k in range(K)], axis=1)  # [N, K]
        return tokens, {"target_tokens": candidates, "weights": rng.uniform(0.1, 1.0, (n, K)).astype(np.float32)}
    x = {"target_tokens": targets, "advantages": rng.normal(0.0, 1.0, n).astype(np.float32)}
    if case == "custom":
        return tokens, x
    x["logprobs"] = rng.uniform(-11.5, -10.0, n).astype(np.float32)  # ratios on both sides of the bounds
    if case == "gspo":
        x["sequence_ratio_mask"] = np.array([0.0] + [1.0] * (n - 1), dtype=np.float32)
    return tokens, x


def opsd_row(seq: list[int]) -> tuple[list[int], dict[str, np.ndarray]]:
    """Student stream seq [N]: CE on its first half, KL pairs on the rest but the last position, each paired
    with the same position of the teacher stream HINT + seq [M]."""
    n, h = len(seq), len(HINT)
    teacher = HINT + seq
    loss_mask = np.array([i < n // 2 for i in range(n)], dtype=np.float32)
    kl_mask = np.array([n // 2 <= i < n - 1 for i in range(n)], dtype=np.float32)
    kl_ids = np.where(kl_mask > 0, np.cumsum(kl_mask) - 1, 0).astype(np.int64)
    return seq, {"target_tokens": np.array(seq[1:] + [0], dtype=np.int64), "loss_mask": loss_mask,
                 "kl_mask": kl_mask, "kl_ids": kl_ids,
                 "teacher_token_ids": np.array(teacher, dtype=np.int64),
                 "teacher_target_tokens": np.array(teacher[1:] + [0], dtype=np.int64),
                 "teacher_kl_mask": np.concatenate([np.zeros(h, np.float32), kl_mask]),
                 "teacher_kl_ids": np.concatenate([np.zeros(h, np.int64), kl_ids])}


def rows(case: str, seqs: list[list[int]]) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(len(seqs))
    return [row(case, s, rng) for s in seqs]


def datums(items: list[tuple[list[int], dict[str, np.ndarray]]]) -> list:
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=dict(x))
            for tokens, x in items]


# ---- the reference ----------------------------------------------------------------------------------

def reference(case: str, items: list, got) -> dict[str, float]:
    """The metrics of one request, in float64 from its inputs and the returned log-probs (opsd's KL terms from
    the returned per-token loss: at a KL position it is kl_coef * KL / the row's KL pairs)."""
    lps = [o["logprobs"].to_numpy().astype(np.float64) for o in got.loss_fn_outputs]
    els = [o["elementwise_loss"].to_numpy().astype(np.float64) for o in got.loss_fn_outputs]
    xs = [{k: v.astype(np.float64) for k, v in x.items()} for _, x in items]
    out = {"tokens:sum": float(sum(len(lp) for lp in lps))}
    if case in ("cross_entropy", "soft_cross_entropy"):
        # soft: the returned log-prob is the weight-normalised mean over the K candidates
        w = [x["weights"] if x["weights"].ndim == 1 else x["weights"].sum(-1) for x in xs]
        out["loss:sum"] = -sum((wi * lp).sum() for wi, lp in zip(w, lps))
    elif case == "custom":
        out["loss:sum"] = -sum((lp * x["advantages"]).sum() for lp, x in zip(lps, xs))
        out["custom/adv:mean"] = np.mean([x["advantages"].mean() for x in xs])
        out["custom/lp:sum"] = sum(lp.sum() for lp in lps)
    elif case == "opsd":
        ce = [-lp[x["loss_mask"] > 0] for lp, x in zip(lps, xs)]
        kl = [el[x["kl_mask"] > 0] * x["kl_mask"].sum() / OPSD_CONFIG["kl_coef"] for el, x in zip(els, xs)]
        out["loss:sum"] = out["opsd_objective_sum:sum"] = sum(
            OPSD_CONFIG["ce_coef"] * c.mean() + OPSD_CONFIG["kl_coef"] * k.mean() for c, k in zip(ce, kl))
        out["ce_loss:mean"] = np.concatenate(ce).mean()
        out["opsd_kl:mean"] = np.concatenate(kl).mean()
    else:
        lp = np.concatenate(lps)
        q, adv = (np.concatenate([x[k] for x in xs]) for k in ("logprobs", "advantages"))
        ratio = np.exp(lp - q)  # [N]
        if case == "gspo":  # one ratio per datum: exp of the mean over its marked positions
            ratio = np.concatenate([np.full(len(l), np.exp((l - x["logprobs"])[x["sequence_ratio_mask"] > 0].mean()))
                                    for l, x in zip(lps, xs)])
        clipped = np.clip(ratio, LOW, HIGH)
        if case == "importance_sampling":
            out["loss:sum"], out["ratio:mean"] = -(ratio * adv).sum(), ratio.mean()
        elif case in ("ppo", "gspo"):
            out["loss:sum"] = -np.minimum(ratio * adv, clipped * adv).sum()
            out["clipped_fraction:mean"] = (ratio * adv > clipped * adv).mean()
        elif case == "cispo":
            out["loss:sum"] = -(clipped * adv * lp).sum()
            out["clipped_fraction:mean"] = (clipped != ratio).mean()
        elif case == "dro":
            out["loss:sum"] = -(lp * adv - 0.5 * DRO_BETA * (lp - q) ** 2).sum()
    return {k: float(v) for k, v in out.items()}


# ---- the tests -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(service_client, tiny_llama):
    """One training client, never stepped (its adapter stays zero), and the custom loss's uploaded handle."""
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=4, seed=3).result()
    handle = service_client.create_custom_loss(custom_loss, {"logprobs": 1, "advantages": 1}).result()
    assert handle.loss_id is not None  # runs on the server
    return tc, handle


def forward_backward(client, case: str, data: list):
    tc, handle = client
    loss_fn, config, _ = CASES[case]
    if case == "custom":
        return tc.forward_backward_custom(data, handle).result()
    return tc.forward_backward(data, loss_fn, config).result()


def test_every_served_loss_has_a_case():
    from whitney.engine.losses.builtin import LOSSES

    assert {loss_fn for loss_fn, _, _ in CASES.values()} == set(LOSSES)


@pytest.mark.parametrize("case", CASES)
def test_one_request_gives_every_metric_with_its_reduction(client, case):
    items = rows(case, SEQS)
    got = forward_backward(client, case, datums(items))
    want = reference(case, items, got)
    assert set(got.metrics) == BASE | CASES[case][2] == set(want), "a metric the SDK could not combine is missing"
    for key, value in want.items():
        close(got.metrics[key], value, rtol=RTOL)
    if case in ("ppo", "cispo", "gspo"):
        assert 0 < got.metrics["clipped_fraction:mean"] < 1  # the bounds bind on some tokens, not all


@pytest.mark.parametrize("case", CASES)
def test_chunked_request_sums_sums_and_averages_means_by_datums(client, tinker_env, case):
    tc, _ = client
    filler, u = rows(case, [FILLER]), rows(case, SEQS)
    one_f = forward_backward(client, case, datums(filler)).metrics
    one_u = forward_backward(client, case, datums(u)).metrics
    store = tinker_env.app.state.whitney.store
    before = len(store.list_operations(tc.model_id))
    got = forward_backward(client, case, datums(filler * CHUNK + u))
    requests = store.list_operations(tc.model_id)[before:]
    assert [len(op.result["outputs"]) for op in requests] == [CHUNK, len(SEQS)]  # two chunks went out
    assert len(got.loss_fn_outputs) == CHUNK + len(SEQS)
    assert set(got.metrics) == set(one_u) == BASE | CASES[case][2]
    n_f, n_u = CHUNK, len(SEQS)
    for key, value in got.metrics.items():
        if key.endswith(":sum"):
            want = n_f * one_f[key] + one_u[key]  # exactly what one request of all the datums reports
        else:
            assert abs(one_f[key] - one_u[key]) > 1e-3, key  # the weighting shows
            want = (n_f * one_f[key] + n_u * one_u[key]) / (n_f + n_u)  # chunk means weighted by datums
        close(value, want, rtol=RTOL)
