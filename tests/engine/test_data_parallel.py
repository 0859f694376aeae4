"""Data parallelism (engine/training/data_parallel.py): the rows of each pass split over 2 gloo ranks compute
what the unsharded engine computes, on the fast path, the general path, a MoE family and a vision family.

One scenario (`_scenario`) runs on the unsharded Engine in this process and on each of two ranks: mixed runs in
one call (cross_entropy, importance_sampling, opsd with its teacher pass, and a custom graph that is not a sum
over datums), a call of one datum (one rank holds no row at all), a call where each rank holds one run only, a
forward and compute_logprobs, optim_steps of several runs at once and of one run. Losses, metrics, per-token
log-probs, the first gradients, weights and AdamW moments after every step, and sampled tokens are compared.

Tolerances: float32 rounding. The ranks sum a gradient in another order than one process (its rows' shares, then
the all-reduce), so gradient elements differ by rounding, about 1e-11 for the unembedding's sums over 49k rows.
AdamW divides each element by its own magnitude plus eps, which turns a relative difference in an element near
zero into the same relative difference of a whole step (lr): with Tinker's eps of 1e-12 an element no target
touches can take most of a step either way. The steps here use torch's eps (1e-8), and weights are compared to
`ADAM_ATOL` = 1% of the learning rate per step taken; gradients, losses and log-probs at every step, tightly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models import VOCAB, make_tiny_general_model, make_tiny_vision_model
from whitney.engine import Datum, Engine, ForwardRequest, ForwardResult, LoraConfig
from whitney.engine.training.data_parallel import assign_rows
from whitney.engine.training.sharded import ShardedEngine, spawn_ranks
from whitney.protocol.sampling import SamplingParams
from whitney.protocol.training import AdamParams

REL = 1e-5
HP = AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.1, gradient_clip_norm=1.0)
ADAM_ATOL = 1e-2 * HP.learning_rate  # per step taken (see the module docstring)
LORA = {"ce": LoraConfig(rank=4, alpha=8.0, seed=1),
        "is": LoraConfig(rank=2, alpha=4.0, seed=2, target_modules=("q_proj", "v_proj", "o_proj", "lm_head")),
        "graph": LoraConfig(rank=4, alpha=8.0, seed=3),
        "opsd": LoraConfig(rank=2, alpha=4.0, seed=4, train_unembed=False)}


# ---- the split --------------------------------------------------------------------------------------------------


def test_rows_are_dealt_whole_longest_first_to_the_least_loaded_rank():
    assert assign_rows([5, 9, 3, 7], 2) == [1, 0, 0, 1]  # 9 -> 0, 7 -> 1, 5 -> 1 (7 < 9), 3 -> 0: 12 and 12
    assert assign_rows([4], 2) == [0]  # one datum: rank 1 holds none
    assert assign_rows([3, 3], 4) == [0, 1]  # fewer datums than ranks
    assert assign_rows([], 2) == []
    lengths = torch.randint(1, 200, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    owner = assign_rows(lengths, 3)
    loads = [sum(n for n, r in zip(lengths, owner) if r == k) for k in range(3)]
    assert max(loads) - min(loads) <= max(lengths), loads


# ---- the scenario -----------------------------------------------------------------------------------------------


def _tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _ce(lengths, g) -> list[Datum]:
    return [Datum(_tokens(n, g), {"target_tokens": _tokens(n, g), "weights": torch.rand(n, generator=g).tolist()})
            for n in lengths]


def _is(lengths, g) -> list[Datum]:
    return [Datum(_tokens(n, g), {"target_tokens": _tokens(n, g), "old_logprobs": [-11.0] * n,
                                  "advantages": torch.randn(n, generator=g).tolist()}) for n in lengths]


def _graph_request(g) -> ForwardRequest:
    """A custom graph whose loss divides by the sum of every datum's weights: not a sum over datums."""
    from tests.engine.test_custom_loss import definition, weighted_nll

    data = [Datum(_tokens(n, g), {"target_tokens": _tokens(n, g),
                                  "weights": {"dtype": "float32", "shape": [n],
                                              "values": torch.rand(n, generator=g).tolist()}}) for n in (6, 2, 4)]
    return ForwardRequest("graph", data, "custom", definition(weighted_nll, {"logprobs": 1, "weights": 1}))


def _opsd_request() -> ForwardRequest:
    from tests.engine.test_opsd import rows_for_engine, to_datum

    return ForwardRequest("opsd", [to_datum(r) for r in rows_for_engine()], "opsd", {"kl_coef": 1.5})


def _record(out: dict, results: list) -> None:
    assert all(isinstance(r, ForwardResult) for r in results), results
    out["losses"].append([r.loss for r in results])
    out["metrics"].append([r.metrics for r in results])
    out["logprobs"].append([x for r in results for o in r.outputs for x in o.logprobs])


def whole_gradient(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    """A copy of the run's gradient (zero for a weight without one, as optim_step counts it): on a rank, the ranks'
    shares summed (an optim_step sums them itself)."""
    run = engine.get_run(run_id)
    grads = {k: run.grads[k].clone() if k in run.grads else torch.zeros_like(p)
             for k, p in run.adapter.named_parameters()}
    if isinstance(engine, ShardedEngine):
        for g in grads.values():
            dist.all_reduce(g)
    return grads


def adam_state(engine: Engine, run_id: str) -> dict:
    run = engine.get_run(run_id)
    return {"weights": {k: w.detach().clone() for k, w in run.weights().items()},
            "exp_avg": {k: t.clone() for k, t in run.optimizer.exp_avg.items()},
            "exp_avg_sq": {k: t.clone() for k, t in run.optimizer.exp_avg_sq.items()}}


def _scenario(engine: Engine, model: str, text_only: bool = True, images: list[list] | None = None) -> dict:
    """What the reference and each rank run (see the module docstring); `images`: prompts with image chunks for
    the ce run (a vision family, whose losses are here cross_entropy and importance_sampling)."""
    runs = LORA if text_only else {k: LORA[k] for k in ("ce", "is")}
    for run_id, config in runs.items():
        engine.create_run(run_id, model, config)
    rows = []
    forward_hidden = engine.load_model(model).forward_hidden

    def counted(tokens, *args, **kwargs):
        rows.append(int(tokens.shape[0]))
        return forward_hidden(tokens, *args, **kwargs)

    engine.models[engine.load_model(model).name].forward_hidden = counted
    out: dict = {"losses": [], "metrics": [], "logprobs": [], "steps": []}
    g = torch.Generator().manual_seed(7)
    first = [ForwardRequest("ce", images or _ce((5, 9, 3, 11), g)), ForwardRequest("is", _is((7,), g), "importance_sampling")]
    if text_only:
        first += [_graph_request(g), _opsd_request()]
    _record(out, engine.run_batch(first, backward=True))
    out["first_grads"] = {r: whole_gradient(engine, r) for r in runs}
    out["steps"].append(engine.optim_steps([(r, HP) for r in runs]))
    out["after_first"] = {r: adam_state(engine, r) for r in runs}
    # One datum in the whole call: one rank runs a padding row.
    _record(out, engine.run_batch([ForwardRequest("ce", _ce((6,), g))], backward=True))
    out["steps"].append([engine.optim_step("ce", HP)])
    # Two datums of two runs: each rank holds one run only; a second call adds to the same gradients.
    for _ in range(2):
        _record(out, engine.run_batch([ForwardRequest("ce", _ce((8,), g)), ForwardRequest("is", _is((8,), g), "importance_sampling")],
                                      backward=True))
    out["steps"].append(engine.optim_steps([("ce", HP), ("is", HP)]))
    out["final"] = {r: adam_state(engine, r) for r in runs}
    _record(out, engine.run_batch([ForwardRequest("is", _is((4, 9, 2), g), "importance_sampling")], backward=False))
    seqs = [[1, 504, 2710, 88, 12, 9001, 33, 7], [1, 3000, 17], [1, 45, 45, 1200, 31000, 5, 6, 77, 408, 2]]
    version = engine.save_weights_for_sampler("ce")
    out["scored"] = engine.compute_logprobs(seqs, run_id="ce", version=version)
    result = engine.sample(seqs[0], SamplingParams(max_tokens=5, seed=3, num_samples=2, stop=()), run_id="ce",
                           version=version)
    out["samples"] = [(s.tokens, s.logprobs) for s in result.sequences]
    out["rows"] = rows
    return out


def _on_rank(model: str, text_only: bool, images_of) -> dict:
    engine = ShardedEngine()
    return _scenario(engine, model, text_only, images_of(engine, model) if images_of else None)


# ---- comparing --------------------------------------------------------------------------------------------------


def assert_close(got, want, what: str, atol: float | None = None) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), what
        for k in want:
            assert_close(got[k], want[k], f"{what}.{k}", atol)
        return
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    tol = REL * max(1e-3, float(want.abs().max())) if atol is None else atol
    torch.testing.assert_close(got, want, rtol=REL, atol=tol, msg=lambda m: f"{what}: {m}")


def assert_states_close(got: dict, want: dict, atol: float, what: str) -> None:
    """Runs' `adam_state`s equal to float32 rounding: weights within `atol` (see the module docstring), AdamW moments
    (of gradients at weights already that close) within 1e-4 of their largest element."""
    for run_id, state in want.items():
        assert_close(got[run_id]["weights"], state["weights"], f"{what}.{run_id}", atol=atol)
        for moment in ("exp_avg", "exp_avg_sq"):
            for k, w in state[moment].items():
                assert_close(got[run_id][moment][k], w, f"{what}.{run_id}.{moment}.{k}", atol=1e-4 * float(w.abs().max()))


def _flat(nested) -> list[float]:
    return [x for row in nested for x in row if x is not None]


def _compare(ranks: list[dict], reference: dict) -> None:
    for r in ranks:
        assert_close(_flat(r["losses"]), _flat(reference["losses"]), "losses")
        assert_close(_flat(r["logprobs"]), _flat(reference["logprobs"]), "per-token log-probs")
        for got, want in zip(r["metrics"], reference["metrics"]):
            for m_got, m_want in zip(got, want):
                assert_close(m_got, m_want, "metrics")
        assert_close(r["first_grads"], reference["first_grads"], "first gradients")
        for when, steps in (("after_first", 1), ("final", 3)):  # ce took 3 steps, the others at most 2
            assert_states_close(r[when], reference[when], steps * ADAM_ATOL, when)
        assert_close([m["grad_norm"] for step in r["steps"] for m in step],
               [m["grad_norm"] for step in reference["steps"] for m in step], "grad norms")
        assert_close(_flat(r["scored"]), _flat(reference["scored"]), "compute_logprobs", atol=1e-4)
        assert [t for t, _ in r["samples"]] == [t for t, _ in reference["samples"]]
    first, second = ranks
    assert first["losses"] == second["losses"] and first["logprobs"] == second["logprobs"], "ranks agree exactly"
    for run_id in first["final"]:
        for part, tensors in first["final"][run_id].items():
            for k, t in tensors.items():
                assert torch.equal(t, second["final"][run_id][part][k]), f"{run_id}.{part}.{k} differs by rank"
    # The rows were split: each rank ran about half of each call's datums (the padding row of the one-datum call on
    # rank 1); the unsharded engine ran all of them.
    rows = [r["rows"] for r in ranks]
    assert sum(rows[0]) + sum(rows[1]) < sum(reference["rows"]) + len(rows[1]), (rows, reference["rows"])
    assert len(rows[0]) == len(rows[1]), "every rank ran every pass"


def test_fast_path_mixed_runs_opsd_and_a_custom_graph_equal_unsharded(tiny_qwen3):
    reference = _scenario(Engine(device="cpu"), tiny_qwen3)
    _compare(spawn_ranks(2, _on_rank, tiny_qwen3, True, None, backend="gloo", timeout=300), reference)


@pytest.mark.parametrize("kind", ["mistral", "qwen3_moe"])
def test_general_path_and_moe_equal_unsharded(tmp_path, kind):
    path = str(make_tiny_general_model(tmp_path / kind, kind))
    reference = _scenario(Engine(device="cpu"), path)
    _compare(spawn_ranks(2, _on_rank, path, True, None, backend="gloo", timeout=300), reference)


def _vision_data(engine: Engine, path: str) -> list[Datum]:
    """Four ce datums: two hold images, two are text."""
    from tests.engine.test_vision import _chunked, _data, _image, _tokens as words

    return _data([_chunked(3), [words(11, 1)], [words(2, 3), _image(5, 32, 64)], [words(6, 4)]], engine, path)


def test_vision_family_with_image_rows_equals_unsharded(tmp_path):
    path = str(make_tiny_vision_model(tmp_path / "qwen3_vl", "qwen3_vl"))
    reference_engine = Engine(device="cpu")
    reference = _scenario(reference_engine, path, False, _vision_data(reference_engine, path))
    _compare(spawn_ranks(2, _on_rank, path, False, _vision_data, backend="gloo", timeout=300), reference)
