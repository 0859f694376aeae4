"""Sampling throughput: concurrent requests of new tokens on SmolLM2, contenders side by side.

  whitney_http  the server's continuous-batching sampler: `whitney serve` in its own process, all
                requests sent at once through whitney.Client, then every result awaited (the suite)
  whitney       the engine's sampler in this process (all submitted at once, stepped to completion)
  hf_each       Hugging Face `generate` called once per request
  hf_batch      Hugging Face `generate` on the prompts batched (left padding)

Contenders alternate within each round; the medians over rounds are reported, as aggregate generated
tokens per second and as ratios. EOS is disabled for all so every request makes exactly `tokens`.
hf_each's rate does not depend on how many requests it runs one by one, so `each_requests` may time
it on the first few prompts only (the suite does, to keep its run short).

    python bench/sampling.py [--rounds 3] [--requests 16] [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from whitney.engine import DEFAULT_MODEL, Engine
from whitney.protocol.sampling import SamplingParams

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


def run_whitney_http(client, ids: list[list[int]], tokens: int) -> int:
    futures = [client.sample(p, base_model=DEFAULT_MODEL, max_tokens=tokens, temperature=1.0, seed=i, stop=[])
               for i, p in enumerate(ids)]
    return sum(len(s["tokens"]) for f in futures for s in f.result()["sequences"])


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


def measure(rounds: int = 3, requests: int = 16, tokens: int = 64, http: bool = False, engine_too: bool = True,
            each_requests: int | None = None, dtype: str = "float32") -> dict:
    """Tokens/s of each contender (medians over rounds) and the ratios against both HF baselines."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    engine = Engine(compute_dtype=dtype)
    base = engine.load_model(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(base.path, dtype=getattr(torch, dtype)).eval()
    ids = prompts(base.tokenizer, requests)
    each_ids = ids[:each_requests] if each_requests else ids
    contenders = {}
    server = client = None
    if http:
        import whitney
        from bench.common import start_server

        server = start_server("--dtype", dtype)
        client = whitney.Client(server.url, timeout=600)
        contenders["whitney_http"] = lambda: run_whitney_http(client, ids, tokens)
    if engine_too or not http:
        contenders["whitney"] = lambda: run_whitney(engine, ids, tokens)
    contenders["hf_each"] = lambda: run_hf_each(hf, each_ids, tokens)
    contenders["hf_batch"] = lambda: run_hf_batch(hf, ids, tokens)
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    try:
        if http:
            run_whitney_http(client, ids[:2], 4)  # warm-up
        run_whitney(engine, ids[:2], 4)
        with torch.no_grad():
            run_hf_batch(hf, ids[:2], 2)
            for r in range(rounds):
                names = list(contenders)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    t = time.perf_counter()
                    made = contenders[name]()
                    rates[name].append(made / (time.perf_counter() - t))
                    print(f"  sampling round {r} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    main = "whitney_http" if http else "whitney"
    return {
        "benchmark": "sampling", "requests": requests, "new_tokens": tokens, "dtype": dtype,
        "hf_each_requests": len(each_ids), "rounds": rounds, "measured": main,
        "tokens_per_s": med, "raw_tokens_per_s": rates,
        "ratio_vs_hf_each": med[main] / med["hf_each"],
        "ratio_vs_hf_batch": med[main] / med["hf_batch"],
        "targets": {"ratio_vs_hf_each": 3.0, "ratio_vs_hf_batch": 1.0},
        "threads": torch.get_num_threads(),
    }


def run(quick: bool = False, dtype: str = "float32") -> dict:
    """The suite's entry: through the server, with the in-process engine alongside for reference."""
    if quick:
        result = measure(rounds=1, requests=4, tokens=8, http=True, engine_too=True, each_requests=2, dtype=dtype)
    else:
        result = measure(rounds=3, requests=16, tokens=64, http=True, engine_too=True, each_requests=4, dtype=dtype)
    n, t = result["requests"], result["new_tokens"]
    result["settings"] = {"requests": n, "new_tokens": t, "rounds": result["rounds"],
                          "hf_each_requests": result["hf_each_requests"], "dtype": dtype}
    checks = [
        {"name": f"sampling: {n} x {t} tokens through the server / HF generate per request",
         "ratio": result["ratio_vs_hf_each"], "target": 3.0, "op": ">="},
        {"name": f"sampling: {n} x {t} tokens through the server / HF generate batched",
         "ratio": result["ratio_vs_hf_batch"], "target": 1.0, "op": ">="},
    ]
    if "whitney" in result["tokens_per_s"]:
        checks.append({"name": "(info) sampling: engine in-process / HF generate batched",
                       "ratio": result["tokens_per_s"]["whitney"] / result["tokens_per_s"]["hf_batch"],
                       "target": None, "op": None})
    result["checks"] = checks
    return result


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--http", action="store_true", help="also sample through a `whitney serve` process")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.rounds, args.requests, args.tokens, http=args.http)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
