"""A busy machine: the same SFT step through `whitney serve` on an idle CPU and with one core kept busy by
another process (a Python loop spinning on it), for the server's default thread policy and two others.

  default   `whitney serve` as it starts (`--threads auto`): the CPUs the other processes leave free, at most
            the CPUs it may use (engine/threads.py)
  fixed     `--threads <the CPUs it may use>`: Whitney's default before the thread policy
  one       `--threads 1`

Each setting gets its own server, one after the other; within a setting, idle and busy rounds alternate (a
round: N steps of forward_backward + optim_step submitted back to back and both awaited, as the demo does).
A busy round starts once the other process has run for SETTLE seconds (the machine is busy, not becoming
busy), an idle round SETTLE seconds after it ended; the step that starts together with the other process is
timed apart (`first_busy_step`: the engine sees the new load only after one call). Target: the default's busy
step at most 2x its idle step.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager

from bench.common import median, sft_batch, start_server, tiny_model
from whitney.protocol.config import usable_cpus

SETTINGS = {  # name -> extra `whitney serve` flags
    "default": (),
    "fixed": ("--threads", str(usable_cpus())),
    "one": ("--threads", "1"),
}


SETTLE = 1.0  # seconds the other process runs before a busy round's timing starts


@contextmanager
def one_core_busy(settle: float = SETTLE):
    """Another process spinning for as long as the block runs (one core's worth of work), `settle` s first."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle)
        yield
    finally:
        hog.kill()
        hog.wait()


def timed(work) -> float:
    t = time.perf_counter()
    work()
    return time.perf_counter() - t


def rounds_of(work, rounds: int, label: str) -> dict[str, list[float]]:
    """`work` timed idle and busy in each round, the order alternating (each after SETTLE seconds in its load)."""
    times: dict[str, list[float]] = {"idle": [], "busy": []}
    for r in range(rounds):
        for load in ("idle", "busy") if r % 2 == 0 else ("busy", "idle"):
            if load == "busy":
                with one_core_busy():
                    times[load].append(timed(work))
            else:
                time.sleep(SETTLE)  # as long as a busy round waits: the other process is gone, not going
                times[load].append(timed(work))
            print(f"  {label} round {r} {load}: {times[load][-1]:.3f}s", flush=True)
    return times


def measure(flags: tuple[str, ...], model: str, dtype: str, steps: int, rounds: int, batch: list[dict],
            rank: int, new_tokens: int) -> dict:
    """On one server, idle and with one core busy (alternating order across rounds): seconds per SFT step, and
    sampled tokens per second (4 sequences of `new_tokens`, greedy, EOS off, from the base model)."""
    import whitney

    with start_server("--dtype", dtype, *flags, model=model) as server:
        client = whitney.Client(server.url, timeout=900)
        run = client.create_session(purpose="bench-busy").create_run(rank=rank)
        prompt = batch[0]["input"]["token_ids"][:32]

        def step() -> None:
            fb = run.forward_backward(batch, "cross_entropy")
            opt = run.optim_step(learning_rate=1e-4)
            fb.result()
            opt.result()

        def train() -> None:
            for _ in range(steps):
                step()

        def sample() -> None:
            client.sample(prompt, base_model=run.info["base_model"], num_samples=4, max_tokens=new_tokens,
                          temperature=0.0, stop=[]).result()

        train()  # warm-up, untimed
        sample()
        times = rounds_of(train, rounds, "busy sft")
        sampling = rounds_of(sample, rounds, "busy sampling")
        step()  # idle: the engine has seen no other load lately
        with one_core_busy(settle=0.0):  # the step that starts with the other process
            first = timed(step)
        client.close()
    return {"seconds_per_step": {load: median(t) / steps for load, t in times.items()},
            "tokens_per_s": {load: 4 * new_tokens / median(t) for load, t in sampling.items()},
            "first_busy_step": first}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    from whitney.protocol.config import DEFAULT_MODEL

    model = tiny_model() if quick else DEFAULT_MODEL
    steps, rounds, batch_size, length, rank, new_tokens = (1, 1, 2, 32, 4, 4) if quick else (3, 3, 4, 128, 32, 32)
    batch = sft_batch(batch_size, length, seed=2)
    measured = {name: measure(flags, model, dtype, steps, rounds, batch, rank, new_tokens)
                for name, flags in SETTINGS.items()}
    seconds = {name: m["seconds_per_step"] for name, m in measured.items()}
    tokens = {name: m["tokens_per_s"] for name, m in measured.items()}
    first = {name: m["first_busy_step"] for name, m in measured.items()}
    ratio = {name: s["busy"] / s["idle"] for name, s in seconds.items()}
    slowdown = {name: t["idle"] / t["busy"] for name, t in tokens.items()}
    return {
        "benchmark": "busy",
        "settings": {"model": "tiny" if quick else "SmolLM2-135M", "batch": batch_size, "seq_len": length,
                     "rank": rank, "steps_per_round": steps, "rounds": rounds, "sampled": f"4 x {new_tokens}",
                     "dtype": dtype, "cpus": usable_cpus()},
        "seconds_per_step": seconds,
        "busy_over_idle": ratio,
        "sampled_tokens_per_s": tokens,
        "first_busy_step_s": first,
        "sampling_idle_over_busy": slowdown,
        "checks": [
            {"name": "busy machine: SFT step with one core busy / idle (default threads)", "ratio": ratio["default"],
             "target": 2.0, "op": "<="},
            {"name": "(info) the same with --threads fixed at the CPUs (the old default)",
             "ratio": ratio["fixed"], "target": None, "op": None},
            {"name": "(info) the same with --threads 1", "ratio": ratio["one"], "target": None, "op": None},
            {"name": "(info) idle step: default / fixed threads (the policy's cost on an idle machine)",
             "ratio": seconds["default"]["idle"] / seconds["fixed"]["idle"], "target": None, "op": None},
            {"name": "(info) busy step: default / --threads 1", "ratio": seconds["default"]["busy"] /
             seconds["one"]["busy"], "target": None, "op": None},
            {"name": "(info) the step that starts with the other process / an idle step (default threads)",
             "ratio": first["default"] / seconds["default"]["idle"], "target": None, "op": None},
            {"name": "(info) sampling with one core busy: tokens/s idle / busy (default threads)",
             "ratio": slowdown["default"], "target": None, "op": None},
            {"name": "(info) the same with --threads fixed at the CPUs (the old default)", "ratio": slowdown["fixed"],
             "target": None, "op": None},
        ],
    }
