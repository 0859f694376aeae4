"""Memory: peak RSS (VmHWM) of a `whitney serve` process holding 1 run against one holding 8 runs
(LoRA rank 32), after one training step (forward_backward + optim_step, batch 2 x 128) of every run.

Each server is a fresh process. The runs' steps go one at a time (each awaited before the next is
sent), so the peak activations are those of one step in both cases and the difference is what the
extra runs hold: adapters, gradient accumulators and AdamW moments. Servers alternate 1, 8, 1, 8...
"""

from __future__ import annotations

from bench.common import median, sft_batch, start_server


def measure(n_runs: int, rank: int, batch: list[dict], dtype: str = "float32") -> dict:
    import whitney

    with start_server("--dtype", dtype) as server:
        idle = server.status()
        client = whitney.Client(server.url, timeout=600)
        session = client.create_session(purpose="bench-memory")
        for i in range(n_runs):
            run = session.create_run(rank=rank, seed=i)
            run.forward_backward(batch, "cross_entropy").result()
            run.optim_step(learning_rate=1e-4).result()
        after = server.status()
        session.close()
        client.close()
    return {"runs": n_runs, "idle_hwm_kib": idle["VmHWM"], "hwm_kib": after["VmHWM"], "rss_kib": after["VmRSS"]}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    few, many, rounds, batch_size, length, rank = (1, 2, 1, 2, 32, 8) if quick else (1, 8, 2, 2, 128, 32)
    batch = sft_batch(batch_size, length, seed=3)
    samples: dict[int, list[dict]] = {few: [], many: []}
    for r in range(rounds):
        for n in (few, many):
            samples[n].append(measure(n, rank, batch, dtype))
            print(f"  memory round {r} {n} runs: peak RSS {samples[n][-1]['hwm_kib'] / 1024:.0f} MiB", flush=True)
    peak = {n: median([s["hwm_kib"] for s in v]) / 1024 for n, v in samples.items()}
    return {
        "benchmark": "memory",
        "settings": {"runs": [few, many], "rank": rank, "batch": batch_size, "seq_len": length, "rounds": rounds,
                     "dtype": dtype},
        "peak_rss_mib": {str(n): v for n, v in peak.items()},
        "raw": {str(n): v for n, v in samples.items()},
        "checks": [{"name": f"memory: peak RSS of the server with {many} runs / with {few} run",
                    "ratio": peak[many] / peak[few], "target": 1.15, "op": "<="}],
    }
