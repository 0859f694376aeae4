"""One vLLM server: a child process of this one running vLLM's OpenAI-compatible server from vLLM's own
environment (`make vllm-env`: .venv-vllm), on a free local port, its output in a log file. Torch-free: the
control plane starts, watches and stops it, and talks to it over HTTP only.

    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME --enable-lora ...

It runs in a process group of its own (vLLM starts an engine core process beside its API server), so `stop`
ends every process of it, and a server that dies takes nothing of this process with it.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from whitney.errors import InvalidInput
from whitney.ports import free_port

# vLLM's CPU build reserves this much for its KV cache unless told (its default is most of the machine's memory).
CPU_KV_CACHE_GIB = 2
MAX_LOGPROBS = 100  # protocol/sampling.py MAX_TOPK_PROMPT_LOGPROBS: the most alternatives a request asks for


def default_python() -> str:
    """`make vllm-env`'s interpreter: .venv-vllm beside the checkout Whitney runs from (WHITNEY_VLLM_PYTHON
    overrides it)."""
    given = os.environ.get("WHITNEY_VLLM_PYTHON")
    if given:
        return given
    return str(Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python")


def check_python(python: str) -> None:
    """A usable vLLM environment, or InvalidInput naming --vllm-python and how to make one."""
    if not Path(python).is_file():
        raise InvalidInput(f"no vLLM environment at {python}: run `make vllm-env` (it builds .venv-vllm) or give "
                           "--vllm-python PATH", field="vllm_python")
    probe = subprocess.run([python, "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InvalidInput(f"{python} cannot import vLLM's server: {last}", field="vllm_python")


@dataclass(frozen=True)
class ServerSpec:
    """What one server serves and how: the base model's directory, its dtype, and the LoRA slots."""

    python: str
    model_dir: str
    served_name: str
    dtype: str  # "float32" or "bfloat16": the trainer's compute dtype
    max_model_len: int
    max_lora_rank: int
    max_loras: int
    device: str = "cpu"  # "cpu", or "cuda"/"cuda:N" (vLLM's CUDA build)
    kv_cache_gib: int = CPU_KV_CACHE_GIB  # on a CPU: its KV cache (vLLM takes most of the machine unless told)
    extra_args: tuple[str, ...] = ()

    def command(self, host: str, port: int) -> list[str]:
        rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= self.max_lora_rank)  # vLLM's choices
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_name, "--host", host, "--port", str(port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--enable-lora",
                "--max-lora-rank", str(rank), "--max-loras", str(self.max_loras),
                "--max-cpu-loras", str(self.max_loras), "--max-logprobs", str(MAX_LOGPROBS),
                "--disable-uvicorn-access-log", *self.extra_args]

    def environment(self, api_key: str) -> dict[str, str]:
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
               "VLLM_API_KEY": api_key,  # every /v1 route asks for it: the server may listen beyond this host
               "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "MALLOC_ARENA_MAX"):  # this process's, not vLLM's
            env.pop(name, None)
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif ":" in self.device:
            env["CUDA_VISIBLE_DEVICES"] = self.device.split(":", 1)[1]
        return env


def kv_cache_gib(model_dir: str, dtype: str, max_model_len: int) -> int:
    """GiB of KV cache that hold one sequence of `max_model_len` tokens (and at least CPU_KV_CACHE_GIB), from the
    model's config: layers x 2 (K, V) x KV heads x head size x bytes per number per token."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * heads * head_dim * (4 if dtype == "float32" else 2)
    return max(CPU_KV_CACHE_GIB, math.ceil(1.25 * per_token * max_model_len / 2**30))


def _die_with_parent() -> None:
    """In the child before it runs vLLM: killed when the process (thread) that started it dies, so a server killed
    with SIGKILL leaves no vLLM behind (vLLM's engine core exits when its API server does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1


class VllmServer:
    """A started server: its process, address, key and log. `ready()` never waits (`wait_ready` below does).
    `host` 127.0.0.1 serves this machine only; 0.0.0.0 the cluster (a replica on a Ray node), behind its key."""

    def __init__(self, spec: ServerSpec, log_path: Path, host: str = "127.0.0.1"):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"  # from this machine; ray_host.py says it for other nodes
        self.api_key = secrets.token_urlsafe(24)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(spec.command(host, self.port), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=spec.environment(self.api_key),
                                            start_new_session=True, cwd=log_path.parent,
                                            preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self._ready = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ready(self) -> bool:
        """Whether it answers /health (asked without waiting more than a moment)."""
        if not self._ready and self.alive():
            try:
                self._ready = httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200
            except httpx.HTTPError:
                return False
        return self._ready and self.alive()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """End every process of the server (its group), at once."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print(f"vLLM server {self.process.pid} did not exit", file=sys.stderr)


def wait_ready(server, timeout: float) -> None:
    """Block until a server (this module's, or ray_host's) serves; RuntimeError with its log's end, once stopped,
    if it exits or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while not server.ready():
        if not server.alive() or time.monotonic() > deadline:
            why = "exited" if not server.alive() else f"did not answer within {timeout:.0f} s"
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"a vLLM server {why}; the end of its log ({server.log_path}):\n{tail}")
        time.sleep(0.5)
