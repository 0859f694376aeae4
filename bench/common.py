"""Shared helpers of the benchmark suite: the machine, timing, data, and a `whitney serve` subprocess."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from whitney.engine import DEFAULT_MODEL
from whitney.engine.families.model import cpu_bf16_matmul
from whitney.ports import free_port


def machine() -> dict:
    """CPU model, cores, torch version, threads and the load average when the suite started."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "avx512_bf16": cpu_bf16_matmul(),  # or AMX: bfloat16 matmuls in hardware
        "load_average": list(os.getloadavg()),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def alternate(contenders: dict, rounds: int, label: str = "") -> dict[str, list[float]]:
    """Run every contender once per round, in turn (order rotated each round); return seconds per call."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t)
            print(f"  {label} round {r} {name}: {times[name][-1]:.3f}s", flush=True)
    return times


def random_tokens(n: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the start of SmolLM2's vocabulary.
    return torch.randint(100, vocab, (n, length + 1), generator=gen).tolist()


def sft_batch(n: int, length: int, seed: int = 0, prompt: int = 16) -> list[dict]:
    """n wire datums of `length` input tokens: weight 0 on a short prompt, 1 on the rest."""
    from whitney.datums import sft_datum

    return [sft_datum(seq[:prompt], seq[prompt:]) for seq in random_tokens(n, length, seed)]


def peft_sft_step(model):
    """The plain HF + PEFT training step doing Whitney's math on `model` (a PeftModel): cross_entropy summed
    over weighted tokens on float32 logits, AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-12, no decay). Returns
    (step(batch) -> loss, the number of trainable parameters)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def step(batch: list[dict]) -> float:
        ids = torch.tensor([d["input"]["token_ids"] for d in batch])  # [B, T]
        targets = torch.tensor([d["loss_inputs"]["target_tokens"]["values"] for d in batch])  # [B, T]
        weights = torch.tensor([d["loss_inputs"]["weights"]["values"] for d in batch])  # [B, T]
        logits = model(input_ids=ids).logits.float()  # [B, T, V]
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss = (per_token * weights.flatten()).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, sum(p.numel() for p in params)


def engine_datums(batch: list[dict]):
    from whitney.engine import Datum

    return [Datum(d["input"]["token_ids"], d["loss_inputs"]) for d in batch]


class ServerExited(RuntimeError):
    """The server process ended while the benchmark still needed it."""


@dataclass
class Server:
    """`whitney serve` in its own process (as deployed): its URL, pid, and how to stop it."""

    proc: subprocess.Popen
    url: str
    data_dir: tempfile.TemporaryDirectory
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, int]:
        """VmHWM (peak RSS) and VmRSS of the server process, in KiB; ServerExited once it has ended (an ended
        process's status has neither)."""
        if self.proc.poll() is not None:
            raise ServerExited(f"the server (pid {self.pid}) exited with code {self.proc.returncode}"
                               + ("" if os.environ.get("WHITNEY_BENCH_SERVER_LOG") else
                                  "; set WHITNEY_BENCH_SERVER_LOG=<file> to keep its log"))
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM", "VmRSS")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
        return out

    def tree_rss_kib(self) -> int:
        """VmRSS of the server process and every process under it (a Ray backend's raylet, GCS and workers), in
        KiB; ServerExited once the server has ended."""
        self.status()
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(parent, []).append(int(entry))
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            todo.extend(children.get(pid, []))
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
            except OSError:
                continue
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.data_dir.cleanup()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tiny_model() -> str:
    """A 2-layer, 64-wide random Llama with the real SmolLM2 tokenizer (the test suite's), made once and
    cached: the model of the many-client benchmarks, where per-operation machinery, not arithmetic, counts."""
    from pathlib import Path

    from tests.models import make_tiny_model

    out = Path(os.environ.get("WHITNEY_CACHE_DIR", "~/.cache/whitney")).expanduser() / "bench-tiny-llama"
    if not (out / "config.json").exists():
        make_tiny_model(out, "llama")
    return str(out)


def tiny_vision_model() -> str:
    """A tiny random Qwen3-VL with its image processor (tests/models.py, the image tests' model), made once and
    cached: a model that takes images, for the benchmarks that send them."""
    from pathlib import Path

    from tests.models import make_tiny_vision_model

    out = Path(os.environ.get("WHITNEY_CACHE_DIR", "~/.cache/whitney")).expanduser() / "bench-tiny-qwen3-vl"
    if not (out / "config.json").exists():
        make_tiny_vision_model(out, "qwen3_vl")
    return str(out)


class Clients:
    """Many clients in threads, each looping `step(index, client)` until a deadline; op latencies recorded.

    `step` returns a list of (kind, seconds) it measured; an exception is counted as an error and kept.
    A step that may outlast the phase reads `deadline` (time.monotonic()) and stops waiting there.
    """

    def __init__(self, url: str):
        import threading

        self.url = url
        self.latencies: dict[str, list[float]] = {}
        self.errors: list[str] = []
        self.deadline = 0.0
        self._lock = threading.Lock()

    def run(self, n: int, setup, step, seconds: float) -> None:
        import threading

        import whitney

        deadline = self.deadline = time.monotonic() + seconds

        def loop(i: int) -> None:
            client = whitney.Client(self.url, timeout=300)
            try:
                state = setup(i, client)
                while time.monotonic() < deadline:
                    for kind, t in step(i, state):
                        with self._lock:
                            self.latencies.setdefault(kind, []).append(t)
            except Exception as e:  # counted, never hidden
                with self._lock:
                    self.errors.append(f"client {i}: {type(e).__name__}: {e}")
            finally:
                client.close()

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def summary(self) -> dict:
        """The phase's errors (the first 10 and their count) and, per kind of operation, its latencies' count,
        p50, p99 and max in seconds."""
        out = {"errors": self.errors[:10], "n_errors": len(self.errors)}
        for kind, xs in self.latencies.items():
            out[kind] = {"n": len(xs), "p50_s": percentile(xs, 0.5), "p99_s": percentile(xs, 0.99),
                         "max_s": max(xs)}
        return out


def timed(future) -> float:
    """Wait for an operation future; its submit -> result latency as the server recorded it, in seconds."""
    op = future.wait()
    if op["status"] != "succeeded":
        raise RuntimeError(f"{op['kind']} ended {op['status']}: {op.get('error')}")
    return op["finished_at"] - op["created_at"]


def start_server(*args: str, model: str = DEFAULT_MODEL, timeout: float = 180.0) -> Server:
    """Start `python -m whitney.cli serve` on a free port; return once it prints that it is serving."""
    data_dir = tempfile.TemporaryDirectory(prefix="whitney-bench-")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "whitney.cli", "serve", "--model", model, "--port", str(port),
                             "--data-dir", data_dir.name, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"whitney serve exited with {proc.returncode}:\n{''.join(lines)}")
            continue
        lines.append(line)
        if "Whitney is serving" in line:
            # Drain the rest of its output in the background so the pipe never fills; to a file when
            # WHITNEY_BENCH_SERVER_LOG names one (the server's log, for a benchmark that reports errors).
            import threading

            log_path = os.environ.get("WHITNEY_BENCH_SERVER_LOG")

            def drain() -> None:
                with open(log_path or os.devnull, "a") as log:
                    log.writelines(lines)
                    for line in proc.stdout:
                        log.write(line)

            threading.Thread(target=drain, daemon=True).start()
            return Server(proc, f"http://127.0.0.1:{port}", data_dir)
    proc.kill()
    raise RuntimeError(f"whitney serve did not start in {timeout}s:\n{''.join(lines)}")
