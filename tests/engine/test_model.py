"""Base-model loading and our own decoder forward, checked against Hugging Face transformers."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.families.lora import RowGroups, init_adapter
from whitney.engine.families.model import load_base_model
from whitney.errors import NotFound

ATOL = 1e-5


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _our_logits(base, tokens: torch.Tensor, adapter=None) -> torch.Tensor:
    """Logits [B, T, V] of right-padded tokens [B, T] through forward_hidden + unembed."""
    B, T = tokens.shape
    with torch.no_grad():
        hidden = base.forward_hidden(tokens, RowGroups([(0, B, adapter)]))  # [B, T, D]
        logits = base.unembed(hidden.reshape(B * T, -1), RowGroups([(0, B * T, adapter)]))
    return logits.reshape(B, T, -1)


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    T = max(len(r) for r in rows)
    out = torch.full((len(rows), T), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def _rows(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (11, 6, 1)]


def test_forward_matches_hf_unpadded_and_padded(tiny_model):
    base = load_base_model(tiny_model)
    hf = _hf(tiny_model)
    rows = _rows(base.config.vocab_size)
    # Two paddings with different pad ids: real positions must not depend on them.
    ours_a = _our_logits(base, _padded(rows, pad=0))
    ours_b = _our_logits(base, _padded(rows, pad=base.config.vocab_size - 1))
    with torch.no_grad():
        hf_padded = hf(input_ids=_padded(rows, pad=0)).logits
        assert ours_a.shape == hf_padded.shape
        # Causal attention, no mask: the whole padded batch matches too.
        torch.testing.assert_close(ours_a, hf_padded, atol=ATOL, rtol=0)
        for i, r in enumerate(rows):
            ref = hf(input_ids=torch.tensor([r])).logits[0]  # [len, V], the row alone
            n = len(r)
            torch.testing.assert_close(ours_a[i, :n], ref, atol=ATOL, rtol=0)
            torch.testing.assert_close(ours_b[i, :n], ref, atol=ATOL, rtol=0)
    # Not vacuous: logits are far from uniform and rows differ.
    assert float(ours_a.std()) > 0.1
    assert not torch.allclose(ours_a[0, 0], ours_a[1, 0])


def test_lora_forward_matches_hf_with_merged_delta(tiny_model):
    """A non-zero adapter on every module equals HF with W + scale * B @ A merged in."""
    base = load_base_model(tiny_model)
    adapter = init_adapter(base, LoraConfig(rank=3, alpha=6.0, seed=5))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    hf = _hf(tiny_model)
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for path in adapter.names():
            delta = adapter.scale * adapter.B[path] @ adapter.A[path]
            mod = modules[path]
            # A fresh Parameter unties lm_head from the embedding (Llama), as our unembed-only LoRA does.
            mod.weight = torch.nn.Parameter(mod.weight.detach().clone() + delta)
    rows = _rows(base.config.vocab_size)
    ours = _our_logits(base, _padded(rows, pad=0), adapter)
    plain = _our_logits(base, _padded(rows, pad=0), None)
    with torch.no_grad():
        for i, r in enumerate(rows):
            ref = hf(input_ids=torch.tensor([r])).logits[0]
            torch.testing.assert_close(ours[i, : len(r)], ref, atol=ATOL, rtol=0)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does change the output


def test_load_nonexistent_model_is_not_found(tmp_path):
    for name in (str(tmp_path / "no-such-dir"), "nobody-xyz/no-such-model-whitney-test"):
        with pytest.raises(NotFound) as e:
            load_base_model(name)
        assert e.value.field == "base_model"
        assert name in e.value.message


def test_directory_without_config_is_not_found(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotFound) as e:
        load_base_model(str(tmp_path))
    assert e.value.field == "base_model"
    assert "config.json" in e.value.message


def test_engine_load_model_nonexistent_not_found(tmp_path):
    engine = Engine()
    with pytest.raises(NotFound) as e:
        engine.create_run("r", str(tmp_path / "missing"), LoraConfig(rank=2))
    assert e.value.field == "base_model"
    assert "r" not in engine.runs and engine.models == {}


def _base_tensors(base) -> list[torch.Tensor]:
    out = [base.embed, base.final_norm, base.lm_head]
    for lw in base.layers:
        out += [lw.input_norm, lw.post_attn_norm, *lw.linear.values(), *lw.bias.values()]
        out += [t for t in (lw.q_norm, lw.k_norm) if t is not None]
    return out


def test_same_model_loaded_once_and_shared(tiny_model):
    engine = Engine()
    first = engine.load_model(tiny_model)
    assert engine.load_model(tiny_model) is first
    a = engine.create_run("a", tiny_model, LoraConfig(rank=2, seed=1))
    b = engine.create_run("b", tiny_model, LoraConfig(rank=4, seed=2))
    assert engine.runs["a"].base is engine.runs["b"].base is first
    assert len(engine.models) == 1
    for ta, tb in zip(_base_tensors(a.base), _base_tensors(b.base)):
        assert ta.data_ptr() == tb.data_ptr()
    # Frozen: nothing in the base asks for gradients.
    assert not any(t.requires_grad for t in _base_tensors(first))


def test_tied_model_keeps_one_embedding_copy(tiny_llama, tiny_qwen3):
    llama, qwen = load_base_model(tiny_llama), load_base_model(tiny_qwen3)
    assert llama.config.tie_embeddings and llama.lm_head.data_ptr() == llama.embed.data_ptr()
    assert not qwen.config.tie_embeddings and qwen.lm_head.data_ptr() != qwen.embed.data_ptr()
    assert qwen.config.qk_norm and qwen.layers[0].q_norm is not None


def _live_storage_bytes() -> int:
    """Bytes of the distinct storages of all live tensors in this process."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some deprecated torch module objects warns
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def test_a_run_costs_its_adapter_and_gradients_only_while_pending(tiny_model):
    engine = Engine()
    engine.create_run("first", tiny_model, LoraConfig(rank=2))  # loads the base
    base_bytes = sum(t.untyped_storage().nbytes() for t in _base_tensors(engine.models[tiny_model]))
    before = _live_storage_bytes()
    run = engine.create_run("second", tiny_model, LoraConfig(rank=4, seed=3))
    grown = _live_storage_bytes() - before
    adapter_bytes = sum(p.numel() * p.element_size() for p in run.adapter.parameters())
    assert run.grads == {} and grown == adapter_bytes, (grown, adapter_bytes)
    assert grown < base_bytes / 4  # and in particular no copy of the base
    # forward_backward creates one gradient per weight; optim_step consumes and frees them.
    engine.forward_backward("second", [Datum([1, 2, 3], {"target_tokens": [2, 3, 4]})])
    assert {k: tuple(g.shape) for k, g in run.grads.items()} == {k: tuple(p.shape) for k, p in
                                                                 run.adapter.named_parameters()}
    # No run tensor aliases a base tensor.
    base_ptrs = {t.untyped_storage().data_ptr() for t in _base_tensors(run.base)}
    assert not base_ptrs & {t.untyped_storage().data_ptr() for t in [*run.adapter.parameters(), *run.grads.values()]}
    engine.optim_step("second")
    assert run.grads == {}
    assert set(run.optimizer.exp_avg) == set(run.optimizer.exp_avg_sq) == set(dict(run.adapter.named_parameters()))


def test_training_never_changes_the_base(tiny_llama):
    engine = Engine()
    engine.create_run("a", tiny_llama, LoraConfig(rank=2))
    base = engine.models[tiny_llama]
    snapshot = [t.clone() for t in _base_tensors(base)]
    ptrs = [t.data_ptr() for t in _base_tensors(base)]
    engine.forward_backward("a", [Datum([5, 6, 7, 8], {"target_tokens": [6, 7, 8, 9]})])
    engine.optim_step("a", {"learning_rate": 1e-2})
    assert any(float(b.detach().abs().max()) > 0 for b in engine.runs["a"].adapter.B.values())
    for t, s, p in zip(_base_tensors(base), snapshot, ptrs):
        assert t.data_ptr() == p
        assert torch.equal(t, s)


