"""Service overhead: the same SFT steps through HTTP, in-process through the engine, and as a plain
PyTorch + PEFT loop.

A step is forward_backward (cross_entropy, summed over tokens) + optim_step (AdamW, lr 1e-4, betas
0.9/0.95, eps 1e-12, no decay, no clipping) on a LoRA of rank 32 over every linear layer including the
unembedding (Whitney's default train_unembed=True; PEFT's target_modules list the same modules).

  http     whitney.Client against `whitney serve` in its own process; per step fb and optim_step are
           submitted back to back (pipelined) and both results awaited, as the demo does
  engine   Engine.forward_backward + Engine.optim_step in this process
  peft     Hugging Face AutoModelForCausalLM + peft LoRA + torch.optim.AdamW, same data, same loss
"""

from __future__ import annotations

import torch

from bench.common import alternate, engine_datums, median, peft_sft_step, sft_batch, start_server
from whitney.engine import DEFAULT_MODEL, Engine, LoraConfig

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def peft_loop(model_dir: str, rank: int, dtype: str = "float32"):
    """A plain PyTorch + PEFT training step doing Whitney's math; returns step(batch) -> loss.

    The base model is loaded in `dtype`; PEFT keeps the LoRA weights in float32 (autocast_adapter_dtype)
    and the loss is taken on float32 logits, as in Whitney.
    """
    import warnings

    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(hf, PeftLora(r=rank, lora_alpha=rank, lora_dropout=0.0,
                                            target_modules=TARGET_MODULES))
    return peft_sft_step(model)


def run(quick: bool = False, dtype: str = "float32") -> dict:
    import whitney

    steps, rounds, batch_size, length, rank = (1, 1, 2, 32, 8) if quick else (3, 3, 8, 128, 32)
    batch = sft_batch(batch_size, length, seed=1)
    tokens_per_step = batch_size * length

    engine = Engine(compute_dtype=dtype)
    base = engine.load_model(DEFAULT_MODEL)
    engine.create_run("bench", lora=LoraConfig(rank=rank))
    datums = engine_datums(batch)
    plain_step, peft_params = peft_loop(str(base.path), rank, dtype)
    whitney_params = sum(p.numel() for p in engine.runs["bench"].weights().values())

    with start_server("--dtype", dtype) as server:
        client = whitney.Client(server.url, timeout=600)
        session = client.create_session(purpose="bench-overhead")
        run_ = session.create_run(rank=rank)

        def http() -> None:
            for _ in range(steps):
                fb = run_.forward_backward(batch, "cross_entropy")
                opt = run_.optim_step(learning_rate=1e-4)
                fb.result()
                opt.result()

        def in_process() -> None:
            for _ in range(steps):
                engine.forward_backward("bench", datums, "cross_entropy")
                engine.optim_step("bench", {"learning_rate": 1e-4})

        def plain() -> None:
            for _ in range(steps):
                plain_step(batch)

        contenders = {"http": http, "engine": in_process, "peft": plain}
        for fn in contenders.values():  # warm-up: one step each, untimed
            fn()
        times = alternate(contenders, rounds, "overhead")
        session.close()
        client.close()

    med = {k: median(v) / steps for k, v in times.items()}  # seconds per step
    return {
        "benchmark": "overhead",
        "settings": {"steps_per_round": steps, "rounds": rounds, "batch": batch_size, "seq_len": length,
                     "rank": rank, "train_unembed": True, "dtype": dtype,
                     "trainable_params": {"whitney": whitney_params, "peft": peft_params}},
        "seconds_per_step": med,
        "tokens_per_s": {k: tokens_per_step / v for k, v in med.items()},
        "raw_seconds_per_round": times,
        "checks": [
            {"name": "service overhead: HTTP step time / plain PyTorch+PEFT step time",
             "ratio": med["http"] / med["peft"], "target": 1.05, "op": "<="},
            {"name": "(info) engine in-process step time / plain PyTorch+PEFT", "ratio": med["engine"] / med["peft"],
             "target": None, "op": None},
            {"name": "(info) HTTP step time / engine in-process", "ratio": med["http"] / med["engine"],
             "target": None, "op": None},
        ],
    }
