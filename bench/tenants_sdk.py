#!/usr/bin/env python3
"""The tenants workload through the official `tinker` SDK, for any Tinker-compatible server (SkyRL tx, Whitney).

Standalone on purpose: it imports only the SDK and the standard library, so it runs under another
environment's Python (SkyRL's pinned SDK 0.25) as well as this one's (0.38).

    TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=tml-x python bench/tenants_sdk.py BASE_MODEL \
        --clients 32 --seconds 90 --json out.json [--no-unembed]

Each of --clients threads holds its own ServiceClient (its own session) and a rank --rank LoRA training
client, does one untimed warm-up step (forward_backward + optim_step, then a sampler and an 8-token
sample), waits for the others, and then loops until --seconds have passed: forward_backward of --batch
datums x --seq-len tokens (cross_entropy, weight 0 on a 16-token prompt, 1 on the rest) + optim_step,
both submitted before either is awaited, and every --sample-every steps
save_weights_and_get_sampling_client + one sample of --sample-tokens tokens. Every operation's
client-observed latency (call to result) and completion time are written to the JSON, with every error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import traceback
import warnings

warnings.simplefilter("ignore")

import tinker  # noqa: E402
from tinker import types  # noqa: E402


def as_client(x):
    """SDK 0.38 returns futures of clients (backcompat wrappers); 0.25 the clients."""
    if hasattr(x, "result") and type(x).__name__ not in ("SamplingClient", "TrainingClient"):
        try:
            return x.result()
        except TypeError:
            return x
    return x


def batch(rng: random.Random, n: int, length: int, vocab: int, prompt: int = 16) -> list:
    out = []
    for _ in range(n):
        toks = [rng.randrange(100, vocab) for _ in range(length + 1)]
        weights = [0.0] * (prompt - 1) + [1.0] * (length - prompt + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": weights}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--sample-every", type=int, default=8)
    ap.add_argument("--sample-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--no-unembed", action="store_true", help="train_unembed=False (SkyRL trains no unembedding)")
    ap.add_argument("--setup-timeout", type=float, default=900.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    records: list[list] = []  # [kind, client seconds, completion seconds since the start]
    errors: list[str] = []
    lock = threading.Lock()
    start = {"t": 0.0, "deadline": 0.0}

    def go() -> None:  # run by the barrier before it releases anyone: every client sees the deadline
        start["t"] = time.monotonic()
        start["deadline"] = start["t"] + args.seconds

    ready = threading.Barrier(args.clients + 1, action=go)
    adam = types.AdamParams(learning_rate=1e-4)
    sampling = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0)

    def step(tc, data, prompt, k: int, record: bool) -> None:
        def note(kind: str, t0: float) -> None:
            t = time.monotonic()
            if record:
                with lock:
                    records.append([kind, t - t0, t - start["t"]])

        t0 = time.monotonic()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        fb.result()
        note("forward_backward", t0)
        opt.result()
        note("optim_step", t0)
        if k % args.sample_every == 0:
            t0 = time.monotonic()
            sc = as_client(tc.save_weights_and_get_sampling_client())
            note("save_weights_for_sampler", t0)
            t0 = time.monotonic()
            res = sc.sample(prompt, 1, sampling).result()
            note("sample", t0)
            if not res.sequences or not res.sequences[0].tokens:
                raise RuntimeError("a sample came back empty")

    def client(i: int) -> None:
        rng = random.Random(i)
        data = batch(rng, args.batch, args.seq_len, args.vocab)
        prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:16])
        tc = None
        try:
            svc = tinker.ServiceClient()
            kwargs = {"train_unembed": False} if args.no_unembed else {}
            tc = as_client(svc.create_lora_training_client(base_model=args.model, rank=args.rank, seed=i, **kwargs))
            step(tc, data, prompt, args.sample_every, record=False)  # warm-up: one step and one sample
        except Exception as e:
            with lock:
                errors.append(f"client {i} setup: {type(e).__name__}: {e}")
            tc = None
        try:
            ready.wait(timeout=args.setup_timeout)
        except threading.BrokenBarrierError:
            pass
        if tc is None:
            return
        k = 0
        try:
            while time.monotonic() < start["deadline"]:
                k += 1
                step(tc, data, prompt, k, record=True)
        except Exception as e:  # counted, never hidden
            with lock:
                errors.append(f"client {i}: {type(e).__name__}: {e}")
                traceback.print_exc()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    t_setup = time.monotonic()
    for t in threads:
        t.start()
    try:
        ready.wait(timeout=args.setup_timeout)
    except threading.BrokenBarrierError:
        errors.append(f"setup: not every client was ready within {args.setup_timeout:.0f} s")
        go()
    setup_s = start["t"] - t_setup
    print(f"tenants_sdk: {args.clients} clients ready after {setup_s:.1f}s, running {args.seconds:.0f}s", flush=True)
    for t in threads:
        t.join(timeout=args.seconds + 900)
    out = {"sdk": getattr(tinker, "__version__", "?"), "clients": args.clients, "seconds": args.seconds,
           "setup_s": setup_s, "wall_s": time.monotonic() - start["t"], "records": records, "errors": errors,
           "still_running": sum(t.is_alive() for t in threads)}
    with open(args.json, "w") as f:
        json.dump(out, f)
    print(f"tenants_sdk: {len(records)} operations, {len(errors)} errors", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the SDK's background threads (heartbeats, event loops) need not be joined


if __name__ == "__main__":
    main()
