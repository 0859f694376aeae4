"""Sharded, data-parallel training (whitney/engine/training/sharded.py): throughput with 2 ranks against 1, and each
rank's peak host memory while loading the base.

  throughput  one training step = forward_backward (cross_entropy) of a batch of 32 datums of 128 tokens, LoRA
              rank 32 on every module, + optim_step, on the default model in float32. N=1 is a one-rank group
              (spawn_ranks(1, ...)) so both sides run the same ShardedEngine code; with N=2 each pass's rows are
              split over the ranks. Every rank computes with 1 thread. Each rank warms up, then times its steps
              with time.perf_counter (rank 0's times are reported: the ranks run in lockstep). The groups
              alternate (1, 2, 2, 1, ...), each round a fresh group; medians over the rounds' median steps.
              Ratio = tokens/s with 2 ranks / tokens/s with 1 (2.0 = perfect scaling on 2 cores). The same with
              16 datums a step (info): each pass all-gathers every layer twice whatever its rows (about 1.2 s a
              step for SmolLM2 over gloo here), a cost a smaller step spreads over fewer tokens.
  load RSS    peak RSS (VmHWM) of each rank of a 2-rank group loading the base (ShardedEngine.load_model) and
              reading every weight it holds, against an unsharded Engine(device="cpu") doing the same in a fresh
              process: an unsharded load only maps a float32 safetensors file (zero-copy), whose pages become
              resident when a pass reads them, so "right after load_model" would count little of its base
              (recorded too, as `after_load`). Also the RSS of a fresh process that only imported torch and
              whitney (the baseline every process pays): the target, <= 0.72, is on the ratio net of it (what
              loading adds). Fresh processes alternate (unsharded, sharded, sharded, unsharded, ...); medians.
              RSS counts a mapped file's page cache in every process that maps it; PSS (smaps_rollup, in the
              detail) shares it out among them.

  python -m bench --only sharded --no-report      # about 8 minutes on 2 cores; --quick: under a minute
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import resource
import subprocess
import time

from bench.common import median

# ---- helpers run inside spawned processes (module level: they are pickled by name) --------------------------


def proc_status() -> dict[str, int]:
    """This process's VmHWM (peak RSS), VmRSS, RssAnon and RssFile, in KiB, and ru_maxrss (KiB on Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1])
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:  # proportional set size: pages shared with other processes (a file's page cache) counted 1/sharers each
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("Pss", "Pss_Anon", "Pss_File"):
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def _resident(base) -> dict:
    """This process's RSS once every weight of the loaded base has been read (resident)."""
    from whitney.engine.families.rank_local import held_weights

    for weight in held_weights(base):
        weight.sum()
    return proc_status()


def _rank_train(steps: int, warmup: int, batch: int, length: int, lora_rank: int) -> dict:
    """One rank's share of the throughput measurement: per-step seconds (forward_backward + optim_step)."""
    import torch
    import torch.distributed as dist

    from bench.common import engine_datums, sft_batch
    from whitney.engine import DEFAULT_MODEL, LoraConfig
    from whitney.engine.training.sharded import ShardedEngine

    engine = ShardedEngine(compute_dtype="float32")
    t = time.perf_counter()
    engine.load_model(DEFAULT_MODEL)
    load_s = time.perf_counter() - t
    engine.create_run("bench", DEFAULT_MODEL, LoraConfig(rank=lora_rank))
    batches = [engine_datums(sft_batch(batch, length, seed=100 + i)) for i in range(warmup + steps)]
    tokens = [sum(len(d.token_ids) for d in b) for b in batches]  # the model's input tokens of each step
    times, losses = [], []
    for i, data in enumerate(batches):
        dist.barrier()
        t = time.perf_counter()
        out = engine.forward_backward("bench", data, "cross_entropy")
        engine.optim_step("bench", {"learning_rate": 1e-4})
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
        losses.append(float(out.loss))
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "threads": torch.get_num_threads(),
            "load_s": load_s, "step_s": times, "tokens_per_step": tokens[warmup:], "losses": losses,
            "status": proc_status()}


def _rank_load() -> dict:
    """One rank of the sharded load: its RSS before, right after ShardedEngine.load_model, and with its weights
    resident."""
    import torch.distributed as dist

    from whitney.engine import DEFAULT_MODEL
    from whitney.engine.training.sharded import ShardedEngine

    engine = ShardedEngine(compute_dtype="float32")
    before = proc_status()
    t = time.perf_counter()
    base = engine.load_model(DEFAULT_MODEL)
    load_s = time.perf_counter() - t
    after = proc_status()
    resident = _resident(base)
    dist.barrier()  # every rank has measured before any leaves (no rank's exit can shift another's figures)
    return {"rank": dist.get_rank(), "before": before, "after": after, "resident": resident, "load_s": load_s}


def _unsharded_load(threads: int) -> dict:
    """A fresh process's RSS before, right after an unsharded Engine(device="cpu").load_model, and with its weights
    resident."""
    import torch

    from whitney.engine import DEFAULT_MODEL, Engine

    torch.set_num_threads(threads)
    engine = Engine(device="cpu", compute_dtype="float32")
    before = proc_status()
    t = time.perf_counter()
    base = engine.load_model(DEFAULT_MODEL)
    load_s = time.perf_counter() - t
    after = proc_status()
    return {"before": before, "after": after, "resident": _resident(base), "load_s": load_s}


def _imports_only() -> dict:
    """The RSS of a fresh process that imported torch and whitney (the engine, the sharded engine) and nothing
    more."""
    import torch  # noqa: F401

    import whitney
    import whitney.engine
    import whitney.engine.training.sharded  # noqa: F401

    return proc_status()


def in_fresh_process(fn, *args):
    """fn(*args) in a new spawned process (nothing inherited from this one's memory); its result."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=600)


# ---- machine --------------------------------------------------------------------------------------------------


class OtherCpu:
    """CPU seconds spent by processes other than this one and its children (other people's work on the machine)
    between start and stop: every core's busy time (/proc/stat) less this process tree's (getrusage; spawned
    ranks count once joined)."""

    def __init__(self):
        self.busy0, self.own0, self.t0 = self.busy(), self.own(), time.perf_counter()

    @staticmethod
    def busy() -> float:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def own() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        other = max(0.0, (self.busy() - self.busy0) - (self.own() - self.own0))
        return {"other_cpu_s": other, "other_cpu_share": other / (wall * (os.cpu_count() or 1))}


def tree() -> dict:
    """The commit measured and the files of whitney/ changed from it (the sharded engine moves fast)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=False,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "whitney_changed": git("status", "--short", "whitney").splitlines()}


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags (lscpu; /proc/cpuinfo when lscpu is missing)."""
    text = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), None)
    if flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
    return sorted(f for f in flags if f.startswith(("avx512", "amx")))


# ---- the measurements -------------------------------------------------------------------------------------------


def throughput(quick: bool = False, rounds: int | None = None, threads: int = 1, batch: int = 16,
               steps: int = 4) -> dict:
    """Tokens/s of sharded training with 2 ranks against 1, `batch` datums of 128 tokens a step (see the module
    docstring)."""
    from whitney.engine.training.sharded import spawn_ranks

    if quick:  # a quarter of the datums, of 32 tokens
        steps, warmup, batch, length, lora_rank, rounds = 2, 1, max(1, batch // 4), 32, 8, rounds or 1
    else:
        warmup, length, lora_rank, rounds = 1, 128, 32, rounds or 2
    settings = {"steps": steps, "warmup_steps": warmup, "batch": batch, "seq_len": length, "lora_rank": lora_rank,
                "rounds": rounds, "threads_per_rank": threads, "dtype": "float32", "loss": "cross_entropy"}
    raw: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(rounds):
        for n in ((1, 2) if r % 2 == 0 else (2, 1)):
            load_before = list(os.getloadavg())
            other = OtherCpu()
            t = time.perf_counter()
            ranks = spawn_ranks(n, _rank_train, steps, warmup, batch, length, lora_rank, backend="gloo",
                                timeout=900, threads=threads)
            wall = time.perf_counter() - t
            others = other.stop()
            step_s = ranks[0]["step_s"]
            tokens = ranks[0]["tokens_per_step"][0]
            raw[n].append({"round": r, "step_s": step_s, "median_step_s": median(step_s),
                           "tokens_s": tokens / median(step_s), "tokens_per_step": tokens,
                           "threads": [x["threads"] for x in ranks], "load_s": [x["load_s"] for x in ranks],
                           "step_s_by_rank": [x["step_s"] for x in ranks], "losses_rank0": ranks[0]["losses"],
                           "wall_s": wall, "load_average_before": load_before,
                           "load_average_after": list(os.getloadavg()), **others})
            print(f"  sharded round {r} N={n}: median step {median(step_s):.3f}s, "
                  f"{raw[n][-1]['tokens_s']:.0f} tokens/s (group wall {wall:.0f}s; other processes used "
                  f"{others['other_cpu_share']:.0%} of the cores meanwhile)", flush=True)
    tokens_s = {n: median([x["tokens_s"] for x in v]) for n, v in raw.items()}
    ratios = [b["tokens_s"] / a["tokens_s"] for a, b in zip(raw[1], raw[2])]  # per round
    return {"settings": settings, "tokens_s": {str(n): v for n, v in tokens_s.items()},
            "median_step_s": {str(n): median([x["median_step_s"] for x in v]) for n, v in raw.items()},
            "ratio": tokens_s[2] / tokens_s[1], "ratio_by_round": ratios,
            # how much of the machine other people's processes took while the groups ran (0 = a quiet machine)
            "other_cpu_share_max": max(x["other_cpu_share"] for v in raw.values() for x in v),
            "raw": {str(n): v for n, v in raw.items()}}


def load_rss(quick: bool = False, rounds: int | None = None, n: int = 2, threads: int = 1, warm: bool = True) -> dict:
    """Each rank's peak RSS loading the default model sharded over n ranks, against one unsharded load in a fresh
    process, and the RSS of a process that only imported torch and whitney (see the module docstring). warm: load
    once first, unmeasured (the first load may convert and cache the model); False where it has been loaded since
    this machine cached it."""
    from whitney.engine.training.sharded import spawn_ranks

    rounds = rounds or (1 if quick else 2)
    if warm:
        in_fresh_process(_unsharded_load, threads)
    baseline = [in_fresh_process(_imports_only) for _ in range(rounds)]
    unsharded, sharded = [], []
    other = OtherCpu()
    for r in range(rounds):
        for kind in (("unsharded", "sharded") if r % 2 == 0 else ("sharded", "unsharded")):
            if kind == "unsharded":
                unsharded.append(in_fresh_process(_unsharded_load, threads))
                hwm = unsharded[-1]["resident"]["VmHWM"]
            else:
                sharded.append(spawn_ranks(n, _rank_load, backend="gloo", timeout=600, threads=threads))
                hwm = max(x["resident"]["VmHWM"] for x in sharded[-1])
            print(f"  sharded load round {r} {kind}: peak RSS {hwm / 1024:.0f} MiB", flush=True)
    mib = 1 / 1024

    def peak(stage: str) -> tuple[float, float, list[float]]:
        """Median VmHWM (MiB) at `stage` of the unsharded loads, of the larger rank of each sharded load, and of
        each rank."""
        return (median([u[stage]["VmHWM"] for u in unsharded]) * mib,
                median([max(x[stage]["VmHWM"] for x in s) for s in sharded]) * mib,
                [median([s[i][stage]["VmHWM"] for s in sharded]) * mib for i in range(n)])

    def detail(stage: str) -> dict:
        keys = ("VmRSS", "RssAnon", "RssFile", "Pss", "Pss_Anon", "Pss_File")
        return {"unsharded": {k: median([u[stage][k] for u in unsharded]) * mib for k in keys
                              if k in unsharded[0][stage]},
                "sharded_by_rank": [{k: median([s[i][stage][k] for s in sharded]) * mib for k in keys
                                     if k in sharded[0][i][stage]} for i in range(n)]}

    others = other.stop()
    base_rss = median([b["VmRSS"] for b in baseline]) * mib
    unsharded_peak, per_rank_peak, by_rank = peak("resident")
    unsharded_after, per_rank_after, _ = peak("after")
    return {
        "settings": {"ranks": n, "rounds": rounds, "threads_per_rank": threads, "dtype": "float32"},
        "baseline_imports_only_mib": {"VmHWM": median([b["VmHWM"] for b in baseline]) * mib, "VmRSS": base_rss},
        # loaded, every weight read (resident)
        "unsharded_peak_mib": unsharded_peak,
        "per_rank_peak_mib": per_rank_peak,  # the larger rank's
        "per_rank_peak_by_rank_mib": by_rank,
        "ratio": per_rank_peak / unsharded_peak,
        # the memory loading adds above what every process pays for its imports
        "ratio_net_of_baseline": (per_rank_peak - base_rss) / (unsharded_peak - base_rss),
        # right after load_model (the unsharded side's file only mapped)
        "after_load": {"unsharded_peak_mib": unsharded_after, "per_rank_peak_mib": per_rank_after,
                       "ratio": per_rank_after / unsharded_after},
        "resident_mib": detail("resident"),
        "after_load_mib": detail("after"),
        "load_s": {"unsharded": median([u["load_s"] for u in unsharded]),
                   "sharded": median([max(x["load_s"] for x in s) for s in sharded])},
        "other_cpu_share": others["other_cpu_share"],
        "raw": {"baseline": baseline, "unsharded": unsharded, "sharded": sharded},
    }


def run(quick: bool = False, dtype: str = "float32") -> dict:
    """Both measurements; float32 whatever `dtype` says (the sharded engine's tested dtype), recorded as such."""
    from bench.common import machine

    threads = 1
    info = {**machine(), "cpu_flags": cpu_flags(), "threads_per_rank": threads, "tree": tree()}
    if info["load_average"][0] > 0.5:
        print(f"  sharded: load average {info['load_average'][0]:.2f} at the start: the 2-rank side needs both "
              "cores to itself", flush=True)
    tp = throughput(quick, threads=threads, batch=32, steps=3)
    small = throughput(quick, threads=threads, batch=16, steps=4)
    mem = load_rss(quick, threads=threads, warm=False)  # the throughput's groups have loaded (and cached) it
    return {
        "benchmark": "sharded",
        "dtype": "float32",
        "settings": {"throughput": tp["settings"], "throughput_small": small["settings"],
                     "load_rss": mem["settings"]},
        "machine_detail": info,
        "throughput": tp,
        "throughput_small": small,
        "load_rss": mem,
        "checks": [
            {"name": f"sharded: training tokens/s with 2 ranks / 1 rank ({threads} thread each, "
                     f"batch {tp['settings']['batch']} x {tp['settings']['seq_len']})",
             "ratio": tp["ratio"], "target": 1.7, "op": ">="},
            {"name": f"(info) sharded: the same with a smaller step, {small['settings']['batch']} x "
                     f"{small['settings']['seq_len']} (the all-gathers' fixed cost per pass weighs more)",
             "ratio": small["ratio"], "target": None, "op": None},
            {"name": "(info) sharded: per-rank peak RSS loading (weights resident), 2 ranks / unsharded",
             "ratio": mem["ratio"], "target": None, "op": None},
            {"name": "sharded: the same, net of an import-only process's RSS",
             "ratio": mem["ratio_net_of_baseline"], "target": 0.72, "op": "<="},
        ],
    }
