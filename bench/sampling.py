"""Sampling throughput: 16 concurrent requests of 64 new tokens on SmolLM2, three contenders side by side.

  whitney    the engine's continuous-batching sampler (all 16 submitted at once, stepped to completion)
  hf_each    Hugging Face `generate` called once per request
  hf_batch   Hugging Face `generate` on the 16 prompts batched (left padding)

Contenders alternate within each round; the medians over rounds are reported, as aggregate generated
tokens per second and as ratios. EOS is disabled for all three so every request makes exactly 64 tokens.

    python bench/sampling.py [--rounds 3] [--requests 16] [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from whitney.engine import DEFAULT_MODEL, Engine
from whitney.engine.sampler import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "How do plants make food?",
    "What is 17 times 3?", "Write a haiku about rain.", "Why is the sky blue?", "What is a LoRA adapter?",
    "Give me a synonym for happy.", "How far is the Moon?", "What does a compiler do?",
    "Describe a cat in one sentence.", "What is the boiling point of water?", "Who wrote Hamlet?",
    "What is photosynthesis?", "Suggest a name for a dog.", "How many legs does a spider have?",
]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def run_whitney(engine: Engine, ids: list[list[int]], tokens: int) -> int:
    requests = [engine.submit_sample(p, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, stop=()),
                                     base_model=DEFAULT_MODEL) for i, p in enumerate(ids)]
    while engine.sample_step():
        pass
    return sum(len(s.tokens) for r in requests for s in r.result.sequences)


def run_hf_each(model, ids: list[list[int]], tokens: int) -> int:
    made = 0
    for p in ids:
        out = model.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        made += out.shape[1] - len(p)
    return made


def run_hf_batch(model, ids: list[list[int]], tokens: int) -> int:
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    return (out.shape[1] - width) * len(ids)


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    engine = Engine()
    base = engine.load_model(DEFAULT_MODEL)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32).eval()
    ids = prompts(base.tokenizer, args.requests)
    contenders = {"whitney": lambda: run_whitney(engine, ids, args.tokens),
                  "hf_each": lambda: run_hf_each(hf, ids, args.tokens),
                  "hf_batch": lambda: run_hf_batch(hf, ids, args.tokens)}
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    run_whitney(engine, ids[:2], 4)  # warm-up
    with torch.no_grad():
        for r in range(args.rounds):
            for name, fn in contenders.items():
                t = time.perf_counter()
                made = fn()
                rates[name].append(made / (time.perf_counter() - t))
                print(f"round {r} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "benchmark": "sampling", "requests": args.requests, "new_tokens": args.tokens, "dtype": "float32",
        "tokens_per_s": med,
        "ratio_vs_hf_each": med["whitney"] / med["hf_each"],
        "ratio_vs_hf_batch": med["whitney"] / med["hf_batch"],
        "targets": {"ratio_vs_hf_each": 3.0, "ratio_vs_hf_batch": 1.0},
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
