"""A busy machine: the same SFT step through `whitney serve` on an idle CPU and with one core kept busy by
another process (a Python loop spinning on it), for the server's default thread policy and two others.

  default   `whitney serve` as it starts: as many compute threads as the CPUs it may use, waiting threads
            asleep (protocol/config.py, ENGINE_PROCESS_ENV)
  spinning  the same threads waiting as libgomp does by default (OMP_WAIT_POLICY=ACTIVE): Whitney's default
            before the thread policy
  one       `--threads 1`

Each setting gets its own server, one after the other; within a setting, idle and busy rounds alternate (a
round: N steps of forward_backward + optim_step submitted back to back and both awaited, as the demo does).
Target: the default's busy step at most 2x its idle step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

from bench.common import alternate, median, sft_batch, start_server, tiny_model

SETTINGS = {  # name -> (extra `whitney serve` flags, OMP_WAIT_POLICY in its environment; None: unset)
    "default": ((), None),
    "spinning": ((), "ACTIVE"),
    "one": (("--threads", "1"), None),
}


@contextmanager
def wait_policy(value: str | None):
    """OMP_WAIT_POLICY as the server started inside will see it (None: unset, so its own default applies)."""
    before = os.environ.pop("OMP_WAIT_POLICY", None)
    if value is not None:
        os.environ["OMP_WAIT_POLICY"] = value
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if before is not None:
            os.environ["OMP_WAIT_POLICY"] = before


@contextmanager
def one_core_busy():
    """Another process spinning for as long as the block runs (one core's worth of work)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def measure(flags: tuple[str, ...], policy: str | None, model: str, dtype: str, steps: int, rounds: int,
            batch: list[dict], rank: int) -> dict:
    """Seconds per step on one server: each round idle, then busy (alternating order across rounds)."""
    import whitney

    with wait_policy(policy), start_server("--dtype", dtype, *flags, model=model) as server:
        client = whitney.Client(server.url, timeout=900)
        run = client.create_session(purpose="bench-busy").create_run(rank=rank)

        def train() -> None:
            for _ in range(steps):
                fb = run.forward_backward(batch, "cross_entropy")
                opt = run.optim_step(learning_rate=1e-4)
                fb.result()
                opt.result()

        def busy() -> None:
            with one_core_busy():
                train()

        train()  # warm-up, untimed
        times = alternate({"idle": train, "busy": busy}, rounds, "busy")
        client.close()
    return {load: median(t) / steps for load, t in times.items()}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    from whitney.protocol.config import DEFAULT_MODEL, usable_cpus

    model = tiny_model() if quick else DEFAULT_MODEL
    steps, rounds, batch_size, length, rank = (1, 1, 2, 32, 4) if quick else (3, 3, 4, 128, 32)
    batch = sft_batch(batch_size, length, seed=2)
    seconds = {name: measure(flags, policy, model, dtype, steps, rounds, batch, rank)
               for name, (flags, policy) in SETTINGS.items()}
    ratio = {name: s["busy"] / s["idle"] for name, s in seconds.items()}
    return {
        "benchmark": "busy",
        "settings": {"model": "tiny" if quick else "SmolLM2-135M", "batch": batch_size, "seq_len": length,
                     "rank": rank, "steps_per_round": steps, "rounds": rounds, "dtype": dtype,
                     "cpus": usable_cpus()},
        "seconds_per_step": seconds,
        "busy_over_idle": ratio,
        "checks": [
            {"name": "busy machine: SFT step with one core busy / idle (default threads)", "ratio": ratio["default"],
             "target": 2.0, "op": "<="},
            {"name": "(info) the same with spinning waits (OMP_WAIT_POLICY=ACTIVE, the old default)",
             "ratio": ratio["spinning"], "target": None, "op": None},
            {"name": "(info) the same with --threads 1", "ratio": ratio["one"], "target": None, "op": None},
            {"name": "(info) idle step: default / spinning waits (the policy's cost on an idle machine)",
             "ratio": seconds["default"]["idle"] / seconds["spinning"]["idle"], "target": None, "op": None},
            {"name": "(info) busy step: default / --threads 1", "ratio": seconds["default"]["busy"] /
             seconds["one"]["busy"], "target": None, "op": None},
        ],
    }
