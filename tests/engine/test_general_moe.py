"""LoRA on the experts of MoE families (engine/experts.py): Qwen3-MoE, Qwen3.5-MoE and gpt-oss keep their
experts as stacked 3D parameters, adapted per expert and checked against PEFT's `target_parameters`.

The families' general-path guarantees (base log-probs, gradients, mixed batches, sampling, exports, resume)
are the parametrised tests of test_general_path.py; these are the expert-specific ones."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_general_path import _data, _hf, _randomise_b, _rid, _sequences, peft_lora_grads
from tests.models import make_tiny_general_model
from whitney.backends.in_process import BYTES_PER_PARAMETER, adapter_bytes, model_info
from whitney.engine import Engine, LoraConfig
from whitney.engine.families.lora import RowGroups
from whitney.errors import InvalidInput

MOE_KINDS = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss")
EXPERTS_ONLY = LoraConfig(rank=3, alpha=6.0, seed=5, target_modules=("experts.gate_up_proj", "experts.down_proj"))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {kind: str(make_tiny_general_model(root / kind, kind)) for kind in MOE_KINDS}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", compute_dtype="float32")


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each MoE layer's router (its output's last element: the chosen experts [N, K])."""
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def _routing(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """The experts each router chose while `run()` ran, sorted per token: one [N, K] per router call."""
    seen = []
    handles = [r.register_forward_hook(lambda _m, _a, out: seen.append(out[-1].sort(-1).values.clone()))
               for r in _routers(model)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_expert_projections_are_adaptable_by_name(engine, moe_dirs, kind):
    path = moe_dirs[kind]
    base = engine.load_model(path)
    info = model_info(base, path)
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(info.adaptable_modules)  # capabilities list them
    run = engine.create_run(_rid("names"), path, EXPERTS_ONLY)
    assert list(run.adapter.A) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                   for p in ("gate_up_proj", "down_proj")]
    experts = base.hf.get_submodule("model.layers.0.mlp.experts")
    inter = 32  # moe_intermediate_size / intermediate_size of the tiny configs
    assert run.adapter.A["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 3, 64)  # [E, r, in]
    assert run.adapter.B["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * inter, 3)  # [E, out, r]
    assert run.adapter.A["model.layers.0.mlp.experts.down_proj"].shape == (4, 3, inter)
    assert experts.is_transposed == (kind == "gpt_oss")  # gpt-oss keeps [E, in, out]; both read the same
    # quota: every expert's A and B, at 16 bytes a parameter
    assert adapter_bytes(base.linear_shapes, EXPERTS_ONLY, 64) == BYTES_PER_PARAMETER * 3 * 2 * 4 * (
        (64 + 2 * inter) + (inter + 64))
    with pytest.raises(InvalidInput, match="unknown module 'experts.up_proj'.*experts.gate_up_proj") as e:
        engine.create_run(_rid("names"), path, LoraConfig(target_modules=("experts.up_proj",)))
    assert e.value.field == "target_modules"


def test_a_shared_experts_down_proj_and_the_experts_down_proj_are_apart(engine, moe_dirs):
    """Qwen3.5-MoE: `down_proj` is the shared expert's nn.Linear, `experts.down_proj` the routed experts'."""
    path = moe_dirs["qwen3_5_moe_text"]
    shared = engine.create_run(_rid("apart"), path, LoraConfig(rank=2, target_modules=("down_proj",)))
    assert list(shared.adapter.A) == [f"model.layers.{i}.mlp.shared_expert.down_proj" for i in range(2)]
    routed = engine.create_run(_rid("apart"), path, LoraConfig(rank=2, target_modules=("experts.down_proj",)))
    assert list(routed.adapter.A) == [f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)]
    default = engine.create_run(_rid("apart"), path, LoraConfig(rank=2, train_attn=False, train_unembed=False))
    assert {p.split(".mlp.")[1] for p in default.adapter.A} == {  # train_mlp: routed and shared experts
        "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
        "shared_expert.down_proj", "shared_expert_gate"}


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_expert_lora_changes_the_output_and_zero_b_is_the_base(engine, moe_dirs, kind):
    path, seqs = moe_dirs[kind], _sequences(49152)
    run_id = _rid("effect")
    engine.create_run(run_id, path, EXPERTS_ONLY)
    base = engine.compute_logprobs(seqs, base_model=path)
    fresh = engine.forward(run_id, _data(seqs)).outputs  # B = 0: exactly the base (through experts_forward)
    for b, f in zip(base, fresh):
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(b[1:]), atol=1e-5, rtol=0)
    _randomise_b(engine, run_id, 3)
    adapted = engine.forward(run_id, _data(seqs)).outputs
    assert max(abs(x - y) for a, b in zip(adapted, base) for x, y in zip(a.logprobs, b[1:])) > 1e-3
    assert all("forward" not in vars(m) for m in engine.load_model(path).hf.modules())  # nothing left behind


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_expert_gradients_equal_float64_peft_target_parameters(engine, moe_dirs, kind, tmp_path):
    """Only the experts adapted; the exported adapter's delta equals PEFT's own `get_delta_weight` per expert;
    our float32 gradients equal the float64 HF + PEFT (target_parameters) model's. Top-k routing is
    discontinuous, so the comparison is valid only with the same routing: checked token by token."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

    path = moe_dirs[kind]
    run_id = _rid("grad")
    engine.create_run(run_id, path, EXPERTS_ONLY)
    _randomise_b(engine, run_id, 8)
    data = _data(_sequences(49152))
    base = engine.load_model(path)
    ours_routing = _routing(base.hf, lambda: [engine.forward(run_id, [d]) for d in data])
    result = engine.forward_backward(run_id, data)
    engine.export_lora(run_id, str(tmp_path / "a"))
    model = PeftModel.from_pretrained(_hf(path, torch.float64), str(tmp_path / "a"), is_trainable=True).double()
    adapter = engine.get_run(run_id).adapter
    wrappers = {n: m for n, m in model.named_modules() if isinstance(m, ParamWrapper)}
    assert len(wrappers) == len(adapter.A) == 4
    for name, wrapper in wrappers.items():
        key = f"{name.removeprefix('base_model.model.').replace('.base_layer', '')}.{wrapper.parameter_name}"
        delta = adapter.scale * adapter.B[key].double() @ adapter.A[key].double()  # [E, out, in]
        layout = delta.transpose(1, 2) if wrapper.get_base_layer().is_transposed else delta
        torch.testing.assert_close(wrapper.get_delta_weight("default"), layout, rtol=1e-12, atol=1e-12)
    total = 0.0

    def reference():
        nonlocal total
        for d in data:
            logits = model(input_ids=torch.tensor([d.token_ids])).logits[0]
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.loss_inputs["target_tokens"])[:, None])[:, 0]
            total = total - (torch.tensor(d.loss_inputs["weights"], dtype=torch.float64) * lp).sum()

    theirs_routing = _routing(model, reference)
    assert len(ours_routing) == len(theirs_routing) == 2 * len(data)
    for o, t in zip(ours_routing, theirs_routing):
        assert torch.equal(o, t), "float32 and float64 routed a token differently: the gradients are not comparable"
    total.backward()
    ref = peft_lora_grads(model)
    ours = engine.get_run(run_id).grads
    assert result.loss == pytest.approx(float(total.detach()), rel=1e-5)
    assert set(ours) == set(ref) and len(ours) == 8
    for name, g in ours.items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(g.double(), ref[name], rtol=1e-4, atol=1e-5 * float(ref[name].abs().max()))


@pytest.mark.parametrize("kind", ["qwen3_5_moe_text", "gpt_oss"])
def test_scattered_row_groups_equal_contiguous_ones(engine, moe_dirs, kind):
    """Rows of two adapters interleaved (index groups, as a decode batch has them) equal the same rows
    grouped contiguously: each token's deltas follow its own row through the experts."""
    path = moe_dirs[kind]
    base = engine.load_model(path)
    a, b = _rid("scatter"), _rid("scatter")
    engine.create_run(a, path, LoraConfig(rank=2, alpha=4.0, seed=1))
    engine.create_run(b, path, EXPERTS_ONLY)
    _randomise_b(engine, a, 1)
    _randomise_b(engine, b, 2)
    ra, rb = engine.get_run(a).adapter, engine.get_run(b).adapter
    seqs = [s[:5] for s in _sequences(49152)] + [_sequences(49152)[0][5:10]]
    tokens = torch.tensor(seqs)  # [4, 5]: rows 0 and 2 use a, row 1 b, row 3 none
    with torch.no_grad():
        scattered = base.forward_hidden(tokens, RowGroups([(torch.tensor([0, 2]), ra), (torch.tensor([1]), rb)]))
        order = torch.tensor([0, 2, 1, 3])
        contiguous = base.forward_hidden(tokens[order], RowGroups([(0, 2, ra), (2, 3, rb), (3, 4, None)]))
    torch.testing.assert_close(scattered[order], contiguous, atol=1e-5, rtol=0)
    with torch.no_grad():
        alone = base.forward_hidden(tokens[1:2], RowGroups([(0, 1, rb)]))
    torch.testing.assert_close(scattered[1:2], alone, atol=1e-5, rtol=0)


def test_a_failing_pass_restores_the_experts_module(engine, moe_dirs):
    """An exception inside an adapted pass leaves no replaced forward behind: the next base pass equals
    Hugging Face's own."""
    path, seqs = moe_dirs["qwen3_moe"], _sequences(49152)
    base = engine.load_model(path)
    run_id = _rid("broken")
    engine.create_run(run_id, path, EXPERTS_ONLY)
    adapter = engine.get_run(run_id).adapter
    key = "model.layers.1.mlp.experts.down_proj"
    good = adapter.A[key]
    adapter.A[key] = torch.zeros(4, 3, 7)  # a wrong width: this layer's delta raises mid-pass
    try:
        with pytest.raises(RuntimeError):
            base.forward_hidden(torch.tensor([seqs[0]]), RowGroups([(0, 1, adapter)]))
    finally:
        adapter.A[key] = good
    assert all("forward" not in vars(m) for m in base.hf.modules())
    ours = engine.compute_logprobs(seqs[:1], base_model=path)[0][1:]
    with torch.no_grad():
        logits = _hf(path)(input_ids=torch.tensor([seqs[0][:-1]])).logits[0]
    theirs = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(seqs[0][1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), theirs, atol=1e-5, rtol=0)
