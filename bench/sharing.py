"""Sharing the model: 4 runs training at once through one server (each its own client and thread,
batch 2 x 128) against the same 4 runs one after another. Aggregate throughput = all runs' tokens
over the wall time. The two modes alternate within each round.

Two in-process figures say where the ceiling is: the engine's forward_backward of the 4 runs as one
mixed batch against 4 separate calls (the most the server's batching can gain), and the matmul
throughput of one decoder projection at 4 x 256 rows against 256 rows (what a CPU gains from batching).
"""

from __future__ import annotations

import threading
import time

import torch

from bench.common import alternate, engine_datums, median, sft_batch, start_server
from whitney.engine import DEFAULT_MODEL, Engine, ForwardRequest, LoraConfig


def ceiling(batches: list[list[dict]], rank: int, rounds: int, dtype: str) -> dict:
    """In-process: one mixed batch of every run vs one call per run; matmul rate at n x 256 vs 256 rows."""
    engine = Engine(compute_dtype=dtype)
    engine.load_model(DEFAULT_MODEL)
    datums = [engine_datums(b) for b in batches]
    for i in range(len(batches)):
        engine.create_run(f"r{i}", lora=LoraConfig(rank=rank, seed=i))
    requests = [ForwardRequest(f"r{i}", d) for i, d in enumerate(datums)]

    def mixed() -> None:
        engine.run_batch(requests, backward=True)

    def separate() -> None:
        for r in requests:
            engine.run_batch([r], backward=True)

    mixed()
    times = alternate({"mixed": mixed, "separate": separate}, rounds, "sharing ceiling")
    rows = sum(len(x.token_ids) for d in datums for x in d)
    x_all, x_one = (torch.randn(n, 576, dtype=getattr(torch, dtype)) for n in (rows, rows // len(batches)))
    w = torch.randn(1536, 576, dtype=getattr(torch, dtype))
    rate = {}
    for name, x in (("all_rows", x_all), ("one_run_rows", x_one)):
        torch.nn.functional.linear(x, w)
        t, reps = time.perf_counter(), 50
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        rate[name] = 2 * x.shape[0] * 576 * 1536 * reps / (time.perf_counter() - t) / 1e9
    return {"seconds": {k: median(v) for k, v in times.items()}, "raw_seconds": times, "matmul_gflops": rate,
            "rows": rows}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    import whitney

    n_runs, steps, rounds, batch_size, length, rank = (2, 1, 1, 2, 32, 8) if quick else (4, 3, 3, 2, 128, 32)
    batches = [sft_batch(batch_size, length, seed=10 + i) for i in range(n_runs)]
    total_tokens = n_runs * steps * batch_size * length

    with start_server("--dtype", dtype) as server:
        clients = [whitney.Client(server.url, timeout=600) for _ in range(n_runs)]
        sessions = [c.create_session(purpose=f"bench-sharing-{i}") for i, c in enumerate(clients)]
        runs = [s.create_run(rank=rank, seed=i) for i, s in enumerate(sessions)]

        def train(i: int) -> None:
            for _ in range(steps):
                fb = runs[i].forward_backward(batches[i], "cross_entropy")
                opt = runs[i].optim_step(learning_rate=1e-4)
                fb.result()
                opt.result()

        def concurrent() -> None:
            threads = [threading.Thread(target=train, args=(i,)) for i in range(n_runs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        def sequential() -> None:
            for i in range(n_runs):
                train(i)

        for i in range(n_runs):  # warm-up
            train(i)
        times = alternate({"concurrent": concurrent, "sequential": sequential}, rounds, "sharing")
        for s, c in zip(sessions, clients):
            s.close()
            c.close()

    med = {k: median(v) for k, v in times.items()}
    throughput = {k: total_tokens / v for k, v in med.items()}
    ceil = ceiling(batches, rank, rounds, dtype)
    return {
        "benchmark": "sharing",
        "settings": {"runs": n_runs, "steps_per_run": steps, "rounds": rounds, "batch": batch_size,
                     "seq_len": length, "rank": rank, "dtype": dtype},
        "seconds_per_round": med,
        "tokens_per_s": throughput,
        "raw_seconds_per_round": times,
        "ceiling": ceil,
        "checks": [{"name": f"sharing: aggregate throughput, {n_runs} runs at once / one after another",
                    "ratio": throughput["concurrent"] / throughput["sequential"], "target": 1.3, "op": ">="},
                   {"name": f"(info) sharing ceiling: engine forward_backward, {n_runs} runs as one mixed batch / "
                            f"one call each (throughput)",
                    "ratio": ceil["seconds"]["separate"] / ceil["seconds"]["mixed"], "target": None, "op": None},
                   {"name": f"(info) sharing ceiling: matmul GFLOP/s at {ceil['rows']} rows / at "
                            f"{ceil['rows'] // n_runs} rows ([rows, 576] x [576, 1536], {dtype})",
                    "ratio": ceil["matmul_gflops"]["all_rows"] / ceil["matmul_gflops"]["one_run_rows"],
                    "target": None, "op": None}],
    }
