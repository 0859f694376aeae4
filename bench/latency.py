"""Latency of the machinery, against `whitney serve` in its own process (same machine, same clock).

  wake-up     a small forward_backward (1 x 128 tokens, rank 8) is submitted and the client at once
              long-polls it (GET /v1/operations/{id}?wait=30); the wake-up latency is the client's
              wall-clock time on receiving the terminal answer minus the operation's `finished_at`
              (stamped by the server when it records the result). Only samples where the poll was
              sent before `finished_at` count as wake-ups (the others are reported as `missed`).
  round trip  GET /v1/training/capabilities, client-side wall time.
  trivial op  (info) optim_step on the same tiny LoRA: submit -> result, client-side wall time.
"""

from __future__ import annotations

import time

from bench.common import percentile, sft_batch, start_server


def run(quick: bool = False, dtype: str = "float32") -> dict:
    import whitney

    wakeups_n, trips_n = (5, 10) if quick else (30, 100)
    batch = sft_batch(1, 32 if quick else 128, seed=5)
    wake, trip, trivial = [], [], []
    missed = 0
    with start_server("--dtype", dtype) as server:
        client = whitney.Client(server.url, timeout=120)
        session = client.create_session(purpose="bench-latency")
        run_ = session.create_run(rank=8, train_mlp=False, train_unembed=False)
        for _ in range(3):  # warm-up
            run_.forward_backward(batch).result()
            run_.optim_step().result()
            client.capabilities()
        for i in range(max(wakeups_n, trips_n)):
            if i < wakeups_n:
                fb = run_.forward_backward(batch)
                sent = time.time()
                op = client.request("GET", f"/v1/operations/{fb.id}", params={"wait": 30.0}, timeout=60.0)
                received = time.time()
                if op["status"] != "succeeded":
                    raise RuntimeError(f"forward_backward ended {op['status']}: {op.get('error')}")
                if sent < op["finished_at"]:
                    wake.append(received - op["finished_at"])
                else:
                    missed += 1
                t = time.perf_counter()
                run_.optim_step(learning_rate=1e-4).result()
                trivial.append(time.perf_counter() - t)
            if i < trips_n:
                t = time.perf_counter()
                client.capabilities()
                trip.append(time.perf_counter() - t)
        session.close()
        client.close()

    def stats(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_ms": percentile(xs, 0.5) * 1e3, "p90_ms": percentile(xs, 0.9) * 1e3,
                "max_ms": max(xs) * 1e3 if xs else float("nan")}

    s_wake, s_trip, s_trivial = stats(wake), stats(trip), stats(trivial)
    return {
        "benchmark": "latency",
        "settings": {"wakeups": wakeups_n, "round_trips": trips_n, "fb_batch": "1 x %d" % len(batch[0]["input"]["token_ids"]),
                     "rank": 8},
        "wakeup": {**s_wake, "missed": missed}, "round_trip": s_trip, "trivial_op": s_trivial,
        "raw_ms": {"wakeup": [x * 1e3 for x in wake], "round_trip": [x * 1e3 for x in trip],
                   "trivial_op": [x * 1e3 for x in trivial]},
        # Absolute targets: "ratio" holds the p50 in ms.
        "checks": [
            {"name": "latency: long-poll wake-up p50 (ms)", "ratio": s_wake["p50_ms"], "target": 20.0, "op": "<",
             "unit": "ms"},
            {"name": "latency: round trip of GET capabilities p50 (ms)", "ratio": s_trip["p50_ms"], "target": 20.0,
             "op": "<", "unit": "ms"},
            {"name": "(info) latency: optim_step on a rank-8 LoRA, submit -> result p50 (ms)",
             "ratio": s_trivial["p50_ms"], "target": None, "op": None, "unit": "ms"},
        ],
    }
