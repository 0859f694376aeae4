"""Tiny random-weight test models with the real SmolLM2 tokenizer, saved as Hugging Face directories.

They load through the same code path as real models (`load_base_model(path)`).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

import torch

from whitney.engine.families.model import embedded_model_dir

VOCAB = 49152
# The tiny geometry every test model shares (2 layers, hidden 64).
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=2)


def _scale_and_save(model, out: Path) -> Path:
    """Scale the random init up (so logits are not all near-uniform and gradients are informative), then save
    the model with the real SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or ".experts." in name:  # matrices, and the stacked [E, ., .] weights of MoE experts
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.12)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(out)
    return out


# vLLM's CPU attention takes head sizes 32, 64, 80 and up: the tiny geometry with two heads of 32.
VLLM_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)


def make_tiny_model(out: Path, kind: str, seed: int = 0, **geometry) -> Path:
    """Write a 2-layer random model of `kind` ('llama' or 'qwen3') to out, TINY's geometry with `geometry`'s
    changes (e.g. VLLM_HEADS); return out."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = {**TINY, **geometry}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    else:
        raise ValueError(kind)
    return _scale_and_save(model, out)


# General-path families (engine/general.py): each family's own extras, on the shared tiny geometry.
GENERAL_KINDS = {
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "olmo2": dict(tie_word_embeddings=False),  # q/k norms over all heads, post-norms
    "phi3": dict(tie_word_embeddings=False),  # fused qkv_proj and gate_up_proj
    "smollm3": dict(tie_word_embeddings=True, no_rope_layers=[1, 0]),  # a layer without RoPE
    "qwen3_5_text": dict(tie_word_embeddings=False, head_dim=16, layer_types=["linear_attention", "full_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16),  # Gated DeltaNet + gated full attention
    # MoE: 4 experts, top-2, as stacked 3D expert weights (engine/experts.py)
    "qwen3_moe": dict(tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3_5_moe_text": dict(tie_word_embeddings=False, head_dim=16, layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48),  # + a shared expert (nn.Linear) with its gate
    # sliding-window layers (window 4, so the test sequences reach past it), scaled embeddings, tied head,
    # pre- and post-feedforward norms
    "gemma3_text": dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=16),
    # attention sinks, sliding window 4, YaRN RoPE, biased q/k/v/o, experts [E, in, out] with biases and
    # interleaved gate/up columns, its own clamped SwiGLU
    "gpt_oss": dict(tie_word_embeddings=False, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 16,
                                     "rope_theta": 150000.0}),
    # Qwen3.5 as it ships: the multimodal checkpoint (vision tower + text model, model_type qwen3_5), which
    # AutoModelForCausalLM loads as its text model (Qwen3_5ForCausalLM); the same for Qwen3.5-MoE
    "qwen3_5": dict(vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48,
                                       out_hidden_size=64)),
    "qwen3_5_moe": dict(vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48,
                                           out_hidden_size=64)),
    # Gemma 3 as it ships (4B and up): SigLIP + text model, which AutoModelForCausalLM loads whole
    # (Gemma3ForConditionalGeneration); its decoder is model.language_model
    "gemma3": dict(vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14), mm_tokens_per_image=4),
}
# Multimodal checkpoints: (the kind of their text model, the full model's class in transformers)
COMPOSITE_KINDS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration"),
                   "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration"),
                   "gemma3": ("gemma3_text", "Gemma3ForConditionalGeneration")}


def make_tiny_general_model(out: Path, kind: str, seed: int = 0, **geometry) -> Path:
    """Write a 2-layer random model of a general-path family (a key of GENERAL_KINDS) to out, TINY's geometry with
    `geometry`'s changes; return out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    common = {**TINY, **geometry}
    if kind in COMPOSITE_KINDS:
        import transformers

        text_kind, full = COMPOSITE_KINDS[kind]
        text = dict(common, **GENERAL_KINDS[text_kind])
        model = getattr(transformers, full)(AutoConfig.for_model(kind, text_config=text, **GENERAL_KINDS[kind]))
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **dict(common, **GENERAL_KINDS[kind])))
    return _scale_and_save(model, out)


# Vision-language checkpoints (engine/vision.py): the full model with its vision tower, saved with a processor
# built offline (the family's image processor, PIL backend, with tiny image sizes; the SmolLM2 tokenizer with the
# family's image tokens added, the vocabulary widened to cover them).
VISION_VOCAB = VOCAB + 8
_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
_QWEN_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2)
VISION_KINDS = {
    # Qwen3.5 as it ships (Gated DeltaNet + gated attention text model, mrope), the tiny qwen3_5_text geometry
    "qwen3_5": dict(text="qwen3_5_text", cls="Qwen3_5ForConditionalGeneration",
                    config=dict(vision_config=_QWEN_VISION)),
    # Qwen3-VL: Qwen3 text model with interleaved mrope and deepstack (vision features added at layer 0)
    "qwen3_vl": dict(text=None, cls="Qwen3VLForConditionalGeneration",
                     config=dict(vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]))),
    # Gemma 3 (SigLIP, 28 x 28 images of 2 x 2 patches pooled to 4 soft tokens)
    "gemma3": dict(text="gemma3_text", cls="Gemma3ForConditionalGeneration",
                   config=dict(GENERAL_KINDS["gemma3"])),
}


def make_tiny_vision_model(out: Path, kind: str, seed: int = 0) -> Path:
    """Write a tiny vision-language model of `kind` (a key of VISION_KINDS) with its processor to out; return out."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    torch.manual_seed(seed)
    spec = VISION_KINDS[kind]
    qwen = kind.startswith("qwen")
    names = (("vision_start_token", "vision_end_token", "image_token", "video_token") if qwen
             else ("boi_token", "eoi_token", "image_token"))
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(), extra_special_tokens=dict(
        zip(names, _QWEN_TOKENS if qwen else _GEMMA_TOKENS)))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (_QWEN_TOKENS if qwen else _GEMMA_TOKENS)}
    if qwen:
        text = dict(TINY, vocab_size=VISION_VOCAB, head_dim=16)
        if spec["text"]:
            text.update(GENERAL_KINDS[spec["text"]])
        else:  # Qwen3-VL's text model: mrope sections over the 8 rotary pairs of head_dim 16
            text.update(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                     "mrope_section": [4, 2, 2],
                                                                     "mrope_interleaved": True})
        tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                      vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
        config = AutoConfig.for_model(kind, text_config=text, **spec["config"], **tokens)
        image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                                min_pixels=32 * 32, max_pixels=96 * 96)
        processor = None  # Qwen3VLProcessor needs a video processor, which needs torchvision: saved as parts
    else:
        text = dict(TINY, vocab_size=VISION_VOCAB, **GENERAL_KINDS[spec["text"]])
        config = AutoConfig.for_model(kind, text_config=text, **spec["config"],
                                      image_token_id=ids["<image_soft_token>"],
                                      boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"])
        image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                                 image_seq_length=config.mm_tokens_per_image)
    model = getattr(transformers, spec["cls"])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or ".experts." in name:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.12)
    model.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    else:
        image_processor.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def built_on_first_use(root: Path, make: Callable[[Path, str], Path]) -> Callable[[str], str]:
    """kind -> the directory of its tiny model under root, built by make(dir, kind) the first time it is asked."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = str(make(root / kind, kind))
        return made[kind]

    return get


_IDS = itertools.count()


def unique_id(prefix: str) -> str:
    """A run id no other test of the session uses."""
    return f"{prefix}-{next(_IDS)}"
