"""The seed's own command line, unchanged, against `whitney serve --model Qwen/Qwen3.5-0.8B`:

    python examples/training/http/sl_loop.py --provider modal --model Qwen/Qwen3.5-0.8B \\
        --forward-backward-json batch.json

A tiny random Qwen3.5 (the multimodal qwen3_5 checkpoint as it ships: Gated DeltaNet linear attention,
gated full attention and a vision tower) is laid out in a temporary Hugging Face cache under that repo id,
so the server and the scripts resolve the id offline, as they would the real model. The batch is built from the
examples' shipped dataset (examples/training/http/data/chats.jsonl), as their README builds it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.models import make_tiny_general_model

REPO = "Qwen/Qwen3.5-0.8B"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "training" / "http"


def hf_cache_with(repo: str, source: Path, cache: Path) -> Path:
    """Lay out `source` as the one snapshot of `repo` in a Hugging Face hub cache at `cache`."""
    revision = "0" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / revision)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return cache


def test_the_seed_command_runs_unchanged_on_qwen35(tmp_path, monkeypatch):
    from bench.common import start_server

    cache = hf_cache_with(REPO, make_tiny_general_model(tmp_path / "src", "qwen3_5"), tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with start_server(model=REPO) as server:  # whitney serve --model Qwen/Qwen3.5-0.8B, in its own process
        (model,) = httpx.get(f"{server.url}/v1/training/capabilities").json()["models"]
        assert model["name"] == REPO and "in_proj_qkv" in model["adaptable_modules"]

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "WHITNEY_BASE_URL": server.url}
        subprocess.run([sys.executable, str(EXAMPLES / "whitney_datums.py"), str(EXAMPLES / "data" / "chats.jsonl"),
                        "batch.json", "--model", REPO], env=env, cwd=tmp_path, check=True, capture_output=True,
                       text=True)
        done = subprocess.run([sys.executable, str(EXAMPLES / "sl_loop.py"), "--provider", "modal", "--model", REPO,
                               "--forward-backward-json", "batch.json"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"on {REPO}" in done.stdout and "[modal] run" in done.stdout
        assert "step 4: loss per token" in done.stdout and "weighted target tokens" in done.stdout, done.stdout
        assert list((tmp_path / "sl_loop_out").rglob("adapter_config.json")), done.stdout
