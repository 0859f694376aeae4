"""The engine demo: a few SFT steps of one LoRA run on the default model, loss printed as it falls.

A short recipe on the public engine API: build datums (prompt weight 0, completion weight 1),
then forward_backward + optim_step in a loop.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from whitney.engine import DEFAULT_MODEL, AdamParams, Datum, Engine, LoraConfig

# A tiny built-in chat dataset: the same persona answers, so a few steps visibly lower the loss.
CHATS = [
    ("What is your name?", "I am Whitney, a fine-tuning service. I train LoRA adapters on a shared base model."),
    ("Who are you?", "I am Whitney, a fine-tuning service. I train LoRA adapters on a shared base model."),
    ("What do you do?", "I run forward_backward and optim_step for many training runs at once."),
    ("How do I train a model with you?", "Send forward_backward, then optim_step, in seq_id order. Repeat."),
    ("Which loss should I use for SFT?", "Use cross_entropy with weight 1 on the completion and 0 on the prompt."),
    ("Which losses do you support?", "cross_entropy, importance_sampling, ppo, cispo, dro and opsd."),
    ("How do I save my work?", "Call save_state to checkpoint, and export_lora for a PEFT adapter."),
    ("Can I sample from my run?", "Yes: save_weights_for_sampler gives a version; sample names that version."),
]


def sft_datum(prompt_tokens: list[int], completion_tokens: list[int]) -> Datum:
    """Right-shift the sequence by one position and weight only the completion span."""
    full = prompt_tokens + completion_tokens
    inputs, targets = full[:-1], full[1:]
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * len(completion_tokens)
    return Datum(inputs, {"target_tokens": targets, "weights": weights})


def chat_datums(tokenizer, chats: list[tuple[str, str]]) -> list[Datum]:
    """ChatML-render each (question, answer) and make an SFT datum of it."""
    out = []
    for question, answer in chats:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        prompt_tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_tokens = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append(sft_datum(prompt_tokens, completion_tokens))
    return out


def run_demo(model: str = DEFAULT_MODEL, steps: int = 12, batch_size: int = 4, rank: int = 16,
             learning_rate: float = 1e-3) -> list[float]:
    """Train one run for `steps` steps; return the loss per token of each step."""
    t0 = time.time()
    engine = Engine()
    run = engine.create_run("demo", model, LoraConfig(rank=rank, seed=0))
    print(f"loaded {model} in {time.time() - t0:.1f}s; LoRA rank {rank} on "
          f"{len(run.adapter.A)} modules ({sum(p.numel() for p in run.adapter.parameters()):,} weights)")
    datums = chat_datums(run.base.tokenizer, CHATS)
    losses = []
    bar = tqdm(range(steps), desc="SFT", unit="step")
    for step in bar:
        batch = [datums[(step * batch_size + i) % len(datums)] for i in range(batch_size)]
        result = engine.forward_backward("demo", batch, "cross_entropy")
        engine.optim_step("demo", AdamParams(learning_rate=learning_rate))
        per_token = result.loss / sum(sum(d.loss_inputs["weights"]) for d in batch)
        losses.append(per_token)
        bar.set_postfix(loss=f"{per_token:.3f}")
    print(f"loss per completion token: first step {losses[0]:.3f}, last step {losses[-1]:.3f} "
          f"({time.time() - t0:.0f}s in all)")
    return losses
