"""Against the peers, side by side: the shared SDK benchmark (`../shared/peers/bench_sdk.py`, driven by the
official `tinker` SDK) against `whitney serve` and against SkyRL tx 0.4.0, on the same SmolLM2 model.

    make bench-peers        # = python -m bench --only peers

Parts: (a) SFT steps, LoRA rank 32, 8 x 128 tokens, pipelined; (b) 16 concurrent samples of 64 tokens;
(c) the round trip of a trivial forward (1 x 8 tokens). SkyRL trains no unembedding adapter, so
Whitney's clients are created with train_unembed=False (`bench/peer_sdk.py`).

  whitney          `whitney serve --dtype <suite dtype>`, SDK 0.38 (this environment)
  whitney_float32  the same in float32 (information: the same dtype as SkyRL's)
  skyrl            `../shared/peers/skyrl/run_bench.sh` (SkyRL tx 0.4.0, JAX on CPU, float32), with its pinned
                   SDK 0.25 (its sampling fails under 0.38). Needs `../shared/peers/skyrl/setup.sh` first;
                   without it this contender is reported as missing, never estimated.

Targets against SkyRL: (a) >= 1.2x tokens/s, (b) >= 2x tokens/s, (c) Whitney's p50 < 20 ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import start_server
from whitney.engine import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("WHITNEY_PEERS_DIR", ROOT.parent / "shared" / "peers"))
SKYRL = Path(os.environ.get("PEER", Path(tempfile.gettempdir()) / "peers" / "skyrl"))
VOCAB = 49152
# SkyRL tx's figures in ../shared/peers/README.md (measured there on an idle machine of this kind).
PUBLISHED = {"a_tokens_per_s_median": 267.0, "b_tokens_per_s_median": 111.0}


def sdk_args(quick: bool) -> list[str]:
    if quick:
        return ["--steps", "2", "--warmup", "1", "--sample-concurrency", "4", "--sample-tokens", "8",
                "--sample-rounds", "1", "--fwd-warmup", "1", "--fwd-reps", "3"]
    return []  # bench_sdk.py's defaults are the settings


def run_whitney(dtype: str, quick: bool, out: Path) -> dict:
    with start_server("--dtype", dtype) as server:
        env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": "tml-bench"}
        cmd = [sys.executable, "-m", "bench.peer_sdk", str(PEERS / "bench_sdk.py"), DEFAULT_MODEL,
               "--vocab", str(VOCAB), "--json", str(out), *sdk_args(quick)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("  step")), flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_sdk.py against Whitney ({dtype}) failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_skyrl(quick: bool, out_prefix: Path) -> dict:
    sdk = SKYRL / "sdk025" / "bin" / "python"
    if not (SKYRL / "venv" / "bin" / "python").exists() or not sdk.exists():
        return {"missing": f"SkyRL is not set up under {SKYRL} (run {PEERS / 'skyrl' / 'setup.sh'})"}
    env = {**os.environ, "PEER": str(SKYRL), "QUIET_MAX_WAIT": os.environ.get("QUIET_MAX_WAIT", "120")}
    proc = subprocess.run(["bash", str(PEERS / "skyrl" / "run_bench.sh"), str(sdk), str(out_prefix), *sdk_args(quick)],
                          env=env, capture_output=True, text=True)
    print(proc.stdout[-3000:], flush=True)
    path = out_prefix.with_suffix(".json")
    if proc.returncode != 0 or not path.exists():
        return {"missing": f"SkyRL's run failed (exit {proc.returncode}): {proc.stderr[-1500:]}"}
    return json.loads(path.read_text())


def run(quick: bool = False, dtype: str = "bfloat16") -> dict:
    if not (PEERS / "bench_sdk.py").exists():
        raise RuntimeError(f"no {PEERS / 'bench_sdk.py'}; set WHITNEY_PEERS_DIR")
    with tempfile.TemporaryDirectory(prefix="whitney-peers-") as tmp:
        results = {"whitney": run_whitney(dtype, quick, Path(tmp) / "whitney.json")}
        results["skyrl"] = run_skyrl(quick, Path(tmp) / "skyrl")
        if dtype != "float32":
            results["whitney_float32"] = run_whitney("float32", quick, Path(tmp) / "whitney_f32.json")
    return {
        "benchmark": "peers",
        "settings": {"whitney_dtype": dtype, "skyrl_dtype": "float32", "train_unembed": False,
                     "whitney_sdk": results["whitney"].get("sdk"),
                     "skyrl_sdk": results["skyrl"].get("sdk", "0.25 (pinned by SkyRL)"),
                     "sdk_args": " ".join(sdk_args(quick)) or "bench_sdk.py defaults"},
        "results": results,
        "checks": checks(results, dtype),
    }


def checks(results: dict, dtype: str) -> list[dict]:
    """The targets against SkyRL measured in this run, and (information) against its published figures."""
    w, s, f32 = results["whitney"], results["skyrl"], results.get("whitney_float32")

    def ratio(a: dict | None, b: dict, key: str) -> float | None:
        return a[key] / b[key] if a and key in a and b.get(key) else None

    out = [
        {"name": f"peers (a): SFT tokens/s, Whitney ({dtype}) / SkyRL tx (float32)",
         "ratio": ratio(w, s, "a_tokens_per_s_median"), "target": 1.2, "op": ">="},
        {"name": f"peers (b): sampling 16 x 64 tokens/s, Whitney ({dtype}) / SkyRL tx (float32)",
         "ratio": ratio(w, s, "b_tokens_per_s_median"), "target": 2.0, "op": ">="},
        {"name": f"peers (c): Whitney ({dtype}) trivial forward round trip p50 (ms)",
         "ratio": w.get("c_median_ms"), "target": 20.0, "op": "<", "unit": "ms"},
        {"name": "(info) peers (c): SkyRL tx trivial forward round trip p50 (ms)",
         "ratio": s.get("c_median_ms"), "target": None, "op": None, "unit": "ms"},
    ]
    if f32:
        out += [{"name": f"(info) peers ({part}): Whitney (float32) / SkyRL tx (float32)",
                 "ratio": ratio(f32, s, key), "target": None, "op": None}
                for part, key in (("a", "a_tokens_per_s_median"), ("b", "b_tokens_per_s_median"))]
    out += [{"name": f"(info) peers ({part}): Whitney ({dtype}) / SkyRL tx's figure in "
                     f"../shared/peers/README.md ({PUBLISHED[key]:g} tokens/s, idle machine)",
             "ratio": ratio(w, PUBLISHED, key), "target": None, "op": None}
            for part, key in (("a", "a_tokens_per_s_median"), ("b", "b_tokens_per_s_median"))]
    return out
