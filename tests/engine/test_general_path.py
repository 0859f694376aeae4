"""The general path (engine/general.py): families other than llama/qwen2/qwen3 run through their own
Hugging Face modules with LoRA hooks. Each family is checked against Hugging Face and PEFT themselves."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models import COMPOSITE_KINDS, GENERAL_KINDS, built_on_first_use, make_tiny_general_model, unique_id
from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.families.lora import adaptable_short_names
from whitney.engine.families.general import GeneralModel
from whitney.engine.families.model import load_base_model
from whitney.errors import InvalidInput
from whitney.protocol.sampling import SamplingParams

ATOL = 1e-5
LORA = LoraConfig(rank=4, alpha=8.0, seed=3)  # every attention and MLP linear, and lm_head


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return built_on_first_use(tmp_path_factory.mktemp("general"), make_tiny_general_model)


@pytest.fixture(params=list(GENERAL_KINDS))
def general_model(request, model_dirs) -> str:
    return model_dirs(request.param)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", compute_dtype="float32")


_rid = unique_id


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (12, 5, 9)]


def _data(seqs: list[list[int]]) -> list[Datum]:
    g = torch.Generator().manual_seed(1)
    return [Datum(s[:-1], {"target_tokens": s[1:], "weights": (torch.rand(len(s) - 1, generator=g) + 0.5).tolist()})
            for s in seqs]


def _hf(path: str, dtype=torch.float32):
    """The model through transformers; in float64 with MoE experts on the family's own eager loop (the
    default grouped_mm has no float64 kernel)."""
    from transformers import AutoModelForCausalLM

    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).eval()


def _hf_logprobs(model, seqs) -> list[torch.Tensor]:
    """Each sequence alone (no padding): log p(s[t+1] | s[:t+1]) under the model's own forward."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=torch.tensor([s[:-1]])).logits[0].double()
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def _randomise_b(engine: Engine, run_id: str, seed: int = 11) -> None:
    """A non-zero B everywhere, so A's gradients and the adapter's effect are not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in engine.get_run(run_id).adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def test_loads_on_the_general_path_with_the_models_own_modules(general_model):
    base = load_base_model(general_model)
    assert isinstance(base, GeneralModel)
    assert all(not p.requires_grad for p in base.hf.parameters())
    linear = {n for n, m in base.hf.named_modules() if isinstance(m, torch.nn.Linear)  # the text model's
              and (n.startswith(f"{base.hf_decoder}.layers.") or n == "lm_head")}
    experts = {n for n, p in base.hf.named_parameters() if ".experts." in n and p.dim() == 3}  # MoE weights
    # every adaptable linear is a real module, every expert projection a real parameter, and only those
    assert set(base.linear_shapes) == linear | experts
    assert base.lm_head.data_ptr() == base.hf.lm_head.weight.data_ptr()
    short = adaptable_short_names(base.linear_shapes)
    assert short[-1] == "lm_head" and set(short) == ({p.rsplit(".", 1)[-1] for p in linear}
                                                     | {".".join(p.split(".")[-2:]) for p in experts})
    if base.config.model_type == "phi3":
        assert "qkv_proj" in short and "gate_up_proj" in short  # fused projections adapted as they are
    if "moe" in base.config.model_type or base.config.model_type == "gpt_oss":
        assert {"experts.gate_up_proj", "experts.down_proj"} <= set(short)  # the experts' own weights


def test_base_logprobs_equal_hf(engine, general_model):
    """Rows of different lengths padded into one batch equal each row alone through HF (so right padding
    never leaks into a real position, linear-attention layers included)."""
    seqs = _sequences(49152)
    ours = engine.compute_logprobs(seqs, base_model=general_model)
    theirs = _hf_logprobs(_hf(general_model), seqs)
    for o, t in zip(ours, theirs):
        assert o[0] is None
        torch.testing.assert_close(torch.tensor(o[1:], dtype=torch.float64), t, atol=ATOL, rtol=0)
    assert float(torch.cat(theirs).std()) > 0.1  # not near-uniform: the comparison means something


@pytest.mark.parametrize("kind", list(COMPOSITE_KINDS))
def test_multimodal_checkpoint_serves_its_text_model(engine, model_dirs, kind, tmp_path):
    """A checkpoint as it ships (Qwen3.5, Qwen3.5-MoE, Gemma 3: a vision tower around the text model) is
    served as its text model: log-probs equal the full multimodal model's own on text, only the text
    layers are adaptable, and the PEFT export adapts exactly the run's modules (not the vision tower's
    q_proj)."""
    import transformers
    from peft import PeftModel

    path = model_dirs(kind)
    assert json.loads(open(os.path.join(path, "config.json")).read())["model_type"] == kind
    full = getattr(transformers, COMPOSITE_KINDS[kind][1]).from_pretrained(path, dtype=torch.float32).eval()
    seqs = _sequences(49152)
    ours = engine.compute_logprobs(seqs, base_model=path)
    for o, t in zip(ours, _hf_logprobs(full, seqs)):
        torch.testing.assert_close(torch.tensor(o[1:], dtype=torch.float64), t, atol=ATOL, rtol=0)
    assert not any("visual" in p or "vision" in p for p in engine.load_model(path).linear_shapes)
    run_id = _rid("mm")
    engine.create_run(run_id, path, LORA)
    engine.export_lora(run_id, str(tmp_path / "p"))
    model = PeftModel.from_pretrained(_hf(path), str(tmp_path / "p"))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default").replace(".base_layer", "")
               for n, _ in model.named_modules() if n.endswith(".lora_A.default")}
    assert len(adapted) == len({p.rsplit(".", 1)[0] if ".experts." in p else p
                                for p in engine.get_run(run_id).adapter.A})


def _peft_reference(path: str, adapter_dir: str, data: list[Datum]):
    """Loss and gradients of a float64 HF + PEFT model with the exported adapter, by module path."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(_hf(path, torch.float64), adapter_dir, is_trainable=True)
    model.double()
    total = 0.0
    for d in data:
        logits = model(input_ids=torch.tensor([d.token_ids])).logits[0]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.loss_inputs["target_tokens"])[:, None])[:, 0]
        total = total - (torch.tensor(d.loss_inputs["weights"], dtype=torch.float64) * lp).sum()
    total.backward()
    return float(total.detach()), peft_lora_grads(model)


def peft_lora_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of a PeftModel's LoRA weights by our names (`{path}.lora_A`/`.lora_B`); an expert
    projection (PEFT target_parameters, a ParamWrapper around the experts module) reshaped as peft reads it:
    A [E * r, in] as [E, r, in], B [out, r * E] as [out, r, E] -> [E, out, r]."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    grads = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad
        path_ = name.removeprefix("base_model.model.")
        if isinstance(module, ParamWrapper):  # nested once per adapted parameter of the same module
            path_ = f"{path_.replace('.base_layer', '')}.{module.parameter_name}"
            a = a.reshape(module.num_experts, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, module.num_experts).permute(2, 0, 1)
        grads[f"{path_}.lora_A"], grads[f"{path_}.lora_B"] = a, b
    return grads


def test_lora_gradients_equal_float64_peft(engine, general_model, tmp_path):
    run_id = _rid("grad")
    engine.create_run(run_id, general_model, LORA)
    _randomise_b(engine, run_id)
    data = _data(_sequences(49152))
    result = engine.forward_backward(run_id, data)
    engine.export_lora(run_id, str(tmp_path / "a"))
    loss, ref = _peft_reference(general_model, str(tmp_path / "a"), data)
    ours = engine.get_run(run_id).grads
    assert set(ours) == set(ref) and len(ours) == 2 * len(engine.get_run(run_id).adapter.A)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    for name, g in ours.items():
        assert float(g.abs().max()) > 0, name
        # float32 against float64: rtol 1e-4, and an atol of 1e-5 of the tensor's own scale for entries near 0
        torch.testing.assert_close(g.double(), ref[name], rtol=1e-4, atol=1e-5 * float(ref[name].abs().max()))


def test_mixed_batch_of_two_runs_equals_each_alone(engine, general_model):
    from whitney.protocol.training import ForwardRequest

    a, b = _rid("mix"), _rid("mix")
    engine.create_run(a, general_model, LORA)
    engine.create_run(b, general_model, LoraConfig(rank=2, alpha=4.0, seed=9, target_modules=None, train_mlp=False))
    _randomise_b(engine, a, 1)
    _randomise_b(engine, b, 2)
    seqs = _sequences(49152)
    da, db = _data(seqs[:2]), _data(seqs[1:])
    mixed = engine.run_batch([ForwardRequest(a, da), ForwardRequest(b, db)], backward=True)
    grads = {r: {k: v.clone() for k, v in engine.get_run(r).grads.items()} for r in (a, b)}
    for r in (a, b):
        engine.get_run(r).grads.clear()
    solo = [engine.forward_backward(a, da), engine.forward_backward(b, db)]
    for m, s, r in zip(mixed, solo, (a, b)):
        assert m.loss == pytest.approx(s.loss, rel=1e-6)
        for mo, so in zip(m.outputs, s.outputs):
            torch.testing.assert_close(torch.tensor(mo.logprobs), torch.tensor(so.logprobs), atol=ATOL, rtol=0)
        for k, g in engine.get_run(r).grads.items():  # atol: 1e-6 of the tensor's scale, for entries near 0
            torch.testing.assert_close(grads[r][k], g, rtol=1e-4, atol=max(1e-7, 1e-6 * float(g.abs().max())))
    assert abs(mixed[0].loss - mixed[1].loss) > 1e-3  # the runs differ: a swapped adapter would show


def _train(engine: Engine, run_id: str, steps, data) -> None:
    for _ in steps:
        engine.forward_backward(run_id, data)
        engine.optim_step(run_id, {"learning_rate": 1e-2})


def test_resume_is_exact(engine, general_model, tmp_path):
    data = _data(_sequences(49152))
    a, b = _rid("resume"), _rid("resume")
    engine.create_run(a, general_model, LORA)
    _train(engine, a, range(2), data)
    engine.save_state(a, str(tmp_path / "s"))
    _train(engine, a, range(2), data)
    engine.create_run(b, general_model, LORA)
    engine.load_state(b, str(tmp_path / "s"), with_optimizer=True)
    _train(engine, b, range(2), data)
    for (name, wa), (_, wb) in zip(engine.get_run(a).weights().items(), engine.get_run(b).weights().items()):
        assert torch.equal(wa, wb), name
    assert any(torch.count_nonzero(w) for w in engine.get_run(a).adapter.B.values())


def test_peft_export_loads_with_equal_logprobs(engine, general_model, tmp_path):
    from peft import PeftModel

    run_id = _rid("peft")
    engine.create_run(run_id, general_model, LORA)
    seqs = _sequences(49152)
    _train(engine, run_id, range(3), _data(seqs))
    assert all(torch.count_nonzero(b) for b in engine.get_run(run_id).adapter.B.values())  # every module trained
    ours = [torch.tensor(o.logprobs, dtype=torch.float64) for o in engine.forward(run_id, _data(seqs)).outputs]
    engine.export_lora(run_id, str(tmp_path / "p"))
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.basename(general_model)
    base = _hf(general_model)
    base_lp = _hf_logprobs(base, seqs)
    model = PeftModel.from_pretrained(base, str(tmp_path / "p")).eval()
    theirs = _hf_logprobs(model, seqs)
    for o, t, b in zip(ours, theirs, base_lp):
        torch.testing.assert_close(o, t, atol=ATOL, rtol=0)
    assert max(float((o - b).abs().max()) for o, b in zip(ours, base_lp)) > 1e-3  # the adapter matters
    lora_modules = {n for n, _ in model.named_modules() if n.endswith(".lora_A.default")}
    assert len(lora_modules) == len(engine.get_run(run_id).adapter.A)


def test_target_modules_are_the_models_own_names(engine, model_dirs):
    path = model_dirs("phi3")
    run = engine.create_run(_rid("tm"), path, LoraConfig(rank=2, target_modules=("qkv_proj",)))
    assert list(run.adapter.A) == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]
    with pytest.raises(InvalidInput, match="unknown module 'q_proj'.*qkv_proj") as e:
        engine.create_run(_rid("tm"), path, LoraConfig(rank=2, target_modules=("q_proj",)))
    assert e.value.field == "target_modules"
    qwen = engine.create_run(_rid("tm"), model_dirs("qwen3_5_text"), LoraConfig(rank=2, train_mlp=False,
                                                                                train_unembed=False))
    assert list(qwen.adapter.A) == [  # linear attention and full attention are both "attention"
        "model.layers.0.linear_attn.out_proj", "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.0.linear_attn.in_proj_z", "model.layers.0.linear_attn.in_proj_b",
        "model.layers.0.linear_attn.in_proj_a", "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"]


@pytest.mark.parametrize("kind", ["phi3", "qwen3_5_text", "gpt_oss"])
def test_bfloat16_compute_is_close_to_float32_and_trains_and_samples(model_dirs, kind):
    """Not exact (bfloat16 weights and activations): close to float32, and every path runs."""
    path, seqs = model_dirs(kind), _sequences(49152)
    exact = Engine(device="cpu", compute_dtype="float32").compute_logprobs(seqs, base_model=path)
    eng = Engine(device="cpu", compute_dtype="bfloat16")
    assert eng.load_model(path).hf.lm_head.weight.dtype == torch.bfloat16
    half = eng.compute_logprobs(seqs, base_model=path)
    assert max(abs(x - y) for r, h in zip(exact, half) for x, y in zip(r[1:], h[1:])) < 0.05
    eng.create_run("r", path, LORA)
    eng.forward_backward("r", _data(seqs))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in eng.get_run("r").grads.values())
    eng.optim_step("r", {"learning_rate": 1e-2})
    version = eng.save_weights_for_sampler("r")
    out = eng.sample(seqs[0][:5], SamplingParams(max_tokens=4, seed=1, num_samples=2, stop=()), run_id="r",
                     version=version)
    assert [len(s.tokens) for s in out.sequences] == [4, 4]


def _save_config_model(tmp_path, kind: str, **extra) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.models import embedded_model_dir

    cfg = AutoConfig.for_model(kind, vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **extra)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / kind)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(tmp_path / kind)
    return str(tmp_path / kind)


def test_models_that_cannot_be_served_are_refused_by_name(tmp_path):
    gemma = _save_config_model(tmp_path, "gemma2", head_dim=16, final_logit_softcapping=30.0)
    with pytest.raises(InvalidInput, match="'gemma2'.*final_logit_softcapping"):
        load_base_model(gemma)
    # Bidirectional attention (EmbeddingGemma's setting): the padding self-check refuses it.
    bidirectional = _save_config_model(tmp_path, "gemma3_text", head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(InvalidInput, match="'gemma3_text'.*right padding changes real positions"):
        load_base_model(bidirectional)
    bert = _save_config_model(tmp_path, "bert")  # BertLMHeadModel: an encoder, no decoder layers
    with pytest.raises(InvalidInput, match="'bert'.*model type 'bert'") as e:
        load_base_model(bert)
    assert e.value.field == "base_model" and str(tmp_path) not in str(e.value)  # no server path shown
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    with pytest.raises(InvalidInput, match="'unknown'.*no_such_family"):
        load_base_model(str(unknown))
    # The same family causal (gemma3_text without soft-capping) passes the checks and is served.
    causal = tmp_path / "causal"
    causal.mkdir()
    assert isinstance(load_base_model(_save_config_model(causal, "gemma3_text", head_dim=16)), GeneralModel)


# ---- sampling with the model's own cache ---------------------------------------------------------


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = _hf(path)
    model.generation_config.eos_token_id = None  # as stop=(): never stop early
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_greedy_sampling_equals_hf_generate_with_the_merged_adapter(engine, general_model, tmp_path):
    run_id = _rid("greedy")
    engine.create_run(run_id, general_model, LORA)
    _randomise_b(engine, run_id, 4)
    version = engine.save_weights_for_sampler(run_id)
    engine.save_weights(run_id, str(tmp_path / "merged"), merge=True)
    prompt = _sequences(49152)[0][:7]
    got = engine.sample(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop=()), run_id=run_id,
                        version=version)
    assert got.sequences[0].tokens == _hf_greedy(str(tmp_path / "merged"), prompt, 10)
    base = engine.sample(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop=()), base_model=general_model)
    assert base.sequences[0].tokens == _hf_greedy(general_model, prompt, 10)
    assert base.sequences[0].tokens != got.sequences[0].tokens  # the adapter is in the sampled path


def test_sampled_logprobs_equal_compute_logprobs(engine, general_model):
    run_id = _rid("lp")
    engine.create_run(run_id, general_model, LORA)
    _randomise_b(engine, run_id, 5)
    version = engine.save_weights_for_sampler(run_id)
    prompt = _sequences(49152)[1]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, num_samples=3, stop=(), prompt_logprobs=True)
    result = engine.sample(prompt, params, run_id=run_id, version=version)
    assert len({tuple(s.tokens) for s in result.sequences}) > 1  # samples differ at temperature 1
    scored = engine.compute_logprobs([prompt + s.tokens for s in result.sequences], run_id=run_id, version=version)
    for s, ref in zip(result.sequences, scored):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(ref[len(prompt):]), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), torch.tensor(scored[0][1:len(prompt)]),
                               atol=ATOL, rtol=0)
    again = engine.sample(prompt, params, run_id=run_id, version=version)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]  # seeded


def test_concurrent_requests_with_stops_equal_each_alone(engine, general_model):
    """Two adapters and the base in one running batch, rows of one request finishing apart (a stop token),
    each equal to the request sampled alone."""
    runs = []
    for seed in (1, 2):
        run_id = _rid("conc")
        engine.create_run(run_id, general_model, LoraConfig(rank=2, alpha=4.0, seed=seed))
        _randomise_b(engine, run_id, seed)
        runs.append((run_id, engine.save_weights_for_sampler(run_id)))
    prompts = [s[:4] for s in _sequences(49152)]
    probe = engine.sample(prompts[0], SamplingParams(max_tokens=8, seed=9, num_samples=3, stop=()),
                          run_id=runs[0][0], version=runs[0][1])
    stop_token = probe.sequences[1].tokens[2]  # makes sample 1 stop early, the others most likely later
    jobs = [(prompts[0], SamplingParams(max_tokens=8, seed=9, num_samples=3, stop=(stop_token,)),
             dict(run_id=runs[0][0], version=runs[0][1])),
            (prompts[1], SamplingParams(max_tokens=5, seed=4, num_samples=2, stop=()),
             dict(run_id=runs[1][0], version=runs[1][1])),
            (prompts[2], SamplingParams(max_tokens=7, temperature=0.0, stop=()), dict(base_model=general_model))]
    alone = [engine.sample(p, params, **w) for p, params, w in jobs]
    pending = [engine.submit_sample(p, params, **w) for p, params, w in jobs]
    while engine.sample_step():
        pass
    assert all(r.done and r.error is None for r in pending)
    for a, r in zip(alone, pending):
        assert [s.tokens for s in r.result.sequences] == [s.tokens for s in a.sequences]
        for x, y in zip(r.result.sequences, a.sequences):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)
            assert x.stop_reason == y.stop_reason
    assert alone[0].sequences[1].stop_reason == "stop" and len(alone[0].sequences[1].tokens) <= 3


def test_fast_path_order_of_paths_is_unchanged(tiny_model):
    """llama/qwen3 keep the hand-written path, and their adapter's paths (which fix the seeded init) stay
    layer by layer in LAYER_PROJECTIONS order, lm_head last."""
    from whitney.engine.families.lora import target_module_paths
    from whitney.engine.families.modules import LAYER_PROJECTIONS, module_path
    from whitney.engine.families.transformer import TransformerModel

    base = load_base_model(tiny_model)
    assert isinstance(base, TransformerModel) and len(base.layers) == 2
    assert target_module_paths(base.linear_shapes, LoraConfig()) == [
        module_path(i, p) for i in range(2) for p in LAYER_PROJECTIONS] + ["lm_head"]
    assert target_module_paths(base.linear_shapes, LoraConfig(target_modules=("down_proj", "q_proj"))) == [
        module_path(i, p) for i in range(2) for p in ("q_proj", "down_proj")]
    assert adaptable_short_names(base.linear_shapes) == [*LAYER_PROJECTIONS, "lm_head"]


def test_a_request_whose_own_pass_fails_fails_alone(engine, model_dirs, monkeypatch):
    """A decode pass failing for one request's cache gives that request the error; the other request,
    running in the same steps, equals it sampled alone."""
    from whitney.engine.sampling import hf_sampler

    path = model_dirs("qwen3_5_text")
    run_id = _rid("fail")
    engine.create_run(run_id, path, LoraConfig(rank=2, seed=4))
    _randomise_b(engine, run_id, 6)
    version = engine.save_weights_for_sampler(run_id)
    bad = engine.get_run(run_id).sampler_versions[version]
    params = SamplingParams(max_tokens=6, seed=2, num_samples=2, stop=())
    prompt = _sequences(49152)[0][:5]
    alone = engine.sample(prompt, params, base_model=path)
    real = hf_sampler.step_hidden

    def failing(base, tokens, groups, cache):
        if tokens.shape[1] == 1 and groups.bounds[0][-1] is bad:
            raise RuntimeError("this request's decode failed")
        return real(base, tokens, groups, cache)

    monkeypatch.setattr(hf_sampler, "step_hidden", failing)
    doomed = engine.submit_sample(prompt, params, run_id=run_id, version=version)
    fine = engine.submit_sample(prompt, params, base_model=path)
    while engine.sample_step():
        pass
    assert isinstance(doomed.error, RuntimeError)
    assert fine.error is None and [s.tokens for s in fine.result.sequences] == [s.tokens for s in alone.sequences]
