"""The accelerator's batched LoRA deltas (RowGroups._batched_delta) equal the per-group loop.

On an accelerator RowGroups.apply takes a mixed batch's deltas in two batched matmuls instead of a loop over
its groups (on a GPU, 32 runs' loop made a round 14x slower than one run's same tokens). The CPU keeps the
loop, so the suite checks the batched path here, on the CPU in float64: the same values and the same
gradients in x, A and B, with unequal ranks and lengths, rows of no adapter, and an adapter without the module.
"""

from __future__ import annotations

import torch

from whitney.engine.families.lora import Adapter, RowGroups, _batched
from whitney.protocol.training import LoraConfig

IN, OUT = 6, 5


def _adapter(rank: int, seed: int, names=("q", "v"), alpha: float = 16.0) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    A = {n: torch.randn(rank, IN, generator=g, dtype=torch.float64, requires_grad=True) for n in names}
    B = {n: torch.randn(OUT, rank, generator=g, dtype=torch.float64, requires_grad=True) for n in names}
    return Adapter(LoraConfig(rank=rank, alpha=alpha), A, B)


def _reference(name: str, bounds: list[tuple], x: torch.Tensor) -> torch.Tensor:
    """y's delta row by row in float64: scale * x @ A^T @ B^T for each row of an adapter with `name`."""
    rows = []
    for start, end, adapter in bounds:
        for r in range(start, end):
            if adapter is None or name not in adapter.A:
                rows.append(torch.zeros(*x.shape[1:-1], OUT, dtype=torch.float64))
            else:
                rows.append(adapter.scale * (x[r] @ adapter.A[name].T) @ adapter.B[name].T)
    return torch.stack(rows)


def test_batched_deltas_equal_the_loop_and_its_gradients():
    a, b, c = _adapter(4, 1), _adapter(2, 2, alpha=3.0), _adapter(3, 3, names=("v",))
    bounds = [(0, 3, a), (3, 4, None), (4, 8, b), (8, 10, c), (10, 12, a)]
    x = torch.randn(12, 7, IN, dtype=torch.float64, requires_grad=True)  # [R, T, in]
    y = torch.randn(12, 7, OUT, dtype=torch.float64)
    upstream = torch.randn(12, 7, OUT, dtype=torch.float64)
    params = [x, *a.parameters(), *b.parameters(), *c.parameters()]
    groups = RowGroups(bounds)
    for name in ("q", "v"):
        adapted = [(range(s, e), ad) for s, e, ad in bounds if ad is not None and name in ad.A]
        batched = y + groups._batched_delta(name, adapted, x).reshape(y.shape)
        looped = groups.apply(name, x, y.clone())  # the CPU's loop (its few-row deltas in float32)
        want = y + _reference(name, bounds, x)
        torch.testing.assert_close(batched, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(looped, want, rtol=1e-5, atol=1e-4)
        got_grads = torch.autograd.grad(batched, params, upstream, allow_unused=True)
        want_grads = torch.autograd.grad(want, params, upstream, allow_unused=True)
        for got, ref in zip(got_grads, want_grads):
            if ref is None:  # a tensor this module does not use: no gradient, or an exact zero one
                assert got is None or not got.any()
            else:
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # Two-dimensional rows (the decode-free [R, in] case) too.
    x2 = torch.randn(12, IN, dtype=torch.float64)
    adapted = [(range(s, e), ad) for s, e, ad in bounds if ad is not None]
    torch.testing.assert_close(groups._batched_delta("v", adapted, x2), _reference("v", bounds, x2),
                               rtol=1e-12, atol=1e-12)


def test_batched_deltas_of_scattered_rows_equal_the_loop():
    """The decode batch's index groups (rows joining and leaving in any order), batched as on an accelerator."""
    a, b = _adapter(4, 1), _adapter(2, 2, alpha=3.0)
    x = torch.randn(7, IN, dtype=torch.float64)
    y = torch.randn(7, OUT, dtype=torch.float64)
    adapted = [(torch.tensor([5, 0, 3]), a), (torch.tensor([1, 6]), b)]  # rows 2 and 4: the base model alone
    groups = RowGroups([adapted[0], (torch.tensor([2, 4]), None), adapted[1]])
    want = y.clone()
    for rows, adapter in adapted:
        want[rows] += adapter.scale * (x[rows] @ adapter.A["q"].T) @ adapter.B["q"].T
    got = y + groups._batched_delta("q", adapted, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(groups.apply("q", x, y.clone()), want, rtol=1e-5, atol=1e-4)  # the CPU's loop


def test_batched_only_on_an_accelerator_for_several_groups_without_much_padding():
    on = lambda device: torch.empty(0, IN, device=device)  # noqa: E731 - only the device is read
    assert not _batched([4, 4], on("cpu")), "the CPU keeps the loop"
    assert _batched([4, 4], on("meta"))
    assert not _batched([4], on("meta")), "one group needs no batching"
    assert _batched([4, 2], on("meta"))  # 2 * 4 padded rows <= 2 * 6
    assert not _batched([10, 1, 1], on("meta")), "30 padded rows for 12"


def test_an_engine_with_batched_deltas_gives_the_loops_numbers(tiny_model, monkeypatch):
    """The engine end to end with the batched path forced on (as on an accelerator), on the CPU: a mixed
    batch of three runs of different ranks (one without an unembedding adapter), two steps, then a
    multi-run greedy sample: losses and weights to float32 rounding, tokens exactly."""
    from whitney.engine import Datum, Engine, ForwardRequest
    from whitney.engine.families import lora
    from whitney.protocol.sampling import SamplingParams
    from whitney.protocol.training import AdamParams

    def run(engine: Engine):
        configs = [LoraConfig(rank=4, seed=0), LoraConfig(rank=6, seed=1, train_unembed=False), LoraConfig(rank=2, seed=2)]
        for i, config in enumerate(configs):
            engine.create_run(f"r{i}", tiny_model, config)
        requests = [ForwardRequest(f"r{i}", [Datum([(7 * i + 3 * j + k) % 500 + 3 for j in range(10 + 3 * i)],
                                                   {"target_tokens": [(7 * i + 3 * j + k + 1) % 500 + 3
                                                                      for j in range(10 + 3 * i)]})
                                             for k in range(1 + i % 2)]) for i in range(3)]
        losses = []
        for _ in range(2):
            losses += [r.loss for r in engine.run_batch(requests, True)]
            engine.optim_steps([(f"r{i}", AdamParams(learning_rate=1e-2)) for i in range(3)])
        versions = [engine.save_weights_for_sampler(f"r{i}") for i in range(3)]
        pending = [engine.submit_sample([(5 * i + j) % 400 + 3 for j in range(6 + i)],
                                        SamplingParams(max_tokens=6, temperature=0.0, stop=()),
                                        run_id=f"r{i % 3}", version=versions[i % 3]) for i in range(5)]
        while engine.sample_step():
            pass
        weights = {(i, n): t.detach().clone() for i in range(3) for n, t in engine.runs[f"r{i}"].adapter.named_parameters()}
        return losses, weights, [p.result.sequences[0].tokens for p in pending]

    want = run(Engine())
    monkeypatch.setattr(lora, "_accelerated", lambda x: True)  # batched wherever _batched's padding rule allows
    calls = []
    batched_delta = lora.RowGroups._batched_delta
    monkeypatch.setattr(lora.RowGroups, "_batched_delta", lambda *a: calls.append(1) or batched_delta(*a))
    got = run(Engine())
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-5)
    for key, w in want[1].items():
        torch.testing.assert_close(got[1][key], w, rtol=1e-4, atol=1e-6)
    assert got[2] == want[2]
    assert calls, "the batched path ran"
