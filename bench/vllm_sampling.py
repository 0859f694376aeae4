"""vLLM sampler replicas against Whitney's own sampler, on SmolLM2-135M through `whitney serve` (float32).

One server without replicas (Whitney's continuous-batching sampler serves samples), then, each once the one before
has stopped, two with a vLLM replica (`--samplers 1 --sampler-engine vllm`: the CPU build in .venv-vllm, `make
vllm-env`): `vllm` as vLLM binds itself by default (one core kept for its scheduler process: one compute thread on
2 cores), `vllm_all_cores` computing on every core as Whitney does (ENGINES). On each, the same requests:

  waves     N chat prompts sent at once through POST /v1/samples (temperature 1, seed i, stop=[]: exactly
            new_tokens each), on the base weights and on 8 runs' sampler versions (rank 32, one SFT step each,
            seeds 0..7) round robin: generated tokens/s = all new tokens / (first submit -> last result).
            TTFT: the same N requests as streams (OpenAI /v1/completions on the prompt's token ids, the model
            "<run_id>@<version>" for a version), the time to the event of the first token; each stream is closed
            there (which cancels its sample), so TTFT is measured in a wave of its own.
  swap      submit save_weights_for_sampler (after an untimed SFT step) -> its result -> a max_tokens=1 sample
            of the new version -> its result, p50 over `saves`.
  logprobs  |sampled log-prob - compute_logprobs| (the trainer's, exact) on the sampled tokens, temperature 1,
            base and the versions.
  greedy    temperature 0 samples that equal Whitney's: LoRA, a run's version (on vLLM) against a save_state
            package saved at the same moment (Whitney's sampler always serves a state checkpoint); base, the
            vLLM server's against the Whitney server's.

    python -m bench --only vllm --no-report      (about 40 minutes on 2 cores: vLLM's CPU build is the slow part)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from bench.common import median, sft_batch, start_server
from bench.sampling import QUESTIONS

RANK, LR = 32, 2e-3  # LoRA rank of the runs, the learning rate of their SFT steps (B moves off zero visibly)
DTYPE = "float32"  # both engines, whatever the suite's --dtype: the log-prob agreement is a float32 figure
VLLM = ["--samplers", "1", "--sampler-engine", "vllm"]
# name -> (`whitney serve` flags, environment). vLLM's CPU build keeps one core of its own for its scheduler
# process by default (on 2 cores: one compute thread); vllm_all_cores computes on every core, as Whitney does.
ENGINES = {"whitney": ([], {}), "vllm": (VLLM, {}), "vllm_all_cores": (VLLM, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})}


@dataclass
class Wave:
    requests: int
    new_tokens: int
    rounds: int  # tokens/s: the median over rounds

    @property
    def key(self) -> str:
        return f"{self.requests}x{self.new_tokens}"


@dataclass
class Plan:
    waves: list[Wave]
    runs: int = 8
    saves: int = 5
    agree_samples: int = 8
    agree_tokens: int = 64


@dataclass
class Served:
    """A started server's client, the base model's OpenAI name, its prompts and the runs' versions."""

    client: object  # whitney.Client
    url: str
    base: str
    prompts: list[list[int]]
    versions: list[dict] = field(default_factory=list)  # {"run_id", "version"} each


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], check=True, capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    return {"model_name": name, "avx512_bf16": "avx512_bf16" in out}


def op(client, path: str, body: dict) -> dict:
    """POST an operation and wait for its result."""
    from whitney.client import OperationFuture

    return OperationFuture(client, client.request("POST", path, json=body)).result()


def sample_body(prompt: list[int], weights: dict, tokens: int, seed: int | None, temperature: float = 1.0) -> dict:
    return {"prompt": prompt, **weights, "max_tokens": tokens, "temperature": temperature, "seed": seed, "stop": []}


def sample_all(s: Served, bodies: list[dict]) -> list[dict]:
    """Submit every request at once, then await each: the sequences in order."""
    from whitney.client import OperationFuture

    futures = [OperationFuture(s.client, s.client.request("POST", "/v1/samples", json=b)) for b in bodies]
    return [f.result()["sequences"][0] for f in futures]


def train_step(run, seed: int) -> None:
    run.forward_backward(sft_batch(2, 64, seed=seed)).result()
    run.optim_step(learning_rate=LR).result()


def wave_weights(s: Served, kind: str) -> list[dict]:
    return [{}] if kind == "base" else s.versions


def model_name(s: Served, weights: dict) -> str:
    return f"{weights['run_id']}@{weights['version']}" if weights else s.base


def tokens_per_s(s: Served, wave: Wave, kind: str) -> float:
    ws = wave_weights(s, kind)
    bodies = [sample_body(s.prompts[i % len(s.prompts)], ws[i % len(ws)], wave.new_tokens, seed=i)
              for i in range(wave.requests)]
    t = time.perf_counter()
    made = sum(len(seq["tokens"]) for seq in sample_all(s, bodies))
    assert made == wave.requests * wave.new_tokens, f"{made} tokens made, not {wave.requests} x {wave.new_tokens}"
    return made / (time.perf_counter() - t)


def first_token_s(url: str, body: dict) -> float:
    """Open a completion stream; the seconds to the event that carries its first token (then it is closed)."""
    t = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as response:
        if response.status_code != 200:
            raise RuntimeError(f"completion stream answered {response.status_code}: {response.read()[:300]}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"completion stream failed: {chunk['error']}")
                if any((c.get("logprobs") or {}).get("tokens") for c in chunk.get("choices", ())):
                    return time.perf_counter() - t
    raise RuntimeError("the completion stream ended before its first token")


def ttft_s(s: Served, wave: Wave, kind: str) -> list[float]:
    ws = wave_weights(s, kind)
    bodies = [{"model": model_name(s, ws[i % len(ws)]), "prompt": s.prompts[i % len(s.prompts)],
               "max_tokens": wave.new_tokens, "temperature": 1.0, "seed": i, "stream": True, "logprobs": 0}
              for i in range(wave.requests)]
    with ThreadPoolExecutor(wave.requests) as pool:
        return list(pool.map(lambda b: first_token_s(s.url, b), bodies))


def swap_s(s: Served, run, saves: int) -> dict:
    """submit save_weights_for_sampler -> a max_tokens=1 sample of the new version, after an untimed step."""
    total, save = [], []
    for k in range(saves):
        train_step(run, seed=100 + k)
        t = time.perf_counter()
        version = run.save_weights_for_sampler().result()["version"]
        save.append(time.perf_counter() - t)
        op(s.client, "/v1/samples", sample_body(s.prompts[k % len(s.prompts)], {"run_id": run.id, "version": version},
                                                1, seed=k))
        total.append(time.perf_counter() - t)
    return {"p50_s": median(total), "save_p50_s": median(save), "raw_s": total, "save_raw_s": save}


def logprob_gaps(s: Served, kind: str, plan: Plan) -> dict:
    ws = wave_weights(s, kind)
    weights = [ws[i % len(ws)] for i in range(plan.agree_samples)]
    prompts = [s.prompts[i % len(s.prompts)] for i in range(plan.agree_samples)]
    seqs = sample_all(s, [sample_body(p, w, plan.agree_tokens, seed=1000 + i)
                          for i, (p, w) in enumerate(zip(prompts, weights))])
    gaps = []
    for p, w, seq in zip(prompts, weights, seqs):
        scored = op(s.client, "/v1/logprobs", {"sequences": [p + seq["tokens"]], **w})["logprobs"][0][len(p):]
        gaps += [abs(a - b) for a, b in zip(seq["logprobs"], scored, strict=True)]
    return {"max": max(gaps), "mean": sum(gaps) / len(gaps), "tokens": len(gaps)}


def greedy(s: Served, weights: dict, plan: Plan) -> list[list[int]]:
    bodies = [sample_body(s.prompts[i % len(s.prompts)], weights, plan.agree_tokens, None, temperature=0.0)
              for i in range(plan.agree_samples)]
    return [seq["tokens"] for seq in sample_all(s, bodies)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """The fraction of equal samples, and the mean fraction of tokens before the first difference."""
    prefix = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v))) / max(len(u), 1)
              for u, v in zip(a, b)]
    return {"equal": sum(u == v for u, v in zip(a, b)) / len(a), "mean_prefix": sum(prefix) / len(prefix)}


def measure(engine: str, plan: Plan, dtype: str) -> dict:
    import whitney

    flags, env = ENGINES[engine]
    t = time.perf_counter()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server's environment, and so its vLLM replica's
    try:
        server = start_server("--dtype", dtype, "--max-lora-rank", str(RANK), *flags, timeout=900)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    out: dict = {"start_s": time.perf_counter() - t, "waves": {}}
    client = whitney.Client(server.url, timeout=900)
    try:
        base = client.request("GET", "/v1/models")["data"][0]["id"]
        prompts = [client.request("POST", "/v1/chat/render", json={
            "messages": [{"role": "user", "content": q}], "add_generation_prompt": True})["tokens"] for q in QUESTIONS]
        s = Served(client, server.url, base, prompts)
        session = client.create_session()
        runs = [session.create_run(rank=RANK, alpha=RANK, seed=i) for i in range(plan.runs)]
        for i, run in enumerate(runs):
            train_step(run, seed=i)
            s.versions.append({"run_id": run.id, "version": run.save_weights_for_sampler().result()["version"]})
        for kind in ("base", "lora"):  # warm-up: every adapter loaded, every path taken once
            sample_all(s, [sample_body(prompts[0], w, 4, seed=0) for w in wave_weights(s, kind)])
            ttft_s(s, Wave(2, 4, 1), kind)
        for wave in plan.waves:
            for kind in ("base", "lora"):
                rates = []
                for r in range(wave.rounds):
                    rates.append(tokens_per_s(s, wave, kind))
                    print(f"  vllm {engine} {wave.key} {kind} round {r}: {rates[-1]:.1f} tokens/s", flush=True)
                firsts = ttft_s(s, wave, kind)
                print(f"  vllm {engine} {wave.key} {kind}: TTFT p50 {median(firsts):.3f} s", flush=True)
                out["waves"].setdefault(wave.key, {})[kind] = {
                    "tokens_per_s": median(rates), "raw_tokens_per_s": rates, "ttft_p50_s": median(firsts),
                    "ttft_max_s": max(firsts), "ttft_s": firsts}
        out["swap"] = swap_s(s, runs[0], plan.saves)
        print(f"  vllm {engine} save -> first token p50 {out['swap']['p50_s']:.3f} s", flush=True)
        out["logprob_gap"] = {kind: logprob_gaps(s, kind, plan) for kind in ("base", "lora")}
        print(f"  vllm {engine} log-prob gaps {out['logprob_gap']}", flush=True)
        train_step(runs[1], seed=200)  # a version and a state checkpoint of the same weights
        state = runs[1].save_state(name="greedy").result()["package"]["id"]
        version = runs[1].save_weights_for_sampler().result()["version"]
        out["greedy_base_tokens"] = greedy(s, {}, plan)
        out["greedy_lora"] = agreement(greedy(s, {"run_id": runs[1].id, "version": version}, plan),
                                       greedy(s, {"checkpoint_id": state}, plan))
        print(f"  vllm {engine} greedy LoRA version vs its state checkpoint {out['greedy_lora']}", flush=True)
    finally:
        client.close()
        server.stop()
    return out


def info(name: str, ratio: float) -> dict:
    return {"name": f"(info) {name}", "ratio": ratio, "target": None, "op": None}


def run(quick: bool = False, dtype: str = DTYPE) -> dict:
    dtype = DTYPE  # the suite's default on a CPU with AVX-512 BF16 is bfloat16; this comparison is float32's
    plan = Plan([Wave(4, 8, 1)], runs=2, saves=2, agree_samples=2, agree_tokens=8) if quick else \
        Plan([Wave(16, 64, 3), Wave(64, 256, 1)])
    result = {"benchmark": "vllm", "dtype": dtype, "lscpu": lscpu(), "settings": {
        "waves": ", ".join(w.key for w in plan.waves), "rounds": ", ".join(str(w.rounds) for w in plan.waves),
        "runs": plan.runs, "rank": RANK, "saves": plan.saves,
        "agreement": f"{plan.agree_samples}x{plan.agree_tokens}", "dtype": dtype}, "plan": asdict(plan)}
    print(f"  vllm: {dtype} on every server (not the suite's --dtype)", flush=True)
    for engine in ENGINES:
        result[engine] = measure(engine, plan, dtype)
    w, checks = result["whitney"], []
    for name in ENGINES:
        if name == "whitney":
            continue
        v = result[name]
        v["greedy_base"] = agreement(v["greedy_base_tokens"], w["greedy_base_tokens"])
        for wave in plan.waves:
            for kind in ("base", "lora"):
                a, b = w["waves"][wave.key][kind], v["waves"][wave.key][kind]
                label = f"{wave.requests} x {wave.new_tokens}, " + ("base" if kind == "base" else
                                                                   f"{plan.runs} LoRA versions")
                checks += [info(f"{name}: sampling tokens/s {label}, vLLM / Whitney",
                                b["tokens_per_s"] / a["tokens_per_s"]),
                           info(f"{name}: TTFT p50 {label}, vLLM / Whitney", b["ttft_p50_s"] / a["ttft_p50_s"])]
        checks.append(info(f"{name}: save_weights_for_sampler -> first token p50, vLLM / Whitney",
                           v["swap"]["p50_s"] / w["swap"]["p50_s"]))
    result["checks"] = checks
    return result
