"""The Ray backend against the in-process one, on this machine (issue 11): what the actor hop costs.

`whitney serve` in its own process on SmolLM2-135M, first in-process, then `--backend ray` (a local Ray
instance started by the server, the model's trainer an actor with both CPUs: `--worker-resources
MODEL=cpus:2`). One client each, the servers one after the other (never sharing the 2 cores):
  trivial op    optim_step on a rank-8 attention-only LoRA: submit -> result, client-side wall time;
                check: Ray's p50 minus in-process p50 at most 5 ms.
  SFT           forward_backward (8 x 128 tokens, rank 32) + optim_step, pipelined, after warm-up:
                training tokens/s; check: Ray / in-process at least 0.95.
  sampling under training load (info)   one client trains as above while another samples 16 tokens
                from the base model (16-token prompt) again and again: the sample's submit -> result
                p50, in-process (sampling interleaved with training, one decode step between calls)
                against Ray with one sampler replica (`--samplers 1`, trainer and replica one CPU each,
                so the two processes share the same two cores), and the training tokens/s meanwhile.
"""

from __future__ import annotations

import threading
import time

from bench.common import percentile, sft_batch, start_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def trivial_ops(url: str, n: int) -> list[float]:
    import whitney

    with whitney.Client(url, timeout=300) as client:
        run_ = client.create_session(bench="cluster").create_run(rank=8, train_mlp=False, train_unembed=False)
        run_.forward_backward(sft_batch(1, 32, seed=1)).result()
        out = []
        for i in range(n + 3):
            t = time.perf_counter()
            run_.optim_step(learning_rate=1e-4).result()
            if i >= 3:  # warm-up
                out.append(time.perf_counter() - t)
        return out


def sft_tokens_per_s(url: str, steps: int, batch: list[dict]) -> float:
    import whitney

    tokens = sum(len(d["input"]["token_ids"]) for d in batch)
    with whitney.Client(url, timeout=600) as client:
        run_ = client.create_session(bench="cluster").create_run(rank=32, seed=3)
        for _ in range(2):
            run_.forward_backward(batch).result()
            run_.optim_step(learning_rate=1e-4).result()
        t = time.perf_counter()
        futures = [(run_.forward_backward(batch), run_.optim_step(learning_rate=1e-4)) for _ in range(steps)]
        for fb, opt in futures:
            fb.result()
            opt.result()
        return steps * tokens / (time.perf_counter() - t)


def sampling_under_load(url: str, seconds: float, batch: list[dict]) -> dict:
    """Training in one thread, sampling in another, for `seconds`; sample latencies and training tokens/s."""
    import whitney

    tokens = sum(len(d["input"]["token_ids"]) for d in batch)
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    trained = [0]
    errors: list[str] = []

    def train() -> None:
        try:
            with whitney.Client(url, timeout=600) as client:
                run_ = client.create_session(bench="cluster").create_run(rank=32, seed=4)
                while time.monotonic() < stop:
                    run_.forward_backward(batch).result()
                    run_.optim_step(learning_rate=1e-4).result()
                    trained[0] += tokens
        except Exception as e:
            errors.append(f"train: {e}")

    def sample() -> None:
        try:
            with whitney.Client(url, timeout=600) as client:
                prompt = sft_batch(1, 16, seed=7)[0]["input"]["token_ids"]
                while time.monotonic() < stop:
                    t = time.perf_counter()
                    client.sample(prompt, max_tokens=16, temperature=1.0, seed=len(latencies)).result()
                    latencies.append(time.perf_counter() - t)
        except Exception as e:
            errors.append(f"sample: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=f) for f in (train, sample)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    return {"samples": len(latencies), "sample_p50_s": percentile(latencies, 0.5),
            "sample_p90_s": percentile(latencies, 0.9), "train_tokens_per_s": trained[0] / elapsed,
            "errors": errors}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    n_trivial, steps, seconds = (10, 2, 20) if quick else (40, 8, 60)
    batch = sft_batch(8, 128, seed=2)
    common = ("--dtype", dtype)
    ray_args = ("--backend", "ray", "--worker-resources", f"{MODEL}=cpus:2")
    split = ("--backend", "ray", "--samplers", "1", "--worker-resources", f"{MODEL}=cpus:1")
    out: dict[str, dict] = {}
    for name, args in (("inprocess", ()), ("ray", ray_args)):
        with start_server(*common, *args, model=MODEL, timeout=300) as server:
            trivial = trivial_ops(server.url, n_trivial)
            out[name] = {"trivial_p50_ms": percentile(trivial, 0.5) * 1e3,
                         "trivial_p90_ms": percentile(trivial, 0.9) * 1e3,
                         "sft_tokens_per_s": sft_tokens_per_s(server.url, steps, batch)}
            if name == "inprocess":
                out[name]["under_load"] = sampling_under_load(server.url, seconds, batch)
    with start_server(*common, *split, model=MODEL, timeout=300) as server:
        out["ray_replica"] = {"under_load": sampling_under_load(server.url, seconds, batch)}
    local, remote = out["inprocess"], out["ray"]
    interleaved, replica = local["under_load"], out["ray_replica"]["under_load"]
    return {
        "benchmark": "cluster",
        "settings": {"model": MODEL, "trivial_ops": n_trivial, "sft_steps": steps, "sft_batch": "8 x 128",
                     "rank": 32, "load_seconds": seconds, "sample": "16-token prompt, 16 tokens"},
        **out,
        "checks": [
            {"name": "cluster: trivial op (optim_step) p50, Ray minus in-process (ms)",
             "ratio": remote["trivial_p50_ms"] - local["trivial_p50_ms"], "target": 5.0, "op": "<=", "unit": "ms"},
            {"name": "cluster: SFT tokens/s, Ray / in-process", "ratio": remote["sft_tokens_per_s"]
             / local["sft_tokens_per_s"], "target": 0.95, "op": ">="},
            {"name": "(info) cluster: sample p50 under training load, Ray with 1 replica / in-process interleaved",
             "ratio": replica["sample_p50_s"] / interleaved["sample_p50_s"], "target": None, "op": None},
            {"name": "(info) cluster: training tokens/s while sampling, Ray with 1 replica / in-process",
             "ratio": replica["train_tokens_per_s"] / interleaved["train_tokens_per_s"], "target": None, "op": None},
            {"name": "cluster: errors", "ratio": float(len(interleaved["errors"]) + len(replica["errors"])),
             "target": 0.0, "op": "<=", "unit": "errors"},
        ],
    }
