"""How far vLLM replicas' sampled log-probs are from the trainer's, per model and dtype (issue 32's honest numbers).

For each model (the tiny test Llama with heads of 32, which vLLM's CPU attention takes, and the embedded
SmolLM2-135M) and each compute dtype (float32, bfloat16): one server with a vLLM replica (`--samplers 1
--sampler-engine vllm`, vLLM in the same dtype), a run trained one step and saved as a version, then
  gap     |sampled log-prob - compute_logprobs| (the trainer's) on 8 samples x 64 tokens at temperature 1, on the
          base and on the version: max and mean; the same for Whitney's own sampler (the same requests with
          target_prompt_logprobs, which it serves), the baseline in that dtype;
  greedy  the fraction of 8 greedy samples of 32 tokens (8 prompts) equal to Whitney's own sampler's on the same
          weights (the same request with target_prompt_logprobs, which Whitney's sampler serves), and their
          mean equal prefix.

    .venv/bin/python -m bench.vllm_logprobs        (about 8 minutes on 2 cores; writes bench/results/vllm_logprobs.json)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.common import start_server
from bench.vllm_sampling import op
from whitney import Client
from whitney.datums import sft_datum
from whitney.protocol.config import DEFAULT_MODEL

SAMPLES, TOKENS, GREEDY_TOKENS = 8, 64, 32
PROMPTS = [[1, 523, 1077, 2889, 30, 905 + 7 * i] for i in range(SAMPLES)]


def measure(model: str, dtype: str) -> dict:
    server = start_server("--dtype", dtype, "--max-lora-rank", "16", "--samplers", "1", "--sampler-engine", "vllm",
                          model=model, timeout=900)
    try:
        client = Client(server.url, timeout=600)
        run = client.create_session().create_run(rank=16, alpha=32.0, seed=1)
        run.forward_backward([sft_datum(p[:4], p[4:] + [2]) for p in PROMPTS]).result()
        run.optim_step(learning_rate=2e-3).result()
        version = run.save_weights_for_sampler().result()["version"]
        out = {}
        for kind, weights in (("base", {}), ("lora", {"run_id": run.id, "version": version})):
            gaps, whitney_gaps = [], []
            for i, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, **weights, "max_tokens": TOKENS, "seed": i, "stop": []}
                for sampler, into in (({}, gaps), ({"target_prompt_logprobs": [[0]] * (len(prompt) - 1)},
                                                   whitney_gaps)):  # vLLM's, then Whitney's own sampler's
                    seq = op(client, "/v1/samples", {**body, **sampler})["sequences"][0]
                    exact = op(client, "/v1/logprobs", {"sequences": [prompt + seq["tokens"]], **weights})
                    into += [abs(a - b) for a, b in zip(seq["logprobs"], exact["logprobs"][0][len(prompt):])]
            equal, prefix = 0, 0.0
            for prompt in PROMPTS:
                body = {"prompt": prompt, **weights, "max_tokens": GREEDY_TOKENS, "temperature": 0.0, "stop": []}
                ours = op(client, "/v1/samples", body)["sequences"][0]["tokens"]
                theirs = op(client, "/v1/samples", {**body, "target_prompt_logprobs": [[0]] * (len(prompt) - 1)}
                              )["sequences"][0]["tokens"]
                equal += ours == theirs
                prefix += next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours)) / len(ours)
            out[kind] = {"max_gap": max(gaps), "mean_gap": sum(gaps) / len(gaps), "greedy_equal": equal / SAMPLES,
                         "greedy_equal_prefix": prefix / SAMPLES, "whitney_max_gap": max(whitney_gaps),
                         "whitney_mean_gap": sum(whitney_gaps) / len(whitney_gaps)}
        return out
    finally:
        server.stop()


def main() -> None:
    from tests.models import VLLM_HEADS, make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="whitney-vllm-logprobs-"))
    tiny = str(make_tiny_model(work / "tiny-llama-head32", "llama", **VLLM_HEADS))
    results = {}
    for name, model in (("tiny Llama (heads of 32)", tiny), ("SmolLM2-135M", DEFAULT_MODEL)):
        for dtype in ("float32", "bfloat16"):
            results[f"{name}, {dtype}"] = row = measure(model, dtype)
            print(f"{name}, {dtype}: {json.dumps(row)}", flush=True)
    out = Path(__file__).parent / "results" / "vllm_logprobs.json"
    out.write_text(json.dumps({"samples": SAMPLES, "tokens": TOKENS, "greedy_tokens": GREEDY_TOKENS,
                               "results": results}, indent=2))
    print("| model, dtype | weights | vLLM: max gap | mean gap | Whitney's sampler: max gap | mean gap "
          "| vLLM greedy equal to Whitney's (mean equal prefix) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, rows in results.items():
        for kind, r in rows.items():
            print(f"| {key} | {kind} | {r['max_gap']:.2e} | {r['mean_gap']:.2e} | {r['whitney_max_gap']:.2e} "
                  f"| {r['whitney_mean_gap']:.2e} | {r['greedy_equal']:.2f} ({r['greedy_equal_prefix']:.2f}) |")


if __name__ == "__main__":
    main()
