"""What this server offers: models, operations, losses, limits, features."""

from __future__ import annotations

from fastapi import APIRouter

from whitney.engine import LOSS_CONFIG_KEYS
from whitney.service.deps import State
from whitney.service.scheduler import TRAINING_KINDS

router = APIRouter(prefix="/v1", tags=["capabilities"])


@router.get("/training/capabilities")
def capabilities(st: State) -> dict:
    engine = st.scheduler.engine
    return {
        "models": [{
            "name": name,
            "context_length": engine.models[name].config.max_context,
            "vocab_size": engine.models[name].config.vocab_size,
            "trainable": True,
            "sampleable": True,
            "max_lora_rank": engine.max_lora_rank,
            "compute_dtype": engine.compute_dtype_name,
        } for name in st.models],
        "operations": [*TRAINING_KINDS, "sample", "compute_logprobs"],
        "loss_functions": {name: list(keys) for name, keys in LOSS_CONFIG_KEYS.items()},
        "limits": {
            "max_request_bytes": st.max_request_bytes,
            "max_batch_tokens": st.scheduler.max_batch_tokens,
            "max_concurrent_sequences": engine.max_sequences,
            "max_cached_tokens": engine.max_cached_tokens,
        },
        "features": {"gradient_scale_v1": True, "lora_plus": True, "soft_targets": True, "opsd": True},
    }
