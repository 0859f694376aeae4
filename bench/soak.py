"""Soak: 32 clients train and sample for minutes with zero errors and flat memory (issue 10, "Done when").

`whitney serve` on the tiny model, in its own process, loopback only. Each of 32 clients has its own
session and rank-8 run and loops: forward_backward (2 x 48 tokens) + optim_step, and every 4th step
save_weights_for_sampler + an 8-token sample of that version, until the deadline. Every error counts.
Memory: the server's RSS is read every 2 s; after the warm-up (the first third of the time) it must stay
flat: the growth from the end of warm-up to the end, relative to the RSS at the end of warm-up
(target at most 5%). Operations/s and latencies are reported for information.
"""

from __future__ import annotations

import threading
import time

from bench.common import Clients, percentile, sft_batch, start_server, timed, tiny_model


def run(quick: bool = False, dtype: str = "float32") -> dict:
    seconds = 30 if quick else 180
    n = 8 if quick else 32
    batches = [sft_batch(2, 48, seed=i) for i in range(n)]
    rss: list[tuple[float, float]] = []  # (seconds since start, MiB)
    with start_server("--dtype", dtype, model=tiny_model()) as server:
        done = threading.Event()
        t0 = time.monotonic()

        def sample_rss() -> None:
            while not done.wait(2.0):
                rss.append((time.monotonic() - t0, server.status()["VmRSS"] / 1024))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()

        def setup(i: int, client):
            run_ = client.create_session(bench="soak").create_run(rank=8, seed=i)
            return {"run": run_, "steps": 0}

        def step(i: int, state):
            run_ = state["run"]
            fb = run_.forward_backward(batches[i])
            opt = run_.optim_step(learning_rate=1e-4)
            out = [("forward_backward", timed(fb)), ("optim_step", timed(opt))]
            state["steps"] += 1
            if state["steps"] % 4 == 0:
                save = run_.save_weights_for_sampler()
                out.append(("save_weights_for_sampler", timed(save)))
                version = save.result()["version"]
                sample = run_.sample(batches[i][0]["input"]["token_ids"][:16], version, max_tokens=8, temperature=1.0)
                out.append(("sample", timed(sample)))
                if len(sample.result()["sequences"][0]["tokens"]) == 0:
                    raise RuntimeError("a sample came back empty")
            return out

        clients = Clients(server.url)
        clients.run(n, setup, step, seconds)
        done.set()
        sampler.join()
        elapsed = time.monotonic() - t0

    warm = [m for t, m in rss if t >= seconds / 3]
    growth = (warm[-1] - warm[0]) / warm[0] if len(warm) >= 2 else float("nan")
    ops = sum(len(v) for v in clients.latencies.values())
    latency = {k: {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)}
               for k, v in clients.latencies.items()}
    return {
        "benchmark": "soak",
        "settings": {"seconds": seconds, "clients": n, "batch": "2 x 48", "sample_every": 4, "sample_tokens": 8,
                     "model": "tiny llama (2 x 64)", "rank": 8},
        "operations": ops, "operations_per_s": ops / elapsed, "errors": clients.errors[:10],
        "n_errors": len(clients.errors), "latency": latency,
        "rss_mib": [[round(t, 1), round(m, 1)] for t, m in rss],
        "checks": [
            {"name": "soak: errors over the whole run", "ratio": float(len(clients.errors)), "target": 0.0,
             "op": "<=", "unit": "errors"},
            {"name": "soak: server RSS growth after warm-up (fraction)", "ratio": growth, "target": 0.05,
             "op": "<="},
            {"name": "(info) soak: operations/s over all clients", "ratio": ops / elapsed, "target": None,
             "op": None, "unit": "ops/s"},
        ],
    }
