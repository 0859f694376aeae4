"""The Ray backend against the in-process one, on this machine (issue 11): what the actor hop costs.

`whitney serve` in its own process on SmolLM2-135M: in-process, and `--backend ray` (a local Ray instance
started by the server, the model's trainer an actor with both CPUs: `--worker-resources MODEL=cpus:2`).
Both servers are up together and their calls alternate, one at a time (never sharing the 2 cores; this
VM's speed drifts by tens of percent over minutes, so runs one after the other would compare drift):
  trivial op    optim_step on a rank-8 attention-only LoRA: submit -> result, client-side wall time;
                check: Ray's p50 minus in-process p50 at most 5 ms.
  SFT           forward_backward (8 x 128 tokens, rank 32) + optim_step, each awaited, median per step:
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

from bench.common import alternate, median, percentile, sft_batch, start_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def training_client(url: str, **lora):
    """A client, and a run on it that has taken one step (warm)."""
    import whitney

    client = whitney.Client(url, timeout=600)
    run_ = client.create_session(bench="cluster").create_run(**lora)
    run_.forward_backward(sft_batch(1, 32, seed=1)).result()
    run_.optim_step(learning_rate=1e-4).result()
    return client, run_


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
    tokens = sum(len(d["input"]["token_ids"]) for d in batch)
    common = ("--dtype", dtype)
    ray_args = ("--backend", "ray", "--worker-resources", f"{MODEL}=cpus:2")
    split = ("--backend", "ray", "--samplers", "1", "--worker-resources", f"{MODEL}=cpus:1")
    out: dict[str, dict] = {}
    # Both servers up at once, their calls alternated (this VM's speed drifts by tens of percent over minutes).
    with start_server(*common, model=MODEL, timeout=300) as local, \
            start_server(*common, *ray_args, model=MODEL, timeout=300) as remote:
        servers = {"inprocess": local, "ray": remote}
        trivial_runs = {k: training_client(s.url, rank=8, train_mlp=False, train_unembed=False)
                        for k, s in servers.items()}
        sft_runs = {k: training_client(s.url, rank=32, seed=3) for k, s in servers.items()}
        trivial = alternate({k: lambda r=r: r.optim_step(learning_rate=1e-4).result()
                             for k, (_, r) in trivial_runs.items()}, n_trivial, "optim_step")
        sft = alternate({k: lambda r=r: (r.forward_backward(batch).result(), r.optim_step(learning_rate=1e-4).result())
                         for k, (_, r) in sft_runs.items()}, steps, "sft")
        for name in servers:
            out[name] = {"trivial_p50_ms": percentile(trivial[name], 0.5) * 1e3,
                         "trivial_p90_ms": percentile(trivial[name], 0.9) * 1e3,
                         "sft_tokens_per_s": tokens / median(sft[name]), "sft_step_s": sft[name]}
        for client, _ in (*trivial_runs.values(), *sft_runs.values()):
            client.close()
    with start_server(*common, model=MODEL, timeout=300) as server:
        out["inprocess"]["under_load"] = sampling_under_load(server.url, seconds, batch)
    with start_server(*common, *split, model=MODEL, timeout=300) as server:
        out["ray_replica"] = {"under_load": sampling_under_load(server.url, seconds, batch)}
    local, remote = out["inprocess"], out["ray"]
    interleaved, replica = local["under_load"], out["ray_replica"]["under_load"]
    return {
        "benchmark": "cluster",
        "settings": {"model": MODEL, "trivial_ops": n_trivial, "sft_rounds": steps, "sft_batch": "8 x 128",
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
