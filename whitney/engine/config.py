"""EngineConfig: the engine's settings and the one place of their defaults (the Engine, the sampler, the
CLI, the service config and the backend all read these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_lora_rank: int = 128
    compute_dtype: str = "float32"  # base weights and activations: "float32" or "bfloat16"
    max_sequences: int = 256  # sampling: concurrent sequences per base model (more wait in a queue)
    max_cached_tokens: int = 262_144  # sampling: KV-cache tokens per base model
    max_prefill_tokens: int = 8192  # sampling: prompt tokens prefilled per step
