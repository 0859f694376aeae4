"""State checkpoints (bitwise resume, manifest, atomicity, refusals) and PEFT / merged exports."""

from __future__ import annotations

import json
import os

import pytest
import torch

from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.training import checkpoint as ckpt
from whitney.errors import Conflict, InvalidInput, NotFound

HP = {"learning_rate": 3e-2, "weight_decay": 0.1, "gradient_clip_norm": 1.0, "eps": 1e-8}

SEQS = [
    [1, 504, 2710, 88, 12, 9001, 33, 7],
    [1, 45, 45, 1200, 31000, 5, 6, 77, 408, 2],
    [1, 3000, 17],
    [1, 250, 251, 252, 253, 254, 255],
]


def _datum(seq: list[int], weight: float = 1.0) -> Datum:
    return Datum(token_ids=seq[:-1], loss_inputs={"target_tokens": seq[1:], "weights": [weight] * (len(seq) - 1)})


def _batch(step: int) -> list[Datum]:
    """A deterministic, step-dependent batch of two datums."""
    return [_datum(SEQS[step % len(SEQS)]), _datum(SEQS[(step + 1) % len(SEQS)], 0.5)]


def _train(engine: Engine, run_id: str, steps: range) -> list[dict]:
    out = []
    for s in steps:
        engine.forward_backward(run_id, _batch(s))
        out.append(engine.optim_step(run_id, HP))
    return out


def _snapshot(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.get_run(run_id).weights().items()}


def _assert_equal_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n}: max diff {(a[n] - b[n]).abs().max().item()}"


def _engine_logprobs(engine: Engine, run_id: str) -> list[torch.Tensor]:
    result = engine.forward(run_id, [_datum(s) for s in SEQS])
    return [torch.tensor(o.logprobs, dtype=torch.float64) for o in result.outputs]


def _hf_logprobs(model) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in SEQS:
            logits = model(torch.tensor([s[:-1]])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            out.append(lp[torch.arange(len(s) - 1), torch.tensor(s[1:])])
    return out


def _assert_logprobs_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], atol: float = 1e-5) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


_ids = iter(range(10**6))


def _rid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


# ---- bitwise resume ------------------------------------------------------------------------


def test_resume_with_optimizer_is_bitwise(engine, tiny_llama, tmp_path):
    cfg = LoraConfig(rank=4, seed=3, train_unembed=True)
    k, m = 3, 3
    a = _rid("A")
    engine.create_run(a, tiny_llama, cfg)
    _train(engine, a, range(k))
    manifest = engine.save_state(a, str(tmp_path / "ck"), include_optimizer=True)
    assert manifest["optimizer_step"] == k
    at_save = _snapshot(engine, a)
    _train(engine, a, range(k, k + m))
    final_a = _snapshot(engine, a)

    b = _rid("B")
    engine.create_run(b, tiny_llama, cfg)
    engine.load_state(b, str(tmp_path / "ck"), with_optimizer=True)
    _assert_equal_weights(_snapshot(engine, b), at_save)
    assert engine.get_run(b).optimizer.step == k
    _train(engine, b, range(k, k + m))
    assert engine.get_run(b).optimizer.step == k + m == engine.get_run(a).optimizer.step
    _assert_equal_weights(_snapshot(engine, b), final_a)
    # and training really moved the weights after the checkpoint
    assert any(not torch.equal(final_a[n], at_save[n]) for n in final_a)


def test_resume_without_optimizer_restores_weights_with_fresh_optimizer(engine, tiny_llama, tmp_path):
    cfg = LoraConfig(rank=4, seed=3, train_unembed=True)
    a = _rid("A")
    engine.create_run(a, tiny_llama, cfg)
    _train(engine, a, range(3))
    engine.save_state(a, str(tmp_path / "ck"))
    at_save = _snapshot(engine, a)
    _train(engine, a, range(3, 5))
    final_a = _snapshot(engine, a)

    b = _rid("B")
    engine.create_run(b, tiny_llama, LoraConfig(rank=4, seed=99, train_unembed=True))  # other init, same geometry
    _train(engine, b, range(7, 9))  # B has its own optimizer state, which the load must discard
    assert engine.get_run(b).optimizer.step == 2
    engine.forward_backward(b, _batch(0))  # pending gradients are cleared by the load
    engine.load_state(b, str(tmp_path / "ck"), with_optimizer=False)
    run_b = engine.get_run(b)
    _assert_equal_weights(_snapshot(engine, b), at_save)
    assert run_b.optimizer.step == 0 and run_b.optimizer.exp_avg == {} and run_b.optimizer.exp_avg_sq == {}
    assert all(torch.count_nonzero(g) == 0 for g in run_b.grads.values())
    _train(engine, b, range(3, 5))
    final_b = _snapshot(engine, b)
    diff = max(float((final_a[n] - final_b[n]).abs().max()) for n in final_a)
    assert diff > 1e-4, "fresh Adam moments should give a different trajectory"


def test_fresh_run_checkpoint_with_optimizer_roundtrips(engine, tiny_llama, tmp_path):
    """A run saved before any optim_step (step 0, no moments) loads with its optimizer and trains on."""
    cfg = LoraConfig(rank=2, seed=4, train_unembed=False)
    a, b = _rid("fresh"), _rid("fresh")
    engine.create_run(a, tiny_llama, cfg)
    assert engine.save_state(a, str(tmp_path / "ck"))["optimizer_step"] == 0
    engine.create_run(b, tiny_llama, cfg)
    _train(engine, b, range(1))
    engine.load_state(b, str(tmp_path / "ck"), with_optimizer=True)
    assert engine.get_run(b).optimizer.step == 0 and engine.get_run(b).optimizer.exp_avg == {}
    _assert_equal_weights(_snapshot(engine, b), _snapshot(engine, a))
    _train(engine, a, range(2))
    _train(engine, b, range(2))
    _assert_equal_weights(_snapshot(engine, b), _snapshot(engine, a))


# ---- manifest and atomicity ------------------------------------------------------------------


def test_manifest_contents(engine, tiny_llama, tmp_path):
    cfg = LoraConfig(rank=4, alpha=8.0, seed=5, train_unembed=False)
    r = _rid("man")
    engine.create_run(r, tiny_llama, cfg)
    _train(engine, r, range(2))
    path = tmp_path / "ck"
    manifest = engine.save_state(r, str(path), include_optimizer=True)
    on_disk = json.loads((path / ckpt.MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["format_version"] == ckpt.FORMAT_VERSION == 1
    assert manifest["base_model"] == tiny_llama
    assert manifest["lora"] == cfg.to_dict()
    assert LoraConfig.from_dict(manifest["lora"]) == cfg
    assert manifest["has_optimizer"] is True
    assert manifest["optimizer_step"] == 2
    assert set(manifest["sha256"]) == {"adapter.safetensors", "optimizer.safetensors"}
    assert manifest["sha256"]["adapter.safetensors"] == ckpt.sha256(path / "adapter.safetensors")
    assert sorted(os.listdir(path)) == sorted([ckpt.MANIFEST, "adapter.safetensors", "optimizer.safetensors"])

    weights_only = engine.save_state(r, str(tmp_path / "w"), include_optimizer=False)
    assert weights_only["has_optimizer"] is False and weights_only["optimizer_step"] is None
    assert set(weights_only["sha256"]) == {"adapter.safetensors"}
    assert not (tmp_path / "w" / "optimizer.safetensors").exists()
    assert ckpt.read_manifest(tmp_path / "w") == weights_only


def test_save_is_atomic_and_refuses_existing_path(engine, tiny_llama, tmp_path, monkeypatch):
    r = _rid("atom")
    engine.create_run(r, tiny_llama, LoraConfig(rank=2, seed=0, train_unembed=False))
    _train(engine, r, range(1))
    parent = tmp_path / "ckpts"
    engine.save_state(r, str(parent / "one"))
    assert os.listdir(parent) == ["one"]  # no leftover temporary directory

    before = {f: (parent / "one" / f).read_bytes() for f in os.listdir(parent / "one")}
    _train(engine, r, range(1, 2))
    with pytest.raises(Conflict):
        engine.save_state(r, str(parent / "one"))
    with pytest.raises(Conflict):
        engine.export_lora(r, str(parent / "one"))
    with pytest.raises(Conflict):
        engine.save_weights(r, str(parent / "one"), merge=True)
    assert {f: (parent / "one" / f).read_bytes() for f in os.listdir(parent / "one")} == before
    assert os.listdir(parent) == ["one"]

    # a failure while writing leaves neither the target nor a temporary directory behind
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        engine.save_state(r, str(parent / "two"))
    assert os.listdir(parent) == ["one"]


def test_load_missing_or_unsupported_checkpoint(engine, tiny_llama, tmp_path):
    r = _rid("miss")
    engine.create_run(r, tiny_llama, LoraConfig(rank=2, seed=0, train_unembed=False))
    with pytest.raises(NotFound):
        engine.load_state(r, str(tmp_path / "nope"))
    engine.save_state(r, str(tmp_path / "ck"))
    manifest = json.loads((tmp_path / "ck" / ckpt.MANIFEST).read_text())
    manifest["format_version"] = 999
    (tmp_path / "ck" / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InvalidInput, match="format"):
        engine.load_state(r, str(tmp_path / "ck"))


# ---- refusals leave the run unchanged -----------------------------------------------------------


@pytest.fixture(scope="module")
def saved(engine, tiny_llama, tmp_path_factory):
    """A trained llama run (rank 4, all modules incl. lm_head) saved with and without optimizer."""
    root = tmp_path_factory.mktemp("saved")
    r = _rid("src")
    engine.create_run(r, tiny_llama, LoraConfig(rank=4, seed=0, train_unembed=True))
    _train(engine, r, range(2))
    engine.save_state(r, str(root / "full"), include_optimizer=True)
    engine.save_state(r, str(root / "weights"), include_optimizer=False)
    return {"run": r, "full": root / "full", "weights": root / "weights", "weights_at_save": _snapshot(engine, r)}


def _trained_target(engine: Engine, base: str, cfg: LoraConfig) -> str:
    r = _rid("dst")
    engine.create_run(r, base, cfg)
    _train(engine, r, range(5, 6))
    return r


def _assert_refused(engine: Engine, run_id: str, path, with_optimizer: bool, match: str) -> None:
    run = engine.get_run(run_id)
    weights = _snapshot(engine, run_id)
    assert any(torch.count_nonzero(t) for n, t in weights.items() if n.endswith("lora_B"))
    step = run.optimizer.step
    moments = {n: t.clone() for n, t in run.optimizer.exp_avg.items()}
    with pytest.raises(InvalidInput, match=match) as e:
        engine.load_state(run_id, str(path), with_optimizer=with_optimizer)
    assert e.value.field == "path"
    _assert_equal_weights(_snapshot(engine, run_id), weights)
    assert run.optimizer.step == step
    _assert_equal_weights(run.optimizer.exp_avg, moments)


def test_corrupted_adapter_file_fails_checksum(engine, tiny_llama, saved, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved["full"], bad)
    data = bytearray((bad / "adapter.safetensors").read_bytes())
    data[-5] ^= 0x01  # flip one bit inside the tensor data (the header still parses)
    (bad / "adapter.safetensors").write_bytes(bytes(data))
    r = _trained_target(engine, tiny_llama, LoraConfig(rank=4, seed=0, train_unembed=True))
    _assert_refused(engine, r, bad, False, "checksum")
    _assert_refused(engine, r, bad, True, "checksum")
    # the intact copy still loads
    engine.load_state(r, str(saved["full"]), with_optimizer=True)
    _assert_equal_weights(_snapshot(engine, r), saved["weights_at_save"])


def test_corrupted_optimizer_file_fails_checksum(engine, tiny_llama, saved, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved["full"], bad)
    data = bytearray((bad / "optimizer.safetensors").read_bytes())
    data[-9] ^= 0x80
    (bad / "optimizer.safetensors").write_bytes(bytes(data))
    r = _trained_target(engine, tiny_llama, LoraConfig(rank=4, seed=0, train_unembed=True))
    _assert_refused(engine, r, bad, True, "checksum")


def test_load_refuses_different_base_model(engine, tiny_qwen3, saved):
    r = _trained_target(engine, tiny_qwen3, LoraConfig(rank=4, seed=0, train_unembed=True))
    _assert_refused(engine, r, saved["full"], False, "base model")
    _assert_refused(engine, r, saved["full"], True, "base model")


def test_load_refuses_different_rank(engine, tiny_llama, saved):
    r = _trained_target(engine, tiny_llama, LoraConfig(rank=8, seed=0, train_unembed=True))
    _assert_refused(engine, r, saved["full"], False, "rank")


def test_load_refuses_different_alpha(engine, tiny_llama, saved):
    r = _trained_target(engine, tiny_llama, LoraConfig(rank=4, alpha=64.0, seed=0, train_unembed=True))
    _assert_refused(engine, r, saved["full"], False, "alpha")


@pytest.mark.parametrize("cfg", [
    LoraConfig(rank=4, seed=0, train_unembed=False),  # subset of the saved modules
    LoraConfig(rank=4, seed=0, target_modules=("q_proj", "v_proj")),
    LoraConfig(rank=4, seed=0, train_attn=False, train_mlp=True, train_unembed=True),
], ids=["no-unembed", "q-v-only", "no-attn"])
def test_load_refuses_different_target_modules(engine, tiny_llama, saved, cfg):
    r = _trained_target(engine, tiny_llama, cfg)
    _assert_refused(engine, r, saved["full"], False, "modules")
    _assert_refused(engine, r, saved["full"], True, "modules")


def test_load_with_optimizer_refuses_weights_only_checkpoint(engine, tiny_llama, saved):
    r = _trained_target(engine, tiny_llama, LoraConfig(rank=4, seed=0, train_unembed=True))
    _assert_refused(engine, r, saved["weights"], True, "optimizer")
    # without the optimizer it loads
    engine.load_state(r, str(saved["weights"]))
    _assert_equal_weights(_snapshot(engine, r), saved["weights_at_save"])


# ---- compute_logprobs from a checkpoint ----------------------------------------------------------


def test_compute_logprobs_from_checkpoint_equals_run_at_save(engine, tiny_qwen3, tmp_path):
    r = _rid("clp")
    engine.create_run(r, tiny_qwen3, LoraConfig(rank=4, seed=1, train_unembed=True))
    _train(engine, r, range(3))
    at_save = _engine_logprobs(engine, r)
    engine.save_state(r, str(tmp_path / "ck"))
    _train(engine, r, range(3, 6))  # the run moves on; the checkpoint must not
    now = _engine_logprobs(engine, r)
    assert _max_diff(now, at_save) > 1e-3

    got = engine.compute_logprobs(SEQS, checkpoint_path=str(tmp_path / "ck"))
    assert [len(g) for g in got] == [len(s) for s in SEQS]
    assert all(g[0] is None for g in got)
    from_ckpt = [torch.tensor(g[1:], dtype=torch.float64) for g in got]
    _assert_logprobs_close(from_ckpt, at_save, atol=1e-6)
    base = engine.compute_logprobs(SEQS, base_model=tiny_qwen3)
    assert _max_diff([torch.tensor(g[1:], dtype=torch.float64) for g in base], at_save) > 1e-3


# ---- exports -----------------------------------------------------------------------------------


EXPORT_CONFIGS = {
    "unembed": LoraConfig(rank=4, seed=2, train_unembed=True),
    "no-unembed": LoraConfig(rank=4, alpha=8.0, seed=2, train_unembed=False),
    "targets": LoraConfig(rank=2, seed=2, target_modules=("q_proj", "v_proj", "down_proj", "lm_head")),
}


def _hf_base(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("cfg_name", list(EXPORT_CONFIGS))
def test_export_lora_loads_in_peft_with_equal_logprobs(engine, tiny_model, cfg_name, tmp_path):
    from peft import PeftModel

    cfg = EXPORT_CONFIGS[cfg_name]
    r = _rid("peft")
    engine.create_run(r, tiny_model, cfg)
    _train(engine, r, range(3))
    run = engine.get_run(r)
    assert all(torch.count_nonzero(b) for b in run.adapter.B.values())
    ours = _engine_logprobs(engine, r)
    out = tmp_path / "peft"
    engine.export_lora(r, str(out))
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.listdir(tmp_path) == ["peft"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == cfg.rank and config["lora_alpha"] == cfg.alpha
    assert config["base_model_name_or_path"] == os.path.basename(tiny_model)  # the model's name, no server path
    assert ("lm_head" in config["target_modules"]) == ("lm_head" in run.adapter.A)

    base = _hf_base(tiny_model)
    base_lp = _hf_logprobs(base)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    theirs = _hf_logprobs(model)
    _assert_logprobs_close(ours, theirs)
    assert _max_diff(ours, base_lp) > 1e-3  # the adapter matters, so equality is meaningful
    # every engine adapter weight was loaded into PEFT (none silently dropped)
    lora_modules = {n for n, _ in model.named_modules() if n.endswith(".lora_A.default")}
    assert len(lora_modules) == len(run.adapter.A)


@pytest.mark.parametrize("cfg_name", ["unembed", "no-unembed"])
def test_save_weights_merged_equals_engine(engine, tiny_model, cfg_name, tmp_path):
    from safetensors.torch import load_file

    cfg = EXPORT_CONFIGS[cfg_name]
    r = _rid("merge")
    engine.create_run(r, tiny_model, cfg)
    _train(engine, r, range(3))
    ours = _engine_logprobs(engine, r)
    out = tmp_path / "merged"
    engine.save_weights(r, str(out), merge=True)
    files = set(os.listdir(out))
    assert "config.json" in files
    assert any(f.endswith(".safetensors") for f in files)
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert os.listdir(tmp_path) == ["merged"]

    merged = _hf_base(str(out))
    _assert_logprobs_close(ours, _hf_logprobs(merged))
    base = _hf_base(tiny_model)
    assert _max_diff(ours, _hf_logprobs(base)) > 1e-3
    # the input embedding stays the base's even when the (tied) unembedding was adapted
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    lm_head_adapted = "lm_head" in engine.get_run(r).adapter.A
    assert torch.equal(merged.lm_head.weight, base.lm_head.weight) != lm_head_adapted
    if lm_head_adapted:
        assert merged.config.tie_word_embeddings is False
        tensors = {}
        for f in files:
            if f.endswith(".safetensors"):
                tensors |= load_file(out / f)
        assert "lm_head.weight" in tensors
    # the tokenizer round-trips
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("hello world")["input_ids"] == engine.get_run(r).base.tokenizer("hello world")["input_ids"]


def test_save_weights_unmerged_is_peft_adapter(engine, tiny_llama, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    r = _rid("unmerged")
    engine.create_run(r, tiny_llama, EXPORT_CONFIGS["unembed"])
    _train(engine, r, range(2))
    engine.save_weights(r, str(tmp_path / "a"), merge=False)
    engine.export_lora(r, str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path / "a")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (tmp_path / "a" / "adapter_config.json").read_text() == (tmp_path / "b" / "adapter_config.json").read_text()
    ta, tb = load_file(tmp_path / "a" / "adapter_model.safetensors"), load_file(tmp_path / "b" / "adapter_model.safetensors")
    _assert_equal_weights(ta, tb)
    run = engine.get_run(r)
    for name in run.adapter.A:
        assert torch.equal(ta[f"base_model.model.{name}.lora_A.weight"], run.adapter.A[name].detach())
        assert torch.equal(ta[f"base_model.model.{name}.lora_B.weight"], run.adapter.B[name].detach())
    model = PeftModel.from_pretrained(_hf_base(tiny_llama), str(tmp_path / "a")).eval()
    _assert_logprobs_close(_engine_logprobs(engine, r), _hf_logprobs(model))
