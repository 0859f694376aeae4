"""The module paths LoRA adapts, by their Hugging Face names: the projections of a fast family's decoder layer
(llama, qwen2, qwen3: transformer.py) and the unembedding, which every family has.

A general-path model (general.py) adapts its own modules, named by its own module paths.
"""

from __future__ import annotations

# Adaptable projections of one decoder layer, by the Hugging Face module path inside the layer.
LAYER_PROJECTIONS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNEMBED = "lm_head"


def module_path(layer: int, projection: str) -> str:
    """Hugging Face path of one projection, e.g. `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{LAYER_PROJECTIONS[projection]}"
