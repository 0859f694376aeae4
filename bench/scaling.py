"""Scaling, in-process through the engine (the compute the service wraps).

  sequence length  one SFT step (forward_backward + optim_step, rank 32) on batch 1 as the length doubles
                   from 128 to 1024
  batch size       the same step at length 128 as the batch doubles from 1 to 8
  sampling         time per generated token (wall time / all new tokens, and per decode step) as the
                   number of concurrent sequences doubles from 1 to 64 (32 new tokens each)

Each repetition sweeps every size once (sizes alternate); medians over repetitions. The exponent is
the slope of log(time) against log(size), fitted by least squares: 1.0 = linear, 2.0 = quadratic.
"""

from __future__ import annotations

import math
import time

from bench.common import engine_datums, median, sft_batch
from whitney.engine import DEFAULT_MODEL, Engine, LoraConfig
from whitney.protocol.sampling import SamplingParams


def exponent(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def run(quick: bool = False, dtype: str = "float32") -> dict:
    from bench.sampling import prompts

    if quick:
        lengths, batches, concurrency, new_tokens, reps = [32, 64], [1, 2], [1, 4], 4, 1
    else:
        lengths, batches, concurrency, new_tokens, reps = [128, 256, 512, 1024], [1, 2, 4, 8], \
            [1, 2, 4, 8, 16, 32, 64], 32, 3
    rank = 8 if quick else 32
    engine = Engine(compute_dtype=dtype)
    base = engine.load_model(DEFAULT_MODEL)
    engine.create_run("scale", lora=LoraConfig(rank=rank))

    def step(n: int, length: int) -> float:
        datums = engine_datums(sft_batch(n, length, seed=7))
        t = time.perf_counter()
        engine.forward_backward("scale", datums, "cross_entropy")
        engine.optim_step("scale", {"learning_rate": 1e-4})
        return time.perf_counter() - t

    ids = prompts(base.tokenizer, max(concurrency))

    def sample(n: int) -> float:
        t = time.perf_counter()
        reqs = [engine.submit_sample(p, SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, stop=()),
                                     base_model=DEFAULT_MODEL) for i, p in enumerate(ids[:n])]
        while engine.sample_step():
            pass
        made = sum(len(s.tokens) for r in reqs for s in r.result.sequences)
        assert made == n * new_tokens, made
        return time.perf_counter() - t

    step(1, lengths[0])  # warm-up
    sample(2)
    seq_t: dict[int, list[float]] = {n: [] for n in lengths}
    batch_t: dict[int, list[float]] = {n: [] for n in batches}
    samp_t: dict[int, list[float]] = {n: [] for n in concurrency}
    for r in range(reps):
        for length in lengths:
            seq_t[length].append(step(1, length))
            print(f"  scaling rep {r} length {length}: {seq_t[length][-1]:.3f}s", flush=True)
        for n in batches:
            batch_t[n].append(step(n, lengths[0]))
            print(f"  scaling rep {r} batch {n}: {batch_t[n][-1]:.3f}s", flush=True)
        for n in concurrency:
            samp_t[n].append(sample(n))
            print(f"  scaling rep {r} {n} sequences: {samp_t[n][-1]:.3f}s", flush=True)

    seq_med = {n: median(v) for n, v in seq_t.items()}
    batch_med = {n: median(v) for n, v in batch_t.items()}
    samp_med = {n: median(v) for n, v in samp_t.items()}
    exps = [exponent(lengths, [seq_med[n] for n in lengths]), exponent(batches, [batch_med[n] for n in batches]),
            exponent(concurrency, [samp_med[n] for n in concurrency])]
    return {
        "benchmark": "scaling",
        "settings": {"lengths": lengths, "batches": batches, "batch_for_lengths": 1, "length_for_batches": lengths[0],
                     "concurrency": concurrency, "new_tokens": new_tokens, "reps": reps, "rank": rank,
                     "dtype": dtype},
        "step_seconds_by_length": {str(k): v for k, v in seq_med.items()},
        "step_seconds_by_batch": {str(k): v for k, v in batch_med.items()},
        "sampling_seconds_by_concurrency": {str(k): v for k, v in samp_med.items()},
        "sampling_ms_per_token": {str(k): v / (k * new_tokens) * 1e3 for k, v in samp_med.items()},
        "sampling_ms_per_decode_step": {str(k): v / new_tokens * 1e3 for k, v in samp_med.items()},
        "exponent_length": exps[0],
        "exponent_batch": exps[1],
        "exponent_sampling": exps[2],
        "checks": [
            {"name": f"(info) scaling: step time exponent in sequence length {lengths[0]}..{lengths[-1]}",
             "ratio": exps[0], "target": None, "op": None, "unit": "exponent"},
            {"name": f"(info) scaling: step time exponent in batch size {batches[0]}..{batches[-1]}",
             "ratio": exps[1], "target": None, "op": None, "unit": "exponent"},
            {"name": f"(info) scaling: sampling wall time exponent in concurrent sequences "
                     f"{concurrency[0]}..{concurrency[-1]}", "ratio": exps[2], "target": None, "op": None,
             "unit": "exponent"},
        ],
    }
