"""EngineConfig: the engine's settings and the one place of their defaults (the Engine, the sampler, the
CLI, the service config and the backend all read these)."""

from __future__ import annotations

from dataclasses import dataclass


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
