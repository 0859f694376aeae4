"""The general path (engine/general.py) per family: SFT step time against a plain HF + PEFT loop, and
sampling throughput against HF `generate` batched, on the same tiny-but-not-trivial random model.

Every general-path family of tests/models.py (GENERAL_KINDS, but for the composite checkpoints such as
qwen3_5, a vision tower around the text family measured on its own) on one geometry: 4 layers, hidden 256, 4 heads of 64 (2 key/value
heads), MLP 512 (MoE: 8 experts of 128, top 2), the real SmolLM2 tokenizer and its 49152-token vocabulary,
each family's own extras (Qwen3.5's Gated DeltaNet in 3 of 4 layers, sliding windows of 64 in 3 of 4
layers for gemma3_text and gpt_oss, ...). Weights random, scaled as in the tests. Made once, cached.

  (a) SFT: forward_backward (cross_entropy summed over tokens) + optim_step (AdamW lr 1e-4, betas
      0.9/0.95, eps 1e-12) on a batch of 8 x 128 tokens, LoRA rank 16 (alpha 16) on every adaptable
      module of the family and lm_head (Whitney's default targets):
        whitney  Engine.forward_backward + Engine.optim_step in this process (the engine, not HTTP)
        peft     AutoModelForCausalLM + the run's own adapter exported and loaded with peft
                 (PeftModel.from_pretrained, is_trainable: the same modules, expert projections as PEFT
                 target_parameters) + torch.optim.AdamW, same datums, same loss
  (b) sampling: 8 chat prompts (different lengths) x 32 new tokens, temperature 1, EOS disabled:
        whitney       Engine.submit_sample for all, stepped to completion (the base model)
        whitney_lora  the same with a run's sampler weights (LoRA hooks in every pass; info)
        hf_batch      HF generate on the prompts batched (left padding), do_sample, top_k 0

Contenders alternate within each round; medians over rounds. Ratios: SFT whitney/peft step time (target
<= 1.0), sampling whitney/hf_batch tokens per second (target >= 1.0).

    python -m bench --only general
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from pathlib import Path

import torch

from bench.common import alternate, engine_datums, median, peft_sft_step, sft_batch

# One geometry for every family (each family's own extras from tests/models.GENERAL_KINDS on top).
GEOMETRY = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)
# Per-family settings that depend on the geometry (4 layers, heads of 64).
FAMILY = {
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    "qwen3_moe": dict(MOE, num_experts=8),
    "qwen3_5_moe_text": dict(MOE, num_experts=8, shared_expert_intermediate_size=256,
                             layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    "gemma3_text": dict(sliding_window=64, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                        query_pre_attn_scalar=64),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128, sliding_window=64,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"]),
}
RANK = 16


def families() -> list[str]:
    from tests.models import GENERAL_KINDS

    # Not the composite checkpoints (a vision tower around a text family measured on its own).
    return [k for k, extras in GENERAL_KINDS.items() if "vision_config" not in extras]


def bench_model(kind: str) -> str:
    """The family's bench model directory, made once under the Whitney cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models import GENERAL_KINDS, TINY, _scale_and_save

    root = Path(os.environ.get("WHITNEY_CACHE_DIR", "~/.cache/whitney")).expanduser() / "bench-general"
    out = root / kind
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(kind, **{**TINY, **GENERAL_KINDS[kind], **GEOMETRY, **FAMILY.get(kind, {})})
        tmp = root / f".{kind}-{os.getpid()}"
        _scale_and_save(AutoModelForCausalLM.from_config(cfg), tmp)
        os.replace(tmp, out)
    return str(out)


def peft_loop(model_dir: str, adapter_dir: str, dtype: str):
    """A plain HF + PEFT training step on the exported adapter (the same modules as the run); returns
    step(batch) -> loss. LoRA weights stay float32 in PEFT (autocast_adapter_dtype), as in Whitney."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)
    return peft_sft_step(model)


def sample_whitney(engine, ids: list[list[int]], tokens: int, weights: dict) -> int:
    from whitney.protocol.sampling import SamplingParams

    requests = [engine.submit_sample(p, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, stop=()), **weights)
                for i, p in enumerate(ids)]
    while engine.sample_step():
        pass
    assert all(r.error is None for r in requests), [r.error for r in requests if r.error]
    return sum(len(s.tokens) for r in requests for s in r.result.sequences)


def sample_hf_batch(model, ids: list[list[int]], tokens: int) -> int:
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])  # [R, P] left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    return (out.shape[1] - width) * len(ids)


def measure(kind: str, dtype: str, quick: bool) -> dict:
    import tempfile

    from transformers import AutoModelForCausalLM

    from bench.sampling import prompts
    from whitney.engine import Engine, LoraConfig

    steps, rounds, batch_size, length = (1, 1, 2, 32) if quick else (1, 3, 8, 128)
    requests, new_tokens, sample_rounds = (4, 8, 1) if quick else (8, 32, 3)
    path = bench_model(kind)
    engine = Engine(device="cpu", compute_dtype=dtype)
    base = engine.load_model(path)
    engine.create_run("sft", path, LoraConfig(rank=RANK, alpha=float(RANK), seed=0))
    batch = sft_batch(batch_size, length, seed=1)
    datums = engine_datums(batch)
    with tempfile.TemporaryDirectory() as tmp:
        engine.export_lora("sft", f"{tmp}/adapter")  # B = 0: the run as created
        plain_step, peft_params = peft_loop(path, f"{tmp}/adapter", dtype)
    whitney_params = sum(p.numel() for p in engine.get_run("sft").weights().values())

    def whitney_sft() -> None:
        for _ in range(steps):
            engine.forward_backward("sft", datums, "cross_entropy")
            engine.optim_step("sft", {"learning_rate": 1e-4})

    def peft_sft() -> None:
        for _ in range(steps):
            plain_step(batch)

    sft = {"whitney": whitney_sft, "peft": peft_sft}
    for fn in sft.values():  # warm-up, untimed
        fn()
    sft_times = alternate(sft, rounds, f"general {kind} sft")

    # (b) sampling: base weights for the target, a trained run's sampler weights for information
    version = engine.save_weights_for_sampler("sft")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = prompts(base.tokenizer, requests)
    sampling = {
        "whitney": lambda: sample_whitney(engine, ids, new_tokens, dict(base_model=path)),
        "whitney_lora": lambda: sample_whitney(engine, ids, new_tokens, dict(run_id="sft", version=version)),
        "hf_batch": lambda: sample_hf_batch(hf, ids, new_tokens),
    }
    rates: dict[str, list[float]] = {k: [] for k in sampling}
    with torch.no_grad():
        # Warm-up, untimed: all prompts (so the sampler's one-time padding check runs here) for 2 tokens.
        sample_whitney(engine, ids, 2, dict(base_model=path))
        sample_whitney(engine, ids, 2, dict(run_id="sft", version=version))
        sample_hf_batch(hf, ids, 2)
        for r in range(sample_rounds):
            names = list(sampling)
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                made = sampling[name]()
                rates[name].append(made / (time.perf_counter() - t))
                print(f"  general {kind} sampling round {r} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    sampler = engine.samplers[base.name]
    step_s = {k: median(v) / steps for k, v in sft_times.items()}
    tok_s = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "seconds_per_step": step_s,
        "tokens_per_s": tok_s,
        "sft_ratio": step_s["whitney"] / step_s["peft"],
        "sampling_ratio": tok_s["whitney"] / tok_s["hf_batch"],
        "sampling_lora_ratio": tok_s["whitney_lora"] / tok_s["hf_batch"],
        "trainable_params": {"whitney": whitney_params, "peft": peft_params},
        "adapted_modules": len(engine.get_run("sft").adapter.A),
        "padded_merge": sampler.cache.pads,
        "raw_seconds_per_round": sft_times,
        "raw_tokens_per_s": rates,
    }


def run(quick: bool = False, dtype: str = "float32") -> dict:
    kinds = families()
    results, checks = {}, []
    for kind in kinds:
        print(f"  general: {kind}", flush=True)
        try:
            r = results[kind] = measure(kind, dtype, quick)
        except Exception as e:  # one family failing must not hide the others
            import traceback

            traceback.print_exc()
            results[kind] = {"error": f"{type(e).__name__}: {e}"}
            checks += [{"name": f"general {kind}: **failed** ({type(e).__name__})", "ratio": None, "target": 1.0,
                        "op": "<="}]
            continue
        checks += [
            {"name": f"general {kind}: SFT step time, Whitney engine / HF + PEFT", "ratio": r["sft_ratio"],
             "target": 1.0, "op": "<="},
            {"name": f"general {kind}: sampling tokens/s, Whitney engine / HF generate batched",
             "ratio": r["sampling_ratio"], "target": 1.0, "op": ">="},
            {"name": f"(info) general {kind}: sampling with a LoRA adapter / HF generate batched (base)",
             "ratio": r["sampling_lora_ratio"], "target": None, "op": None},
        ]
    batch, length, requests, new_tokens = (2, 32, 4, 8) if quick else (8, 128, 8, 32)
    return {
        "benchmark": "general",
        "settings": {"families": ",".join(kinds), "layers": GEOMETRY["num_hidden_layers"],
                     "hidden": GEOMETRY["hidden_size"], "vocab": GEOMETRY["vocab_size"], "rank": RANK,
                     "batch": batch, "seq_len": length, "requests": requests, "new_tokens": new_tokens,
                     "dtype": dtype},
        "families": results,
        "checks": checks,
    }
