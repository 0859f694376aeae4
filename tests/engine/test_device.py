"""Devices: every tensor of the engine is made on its device, never on torch's default one.

On the CPU (every run): the engine's main paths run with torch's default device set to "meta", where
a tensor made without an explicit device cannot compute or be read, and must give exactly the numbers
of a normal run. On CUDA (marker `cuda`, `make gpu-check`): the same paths equal the CPU's, checkpoints
move between devices, and the CPU-only tricks stay off.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from tests.engine.test_opsd import rows_for_engine, to_datum
from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.families import model as model_module
from whitney.engine.families.model import load_base_model, resolve_compute_dtype, resolve_device
from whitney.errors import InvalidInput
from whitney.protocol.sampling import SamplingParams

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (make gpu-check)")


# ---- resolving the device ------------------------------------------------------------------------


def test_device_names_resolve_and_bad_ones_are_refused():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA
                                      else torch.device("cpu"))
    for bad in ("tpu", "gpu", "cuda:x", ""):
        with pytest.raises(InvalidInput, match="device") as e:
            resolve_device(bad)
        assert e.value.field == "device"
    if not HAS_CUDA:
        with pytest.raises(InvalidInput, match="no CUDA device"):
            Engine(device="cuda:0")
    assert resolve_compute_dtype("auto", torch.device("cpu")) == torch.float32  # the CPU's exact path
    assert resolve_compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    engine = Engine(device="cpu")
    assert engine.device == torch.device("cpu") and engine.compute_dtype_name == "float32"


@pytest.mark.parametrize("in_hardware", [True, False])
def test_bfloat16_on_a_cpu_without_bfloat16_matmuls_is_warned_of(in_hardware, monkeypatch, caplog):
    """Without AVX-512 BF16 or AMX torch emulates bfloat16 GEMM (about 100x slower than float32): said once,
    when the engine's dtype is resolved; on the GPU, or with the instructions, nothing is said."""
    monkeypatch.setattr(model_module, "cpu_bf16_matmul", lambda: in_hardware)
    with caplog.at_level("WARNING", logger="whitney.engine.families.model"):
        assert resolve_compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
        assert resolve_compute_dtype("bfloat16", torch.device("cuda", 0)) == torch.bfloat16
        assert resolve_compute_dtype("float32", torch.device("cpu")) == torch.float32
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (0 if in_hardware else 1) and all("AVX-512 BF16" in w for w in warned)


def test_cli_device_flag_reaches_the_engine_config():
    from whitney.cli import add_engine_flags, engine_config

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).device == "auto"
    config = engine_config(parser.parse_args(["--device", "cuda:1", "--dtype", "float32"]))
    assert (config.device, config.compute_dtype) == ("cuda:1", "float32")


def test_model_info_reports_the_resolved_device(tiny_llama):
    from whitney.backends.in_process import InProcessBackend
    from whitney.protocol.config import EngineConfig

    backend = InProcessBackend.start(EngineConfig(device="cpu"), [tiny_llama])
    info = backend.models[tiny_llama]
    assert (info.device, info.compute_dtype) == ("cpu", "float32")


# ---- the engine's main paths, as plain numbers ---------------------------------------------------


def _ce(tokens: list[int]) -> Datum:
    return Datum(tokens[:-1], {"target_tokens": tokens[1:]})


def main_paths(engine: Engine, model: str, path) -> dict:
    """Every main path of the engine on `model`; every number it returns and every weight and moment it
    leaves, as Python values. Inputs are plain lists (no torch calls here outside the engine)."""
    seqs = [[(37 * i + 11 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate((9, 5, 12))]
    out: dict = {}

    def weights(run_id: str) -> dict:
        run = engine.runs[run_id]
        return {"w": {k: v.tolist() for k, v in run.adapter.named_parameters()},
                "m": {k: v.tolist() for k, v in run.optimizer.exp_avg.items()},
                "v": {k: v.tolist() for k, v in run.optimizer.exp_avg_sq.items()}}

    def result(r) -> tuple:
        return r.loss, r.metrics, [(o.logprobs, o.elementwise_loss) for o in r.outputs]

    engine.create_run("a", model, LoraConfig(rank=4, alpha=8.0, seed=1))
    engine.create_run("b", model, LoraConfig(rank=2, alpha=2.0, seed=2, train_mlp=False))
    out["fb_ce"] = result(engine.forward_backward("a", [_ce(s) for s in seqs]))
    out["fb_soft"] = result(engine.forward_backward("a", [Datum(seqs[0][:-1], {
        "target_tokens": [[t, (t * 7) % 4000] for t in seqs[0][1:]],
        "weights": [[0.75, 0.25]] * (len(seqs[0]) - 1)})]))
    out["step_a1"] = engine.optim_step("a", {"learning_rate": 1e-2, "gradient_clip_norm": 0.5, "weight_decay": 0.1})
    old = [[-3.0 - 0.1 * j for j in range(len(s) - 1)] for s in seqs]
    ppo = [Datum(s[:-1], {"target_tokens": s[1:], "old_logprobs": o,
                          "advantages": [1.0 if j % 2 else -0.5 for j in range(len(s) - 1)]})
           for s, o in zip(seqs, old)]
    out["fb_ppo"] = result(engine.forward_backward("a", ppo, "ppo", {"clip_low": 0.1}))
    out["fb_opsd"] = result(engine.forward_backward("b", [to_datum(r) for r in rows_for_engine()], "opsd"))
    out["step_a2"] = engine.optim_step("a", {"learning_rate": 1e-2, "lora_plus_ratio": 4.0})
    out["step_b1"] = engine.optim_step("b", {"learning_rate": 1e-2})
    # A mixed batch (two runs and the base model), and a micro-batched operation staged then committed.
    from whitney.engine import ForwardRequest

    batch = engine.run_batch([ForwardRequest("a", [_ce(seqs[0])]), ForwardRequest(None, [_ce(seqs[1])],
                              base_model=model), ForwardRequest("b", [_ce(seqs[2])])], backward=False)
    out["batch"] = [result(r) for r in batch]
    engine.run_batch([ForwardRequest("b", [_ce(seqs[0])], stage="op1")], backward=True)
    engine.run_batch([ForwardRequest("b", [_ce(seqs[1])], stage="op1")], backward=True)
    engine.commit_gradients("b", "op1")
    out["step_b2"] = engine.optim_step("b", {"learning_rate": 1e-2})
    # Sampler versions: log-probs and sampling (seeded, greedy, several samples, prompt log-probs).
    version = engine.save_weights_for_sampler("a")
    out["logprobs_v"] = engine.compute_logprobs(seqs, run_id="a", version=version)
    out["logprobs_base"] = engine.compute_logprobs(seqs, base_model=model)
    for name, params, weights_of in (
            ("seeded", SamplingParams(max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=5, num_samples=3,
                                      stop=(), prompt_logprobs=True, topk_prompt_logprobs=3), {"run_id": "a"}),
            ("greedy", SamplingParams(max_tokens=5, temperature=0.0, stop=()), {"run_id": "a"}),
            ("base", SamplingParams(max_tokens=4, seed=9, stop=()), {"base_model": model})):
        if "run_id" in weights_of:
            weights_of = {**weights_of, "version": version}
        r = engine.sample(seqs[0], params, **weights_of)
        out[f"sample_{name}"] = ([(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences], r.prompt_logprobs,
                                 r.topk_prompt_logprobs)
    # Concurrent requests of two adapters and the base model in one decode batch.
    version_b = engine.save_weights_for_sampler("b")
    requests = [engine.submit_sample(s, SamplingParams(max_tokens=4, seed=i, stop=()), run_id="a", version=version)
                for i, s in enumerate(seqs)]
    requests.append(engine.submit_sample(seqs[2], SamplingParams(max_tokens=5, seed=8, temperature=0.7, stop=()),
                                         run_id="b", version=version_b))
    requests.append(engine.submit_sample(seqs[1], SamplingParams(max_tokens=3, seed=7, stop=()), base_model=model))
    while engine.sample_step():
        pass
    out["sample_batch"] = [[(s.tokens, s.logprobs) for s in r.result.sequences] for r in requests]
    # Checkpoints: save with the optimizer, load into a fresh run, train on; score the checkpoint.
    engine.save_state("a", str(path / "state"))
    engine.create_run("c", model, LoraConfig(rank=4, alpha=8.0, seed=99))
    engine.load_state("c", str(path / "state"), with_optimizer=True)
    out["c_loaded"] = weights("c")
    out["fb_c"] = result(engine.forward_backward("c", [_ce(seqs[1])]))
    out["step_c"] = engine.optim_step("c", {"learning_rate": 1e-2})
    out["logprobs_ckpt"] = engine.compute_logprobs(seqs, checkpoint_path=str(path / "state"))
    engine.export_lora("a", str(path / "peft"))
    out["a"], out["b"], out["c"] = weights("a"), weights("b"), weights("c")
    return out


def _engine(bases: dict, device: str = "cpu", dtype: str = "float32") -> Engine:
    engine = Engine(device=device, compute_dtype=dtype)
    engine.models.update(bases)
    return engine


@pytest.fixture(scope="module")
def cpu_bases(tiny_llama, tiny_qwen3):
    return {p: load_base_model(p, torch.float32, "cpu") for p in (tiny_llama, tiny_qwen3)}


def test_no_tensor_is_made_on_the_default_device(cpu_bases, tiny_model, tmp_path):
    """With torch's default device "meta", a tensor made anywhere without an explicit device is a meta
    tensor: mixing it with a CPU tensor raises and reading it (.tolist(), float()) raises. So equal
    numbers mean every tensor of these paths was made on the engine's device (or on the CPU on purpose)."""
    want = main_paths(_engine(cpu_bases), tiny_model, tmp_path / "normal")
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        assert torch.empty(1).device.type == "meta", "the check would be vacuous"
        got = main_paths(_engine(cpu_bases), tiny_model, tmp_path / "meta")
    finally:
        torch.set_default_device(before)
    assert torch.empty(1).device == before
    assert got == want, "an engine path differs when torch's default device is not the CPU"
    assert want["fb_ce"][0] > 0 and len(want["sample_seeded"][0]) == 3  # not vacuous


# ---- CUDA: `make gpu-check` ----------------------------------------------------------------------


def _close(got, want, path: str = "", rel: float = 1e-4, atol: float = 1e-4) -> None:
    """Nested results equal up to float tolerance (ints, strings and tokens exactly)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _close(got[k], want[k], f"{path}.{k}", rel, atol)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{path}[{i}]", rel, atol)
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=rel, abs_tol=atol), f"{path}: {got} vs {want}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"


@pytest.fixture(scope="module")
def cuda_bases(tiny_llama, tiny_qwen3):
    return {p: load_base_model(p, torch.float32, "cuda") for p in (tiny_llama, tiny_qwen3)}


@cuda
@pytest.mark.cuda
def test_cuda_float32_equals_the_cpu(cpu_bases, cuda_bases, tiny_model, tmp_path):
    """float32 on CUDA (no TF32) gives the CPU's numbers to float tolerance, greedy tokens exactly."""
    assert not torch.backends.cuda.matmul.allow_tf32
    want = main_paths(_engine(cpu_bases), tiny_model, tmp_path / "cpu")
    engine = _engine(cuda_bases, "cuda")
    got = main_paths(engine, tiny_model, tmp_path / "cuda")
    run = engine.runs["a"]
    assert all(t.device.type == "cuda" for t in [*run.adapter.parameters(), *run.optimizer.exp_avg.values()])
    assert engine.runs["c"].optimizer.exp_avg and all(
        t.device.type == "cuda" for t in engine.runs["c"].optimizer.exp_avg.values()), "loaded moments on CUDA"
    _close(got["sample_greedy"][0], want["sample_greedy"][0], "greedy", rel=1e-3, atol=1e-3)
    for key in ("fb_ce", "fb_soft", "fb_ppo", "fb_opsd", "batch", "logprobs_v", "logprobs_base", "logprobs_ckpt",
                "fb_c", "step_a1", "step_a2", "step_b1", "step_b2", "step_c"):
        _close(got[key], want[key], key, rel=1e-3, atol=1e-4)
    # Weights and moments as vectors: AdamW's first steps are about sign(g), so an element whose gradient
    # is zero up to rounding may step either way on either device; the whole vector stays close.
    for key in ("a", "b", "c", "c_loaded"):
        for kind in ("w", "m", "v"):
            for name in want[key][kind]:
                g, w = torch.tensor(got[key][kind][name]), torch.tensor(want[key][kind][name])
                assert float((g - w).norm()) <= 1e-3 * float(w.norm()) + 1e-7, f"{key}.{kind}.{name}"


@cuda
@pytest.mark.cuda
def test_cuda_forward_matches_hf(cuda_bases, tiny_model):
    from transformers import AutoModelForCausalLM

    from whitney.engine.families.lora import RowGroups

    base = cuda_bases[tiny_model]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rows = [[(13 * i + 7 * j) % 4000 + 3 for j in range(n)] for i, n in enumerate((11, 6))]
    for r in rows:
        with torch.no_grad():
            tokens = torch.tensor([r], device="cuda")
            ours = base.unembed(base.forward_hidden(tokens, RowGroups([(0, 1, None)]))[0],
                           RowGroups([(0, len(r), None)]))
            ref = hf(input_ids=torch.tensor([r])).logits[0]
        torch.testing.assert_close(ours.cpu(), ref, atol=1e-4, rtol=0)


@cuda
@pytest.mark.cuda
def test_cuda_defaults_to_bfloat16_without_cpu_tricks(tiny_llama, cpu_bases, tmp_path):
    from whitney.backends.in_process import InProcessBackend
    from whitney.engine.families.decoder import prepacked
    from whitney.engine.families.transformer import attention_dtype
    from whitney.engine.losses.unembedding import _packed_lm_head
    from whitney.protocol.config import EngineConfig

    backend = InProcessBackend.start(EngineConfig(device="cuda"), [tiny_llama])
    info = backend.models[tiny_llama]
    assert info.device.startswith("cuda:") and info.compute_dtype == "bfloat16"
    engine = backend.engine
    base = engine.models[tiny_llama]
    assert base.embed.device.type == "cuda" and base.embed.dtype == torch.bfloat16
    with torch.no_grad():
        assert prepacked(base) is None, "oneDNN prepacking is a CPU-only trick"
        assert _packed_lm_head(base) == (None, None), "so is the unembedding's"
    assert attention_dtype(base) == torch.bfloat16, "float32 attention is a CPU-only trick"
    # bfloat16 on CUDA stays near float32 on the CPU; a CUDA checkpoint loads on the CPU.
    seqs = [[(31 * j) % 4000 + 5 for j in range(16)]]
    cpu = _engine(cpu_bases)
    for e in (engine, cpu):
        e.create_run("r", tiny_llama, LoraConfig(rank=4, seed=1))
    got = engine.forward_backward("r", [_ce(s) for s in seqs]).loss
    want = cpu.forward_backward("r", [_ce(s) for s in seqs]).loss
    assert abs(got - want) <= 2e-2 * abs(want)
    engine.optim_step("r", {"learning_rate": 1e-2})
    engine.save_state("r", str(tmp_path / "s"))
    cpu.load_state("r", str(tmp_path / "s"), with_optimizer=True)
    for name, t in engine.runs["r"].adapter.named_parameters():
        assert torch.equal(t.detach().cpu(), dict(cpu.runs["r"].adapter.named_parameters())[name].detach())
    assert all(t.device.type == "cpu" for t in cpu.runs["r"].optimizer.exp_avg.values())
    result = engine.sample(seqs[0], SamplingParams(max_tokens=8, seed=3, stop=()), base_model=tiny_llama)
    assert len(result.sequences[0].tokens) == 8
