"""Sharing the model: 4 runs training at once through one server (each its own client and thread,
batch 2 x 128) against the same 4 runs one after another. Aggregate throughput = all runs' tokens
over the wall time. The two modes alternate within each round.
"""

from __future__ import annotations

import threading

from bench.common import alternate, median, sft_batch, start_server


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
    return {
        "benchmark": "sharing",
        "settings": {"runs": n_runs, "steps_per_run": steps, "rounds": rounds, "batch": batch_size,
                     "seq_len": length, "rank": rank, "dtype": dtype},
        "seconds_per_round": med,
        "tokens_per_s": throughput,
        "raw_seconds_per_round": times,
        "checks": [{"name": f"sharing: aggregate throughput, {n_runs} runs at once / one after another",
                    "ratio": throughput["concurrent"] / throughput["sequential"], "target": 1.3, "op": ">="}],
    }
