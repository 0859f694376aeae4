"""Tiny random-weight test models with the real SmolLM2 tokenizer, saved as Hugging Face directories.

They load through the same code path as real models (`load_base_model(path)`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from whitney.engine.model import embedded_model_dir

VOCAB = 49152


def make_tiny_model(out: Path, kind: str, seed: int = 0) -> Path:
    """Write a 2-layer random model of `kind` ('llama' or 'qwen3') to out; return out."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    else:
        raise ValueError(kind)
    # Random init is small; scale up so logits are not all near-uniform and gradients are informative.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.12)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(out)
    return out
