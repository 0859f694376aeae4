"""docs/TINKER_COMPATIBILITY.md's quickstart, run as its reader runs it, so that the page cannot rot: the one
Python block of its "Quickstart" section, read from the markdown, in a fresh interpreter whose only settings are
the page's own environment variables (TINKER_BASE_URL, TINKER_API_KEY, HF_HUB_OFFLINE=1).

Against the session's server on the tiny model, and (slow) against `whitney serve` itself on the embedded model,
as step 2 of the page starts it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "TINKER_COMPATIBILITY.md"


def quickstart_code() -> str:
    """The Python block of the page's Quickstart section (exactly one)."""
    section = DOC.read_text().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert len(blocks) == 1, f"the Quickstart section has {len(blocks)} python blocks, not 1"
    return blocks[0]


def run_quickstart(url: str, tmp_path: Path) -> dict:
    """quickstart.py run against `url`: what it printed, parsed (base model, loss per step, answer)."""
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-quickstart", "HF_HUB_OFFLINE": "1"}
    # A deprecated SDK call in the page's own code fails the test (the SDK deprecates with FutureWarning).
    done = subprocess.run([sys.executable, "-W", "error::FutureWarning:__main__", str(script)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"quickstart.py failed:\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    base = re.search(r"^base model: (.+)$", out, re.M)
    losses = [float(x) for x in re.findall(r"^step \d: loss per completion token ([0-9.]+)$", out, re.M)]
    answer = re.search(r"^answer: (.*)$", out, re.M)
    assert base and answer and len(losses) == 4, out
    return {"base_model": base.group(1), "losses": losses, "answer": answer.group(1), "out": out}


def test_the_quickstart_runs_on_a_served_tiny_model(tinker_server, tmp_path):
    got = run_quickstart(tinker_server.url, tmp_path)
    assert got["base_model"] == Path(tinker_server.config.models[0]).name, got["out"]
    assert got["losses"][-1] < got["losses"][0], got["out"]  # the steps train


@pytest.mark.slow
def test_the_quickstart_runs_against_whitney_serve_on_the_embedded_model(tmp_path):
    from bench.common import start_server
    from whitney.protocol.config import DEFAULT_MODEL

    with start_server() as server:  # `whitney serve` with its default model, in its own process
        got = run_quickstart(server.url, tmp_path)
    assert got["base_model"] == DEFAULT_MODEL, got["out"]
    assert got["losses"][-1] < got["losses"][0], got["out"]
    assert "Paris" in got["answer"], got["out"]
