"""Run Whitney's benchmark suite, write JSON results and render docs/BENCHMARKS.md with PNG plots.

    python -m bench                     # everything (about 10-20 minutes on 2 CPU cores)
    python -m bench --quick             # tiny settings, a smoke run (results under bench/results/quick/)
    python -m bench --only sampling     # one benchmark (repeatable or comma-separated); the report is
                                        # re-rendered from every result file present

Benchmarks: overhead, sharing, memory, sampling, latency, scaling, fairness, soak, hostile, cluster, general, busy
(see each module's docstring), and peers (`--only peers`, `make bench-peers`: against SkyRL tx through the official
SDK; needs SkyRL set up).
vllm (`--only vllm`, about 40 minutes; bench/vllm_sampling.py) compares Whitney's sampler with a vLLM sampler replica;
needs .venv-vllm (`make vllm-env`).
Issue 15's tenants and capacity (`--only tenants,capacity`, about 40 minutes) compare this tree with an earlier
commit served side by side (`--baseline REF`, default the main before issue 15; bench/baseline.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ["overhead", "sharing", "memory", "sampling", "latency", "scaling", "fairness", "soak", "hostile",
              "cluster", "general", "busy"]
OPTIONAL = ["peers",  # needs SkyRL installed (../shared/peers/skyrl/setup.sh): `make bench-peers`
            "tenants", "capacity",  # against a baseline commit (bench/baseline.py); long: `--only tenants,capacity`
            "vllm",  # needs .venv-vllm (`make vllm-env`)
            "sharded",  # sharded training, 2 ranks against 1, and each rank's load RSS; ~10 min: `--only sharded`
            "ha"]  # several API processes on PostgreSQL: failover and throughput; ~5 min: `--only ha`
MODULES = {"vllm": "vllm_sampling"}  # a benchmark whose module is named otherwise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, a few seconds each (smoke run)")
    parser.add_argument("--only", action="append", default=[], help=f"benchmark name(s): {', '.join(BENCHMARKS)}")
    parser.add_argument("--no-report", action="store_true", help="write JSON only")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="Whitney's compute dtype and the baselines' (default: bfloat16 on CPUs with AVX-512 "
                             "BF16, else float32)")
    parser.add_argument("--baseline", default=None,
                        help="the commit tenants and capacity compare against (default: bench.baseline.BASELINE_REF)")
    parser.add_argument("--rank", type=int, default=None,
                        help="capacity's LoRA rank (default 32, the issue's); another rank's result is written as "
                             "capacity-rank{R}.json")
    args = parser.parse_args(argv)
    names = [n.strip() for o in args.only for n in o.split(",") if n.strip()] or BENCHMARKS
    unknown = [n for n in names if n not in BENCHMARKS + OPTIONAL]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {BENCHMARKS + OPTIONAL}")

    from bench.common import machine

    dtype = args.dtype or ("bfloat16" if machine()["avx512_bf16"] else "float32")

    results_dir = ROOT / "bench" / "results" / ("quick" if args.quick else "")
    docs_dir = results_dir if args.quick else ROOT / "docs"
    results_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    t_all = time.perf_counter()
    for name in names:
        print(f"== {name}{' (quick)' if args.quick else ''} ({dtype})", flush=True)
        before = machine()
        t = time.perf_counter()
        try:
            bench_run = importlib.import_module(f"bench.{MODULES.get(name, name)}").run
            takes = inspect.signature(bench_run).parameters
            extra = {k: v for k, v in (("baseline", args.baseline), ("rank", args.rank)) if v and k in takes}
            result = bench_run(quick=args.quick, dtype=dtype, **extra)
        except Exception as e:  # keep going: one broken benchmark should not hide the others
            import traceback

            traceback.print_exc()
            failed.append(name)
            result = {"benchmark": name, "error": f"{type(e).__name__}: {e}", "checks": []}
        result["elapsed_s"] = time.perf_counter() - t
        result["quick"] = args.quick
        result.setdefault("dtype", dtype)  # a benchmark that fixes its dtype (vllm: float32) says so
        result["machine"] = before
        result["load_average_after"] = list(os.getloadavg())
        result["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        with open(results_dir / f"{result.get('benchmark', name)}.json", "w") as f:  # capacity-rank8 etc.
            json.dump(result, f, indent=2, default=str)
        print(f"== {name}: {result['elapsed_s']:.0f}s", flush=True)
        for c in result.get("checks", []):
            value = c["ratio"] if c["ratio"] is None else round(c["ratio"], 3)
            target = "" if c["target"] is None else " (target %s %s)" % (c["op"], c["target"])
            print(f"   {c['name']}: {value}{target}", flush=True)
        gc.collect()
    print(f"== all done in {time.perf_counter() - t_all:.0f}s", flush=True)
    if not args.no_report:
        from bench.report import render

        path = render(results_dir, docs_dir, quick=args.quick)
        print(f"report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
