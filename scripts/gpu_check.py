"""`make gpu-check`: the CUDA exactness tests, then a short training and sampling benchmark on CUDA.

    python scripts/gpu_check.py [--model NAME] [--device cuda:N] [--skip-tests] [--skip-bench]

1. `pytest -m cuda tests/engine/test_device.py` (with WHITNEY_TEST_CUDA=1, which tests/conftest.py needs
   to leave CUDA visible): the engine's main paths in float32 on CUDA equal the CPU's (which the rest of
   the suite checks against float64 references and Hugging Face), the CUDA forward equals Hugging Face's,
   checkpoints move between devices, bfloat16 is the CUDA default and the CPU-only tricks stay off.
2. SFT (forward_backward + optim_step) tokens/s and sampling tokens/s of `--model` (default the embedded
   SmolLM2-135M) in bfloat16 and float32, with peak CUDA memory, and the many-tenant round: 32 runs'
   forward_backward in one engine call then their optim_steps, against one run doing the same tokens;
   printed as a Markdown table and written to bench/results/gpu_check.json (or $OUT/gpu_check.json when
   $OUT is set).

Exits 2 with a message saying why when torch sees no CUDA device, 1 when a test fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def no_cuda_reason() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); install a CUDA "
                "build of torch in this environment to run the GPU checks")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; is a driver installed?)")


def run_tests() -> bool:
    env = {**os.environ, "WHITNEY_TEST_CUDA": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/engine/test_device.py"]
    print("$ WHITNEY_TEST_CUDA=1 " + " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0


def bench_sft(engine, model: str, batch: int, length: int, steps: int) -> dict:
    import torch

    from whitney.engine import Datum, LoraConfig

    vocab = engine.models[model].config.vocab_size
    engine.create_run("sft", model, LoraConfig(rank=32, seed=0))
    data = [Datum([(97 * i + 31 * j) % vocab for j in range(length)],
                  {"target_tokens": [(97 * i + 31 * (j + 1)) % vocab for j in range(length)]}) for i in range(batch)]
    for _ in range(2):  # warm-up: kernels, allocator
        engine.forward_backward("sft", data)
        engine.optim_step("sft", {"learning_rate": 1e-4})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        engine.forward_backward("sft", data)
        engine.optim_step("sft", {"learning_rate": 1e-4})
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.delete_run("sft")
    return {"tokens_per_s": batch * length * steps / seconds, "step_ms": 1000 * seconds / steps,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def bench_sampling(engine, model: str, requests: int, prompt: int, max_tokens: int) -> dict:
    import torch

    from whitney.engine import LoraConfig
    from whitney.protocol.sampling import SamplingParams

    vocab = engine.models[model].config.vocab_size
    engine.create_run("s", model, LoraConfig(rank=32, seed=0))
    version = engine.save_weights_for_sampler("s")
    prompts = [[(53 * i + 17 * j) % vocab for j in range(prompt)] for i in range(requests)]
    engine.sample(prompts[0], SamplingParams(max_tokens=4, seed=0, stop=()), run_id="s", version=version)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    one = engine.sample(prompts[0], SamplingParams(max_tokens=max_tokens, seed=1, stop=()), run_id="s", version=version)
    torch.cuda.synchronize()
    single = time.perf_counter() - start
    start = time.perf_counter()
    pending = [engine.submit_sample(p, SamplingParams(max_tokens=max_tokens, seed=i, stop=()), run_id="s",
                                    version=version) for i, p in enumerate(prompts)]
    while engine.sample_step():
        pass
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(r.error is None for r in pending), [r.error for r in pending if r.error]
    generated = sum(len(s.tokens) for r in pending for s in r.result.sequences)
    engine.delete_run("s")
    return {"batch_tokens_per_s": generated / seconds, "requests": requests,
            "single_ms_per_token": 1000 * single / len(one.sequences[0].tokens)}


def bench_runs(engine, model: str, runs: int, rows: int, length: int, rounds: int) -> dict:
    """The many-tenant round: `runs` runs (rank 8) each with `rows` datums of `length` tokens, their
    forward_backward in one Engine.run_batch and their optim_steps in one call; against one run doing the
    same runs * rows datums the same way. Returns tokens/s of both and their ratio."""
    import torch

    from whitney.engine import Datum, ForwardRequest, LoraConfig
    from whitney.protocol.training import AdamParams

    vocab = engine.models[model].config.vocab_size

    def datums(seed: int, n: int) -> list:
        return [Datum([(97 * i + 31 * j + seed) % vocab for j in range(length)],
                      {"target_tokens": [(97 * i + 31 * (j + 1) + seed) % vocab for j in range(length)]})
                for i in range(n)]

    def timed(requests: list) -> float:
        ids = [(r.run_id, AdamParams()) for r in requests]
        for _ in range(2):  # warm-up
            engine.run_batch(requests, True)
            engine.optim_steps(ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            failed = [r for r in engine.run_batch(requests, True) if isinstance(r, Exception)]
            assert not failed, failed
            engine.optim_steps(ids)
        torch.cuda.synchronize()
        return rounds * runs * rows * length / (time.perf_counter() - start)

    for i in range(runs):
        engine.create_run(f"t{i}", model, LoraConfig(rank=8, seed=i))
    many = timed([ForwardRequest(f"t{i}", datums(i, rows)) for i in range(runs)])
    for i in range(runs):
        engine.delete_run(f"t{i}")
    engine.create_run("one", model, LoraConfig(rank=8, seed=0))
    one = timed([ForwardRequest("one", datums(0, runs * rows))])
    engine.delete_run("one")
    return {"runs": runs, "tokens_per_s": many, "one_run_tokens_per_s": one, "ratio": many / one}


def run_bench(model: str, device: str, quick: bool) -> dict:
    import torch

    from whitney.engine import Engine

    results = {"device": device, "gpu": torch.cuda.get_device_name(torch.device(device)), "torch": torch.__version__,
               "model": model, "rows": {}}
    for dtype in ("bfloat16", "float32"):
        engine = Engine(device=device, compute_dtype=dtype)
        engine.load_model(model)
        sft = bench_sft(engine, model, batch=8, length=128 if quick else 512, steps=3 if quick else 10)
        sampling = bench_sampling(engine, model, requests=8 if quick else 64, prompt=32,
                                  max_tokens=16 if quick else 128)
        tenants = bench_runs(engine, model, runs=32, rows=4, length=64 if quick else 128, rounds=2 if quick else 5)
        results["rows"][dtype] = {"sft": sft, "sampling": sampling, "tenants": tenants}
        del engine
        torch.cuda.empty_cache()
    return results


def table(results: dict) -> str:
    lines = [f"GPU check on {results['gpu']} ({results['device']}, torch {results['torch']}), model {results['model']}",
             "", "| dtype | SFT tokens/s | SFT step ms | peak GiB | sampling tokens/s (batch) | ms/token (1 request) "
             "| 32 runs' round tokens/s (vs one run) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for dtype, row in results["rows"].items():
        s, p, t = row["sft"], row["sampling"], row["tenants"]
        lines.append(f"| {dtype} | {s['tokens_per_s']:.0f} | {s['step_ms']:.1f} | {s['peak_gib']:.2f} | "
                     f"{p['batch_tokens_per_s']:.0f} ({p['requests']} requests) | {p['single_ms_per_token']:.2f} | "
                     f"{t['tokens_per_s']:.0f} ({t['ratio']:.2f}x) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="base model for the benchmark (default the embedded SmolLM2)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smaller benchmark (seconds)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))

    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu-check: no CUDA device, nothing was run: {reason}", file=sys.stderr)
        return 2
    ok = args.skip_tests or run_tests()
    if not args.skip_bench:
        from whitney.engine import DEFAULT_MODEL

        results = run_bench(args.model or DEFAULT_MODEL, args.device, args.quick)
        print(table(results), flush=True)
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    if not ok:
        print("gpu-check: CUDA tests FAILED (see above)", file=sys.stderr)
        return 1
    print("gpu-check: CUDA tests passed" + ("" if args.skip_bench else "; benchmark above"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
