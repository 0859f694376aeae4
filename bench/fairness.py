"""Fairness: one client's largest allowed batch must not freeze 31 others (issue 10, item 1).

`whitney serve` on the tiny model, in its own process. 31 small clients, each its own session and
rank-8 run, loop forward_backward (4 x 64 tokens) + optim_step. Two phases of equal length, in one run:
  alone       the 31 small clients only;
  contended   the same, while one more client submits forward_backward operations of the largest size
              the server allows (--max-operation-tokens, as 512-token datums: the tiny model's context) back to back.
Latency of an operation: from submission to result as the server stamps them (created_at ->
finished_at), so client threads on the same 2 cores do not blur it. The check: the small clients'
p99 forward_backward latency contended / alone (target at most 3). Before micro-batching, a big
operation held the worker for its whole length (64 x 2048 tokens: 263 s, with 31 clients starved).
Now it runs at its fair share, one of 32 runs, so it need not finish within the phase; the small
clients' operations completed in each phase show how much of the worker went to it.
"""

from __future__ import annotations

import time

from bench.common import Clients, sft_batch, start_server, timed, tiny_model


def run(quick: bool = False, dtype: str = "float32") -> dict:
    seconds = 20 if quick else 90
    n_small = 8 if quick else 31
    big_tokens = 16_384 if quick else 65_536  # the server is started with this as --max-operation-tokens
    datum_len = 512  # the tiny model's context
    small_batch = [sft_batch(4, 64, seed=i) for i in range(n_small)]
    big_batch = sft_batch(big_tokens // datum_len, datum_len, seed=99, prompt=64)
    phases = {}
    with start_server("--dtype", dtype, "--max-operation-tokens", str(big_tokens), "--max-sequences", "64",
                      model=tiny_model()) as server:

        def setup(i: int, client):
            return client.create_session(bench="fairness").create_run(rank=8, seed=i)

        def small_step(i: int, run_):
            fb = run_.forward_backward(small_batch[i])
            opt = run_.optim_step(learning_rate=1e-4)
            return [("forward_backward", timed(fb)), ("optim_step", timed(opt))]

        def big_step(i: int, run_):
            if i < n_small:
                return small_step(i, run_)
            fb = run_.forward_backward(big_batch)
            op = fb.wait(timeout=max(1.0, clients.deadline - time.monotonic()))
            if op["status"] != "succeeded":  # still running when the phase ends: it has its fair share only
                return [("big_forward_backward_unfinished", 1.0)]
            return [("big_forward_backward", op["finished_at"] - op["created_at"])]

        import whitney

        with whitney.Client(server.url) as client:
            limits = client.capabilities()["limits"]
        warm = Clients(server.url)
        warm.run(n_small, setup, small_step, 5 if quick else 15)
        for name, n, step in (("alone", n_small, small_step), ("contended", n_small + 1, big_step)):
            clients = Clients(server.url)  # big_step reads its deadline
            clients.run(n, setup, step, seconds)
            phases[name] = clients

    alone, contended = phases["alone"].summary(), phases["contended"].summary()
    ratio = contended["forward_backward"]["p99_s"] / alone["forward_backward"]["p99_s"]
    big = contended.get("big_forward_backward", {"n": 0})
    return {
        "benchmark": "fairness",
        "settings": {"seconds_per_phase": seconds, "small_clients": n_small, "small_batch": "4 x 64",
                     "big_batch": f"{big_tokens // datum_len} x {datum_len}", "model": "tiny llama (2 x 64)",
                     "rank": 8, "max_batch_tokens": limits["max_batch_tokens"]},
        "alone": alone, "contended": contended,
        "checks": [
            {"name": "fairness: small clients' p99 forward_backward latency, with / without one largest-batch "
                     "client", "ratio": ratio, "target": 3.0, "op": "<="},
            {"name": "(info) fairness: the largest-batch client's operations completed within the phase",
             "ratio": float(big["n"]), "target": None, "op": None, "unit": "ops"},
            {"name": "(info) fairness: small clients' forward_backward operations completed, with / without",
             "ratio": contended["forward_backward"]["n"] / alone["forward_backward"]["n"], "target": None,
             "op": None},
            {"name": "fairness: errors in both phases", "ratio": float(alone["n_errors"] + contended["n_errors"]),
             "target": 0.0, "op": "<=", "unit": "errors"},
        ],
    }
