"""Sampler replicas' settings and vLLM's request mapping, without a vLLM server (tests/vllm runs a real one): the
`--samplers` forms, what goes to Whitney's exact sampler, a request as vLLM's completions body, and vLLM's streamed
chunks (their shape as vLLM 0.32 sends them) back as Whitney's result."""

from __future__ import annotations

import pytest

from whitney.backends.vllm.requests import Answer, completion_body, exact_only
from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec, ExactOnly, SamplerEngine, SamplerReplicas
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampleProgress, SamplingParams
from whitney.protocol.training import ImageInput


def test_the_samplers_forms():
    assert SamplerReplicas.parse("2") == SamplerReplicas(2, 2)
    assert SamplerReplicas.parse("auto", engine=SamplerEngine.VLLM) == SamplerReplicas(0, 1, SamplerEngine.VLLM)
    assert SamplerReplicas.parse("1..3").elastic and not SamplerReplicas.parse("3").elastic
    for bad in ("-1", "3..1", "x", "1..", "..2", "1.5"):
        with pytest.raises(InvalidInput) as e:
            SamplerReplicas.parse(bad)
        assert e.value.field == "samplers"


def test_what_vllm_does_not_serve_goes_to_the_exact_sampler():
    plain = SamplingParams(max_tokens=4, stop=["\n", 7, [9]])
    assert exact_only([1, 2, [3, 4]], plain, 8) is None
    assert exact_only([1, ImageInput(data=b"", format="png")], plain, 8) == ExactOnly.IMAGES
    assert exact_only([1, 2], SamplingParams(prompt_logprobs=True), 8) == ExactOnly.PROMPT_LOGPROBS
    assert exact_only([1, 2], SamplingParams(topk_prompt_logprobs=3), 8) == ExactOnly.PROMPT_LOGPROBS
    assert exact_only([1, 2], SamplingParams(target_prompt_logprobs=((1,),)), 8) == ExactOnly.TARGET_LOGPROBS
    assert exact_only([1, 2], SamplingParams(stop=[[5, 6]]), 8) == ExactOnly.STOP_SEQUENCES
    assert exact_only([1, 2, [3]], SamplingParams(max_tokens=6), 8) == ExactOnly.LONG


def test_a_request_as_vllms_body():
    params = SamplingParams(max_tokens=9, temperature=0.5, top_k=0, top_p=0.9, seed=4, num_samples=3,
                            top_logprobs=2, stop=["END", 7, [8]])
    body = completion_body([1, [2, 3]], params, "run.v1", (2,))
    assert body["prompt"] == [1, 2, 3] and body["model"] == "run.v1" and body["n"] == 3 and body["seed"] == 4
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["top_p"]) == (9, 0.5, -1, 0.9)
    assert body["stop"] == ["END"] and body["stop_token_ids"] == [7, 8] and body["ignore_eos"] is True
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] and body["stream"]
    eos = completion_body([1], SamplingParams(), "m", (2, 5))  # stop None: the model's EOS ids, nothing of vLLM's
    assert eos["stop_token_ids"] == [2, 5] and "stop" not in eos and "seed" not in eos
    assert "stop_token_ids" not in completion_body([1], SamplingParams(stop=()), "m", (2,))


def chunk(index: int, tokens: list[int], logprobs: list[float], tops: list[dict] | None = None,
          finish: str | None = None) -> dict:
    """A streamed completion chunk as vLLM sends it (return_tokens_as_token_ids; top_logprobs holds the chosen
    token and the k most likely, keyed "token_id:N")."""
    return {"choices": [{"index": index, "text": "", "finish_reason": finish, "logprobs": {
        "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs,
        "top_logprobs": [{f"token_id:{t}": v for t, v in top.items()} for top in tops] if tops else None}}]}


def test_streamed_chunks_as_progress_and_result():
    answer = Answer.of(SamplingParams(num_samples=2, top_logprobs=1))
    answer.add(chunk(1, [5], [-0.5], [{5: -0.5, 6: -0.25}]))
    first = answer.progress()
    assert isinstance(first, SampleProgress) and first.tokens == [[], [5]]
    assert first.top_logprobs == [[], [[(6, -0.25)]]]
    assert answer.progress() is None
    answer.add(chunk(0, [7, 2], [-1.0, -2.0], [{7: -1.0}, {2: -2.0, 3: -0.5}], finish="stop"))
    answer.add(chunk(1, [9], [-0.1], [{9: -0.1}], finish="length"))
    result = answer.result()
    assert [s.tokens for s in result.sequences] == [[7, 2], [5, 9]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length"]
    assert result.sequences[0].top_logprobs == [[(7, -1.0)], [(3, -0.5)]]  # the k most likely, not the chosen
    assert result.prompt_logprobs is None


def test_the_serve_flags():
    from whitney.cli import backend_config, build_parser

    def config(*flags: str) -> dict:
        return backend_config(build_parser().parse_args(["serve", *flags]))

    vllm = config("--samplers", "auto", "--sampler-engine", "vllm", "--vllm-python", "/x/python",
                  "--sampler-idle-seconds", "30", "--vllm-max-loras", "4", "--vllm-max-model-len", "2048",
                  "--vllm-args", "--gpu-memory-utilization 0.4")["samplers"]
    assert vllm == SamplerReplicas(0, 1, SamplerEngine.VLLM, "/x/python", 30.0, 4, 2048,
                                   ("--gpu-memory-utilization", "0.4"))  # beside the in-process backend
    assert config("--backend", "ray", "--samplers", "2")["samplers"] == SamplerReplicas(2, 2)
    assert config()["samplers"] == SamplerReplicas()
    for flags, words in ((("--samplers", "1"), "--backend ray"), (("--samplers", "1..x"), "MIN..MAX"),
                         (("--samplers", "1", "--sampler-engine", "vllm", "--vllm-max-loras", "0"), "max-loras"),
                         # a setting nothing would read is refused, never ignored
                         (("--sampler-engine", "vllm"), "needs replicas"),
                         (("--backend", "ray", "--samplers", "1", "--vllm-max-loras", "4"), "--vllm-max-loras"),
                         (("--backend", "ray", "--vllm-args=--seed 1"), "--vllm-args"),
                         (("--samplers", "2", "--sampler-engine", "vllm", "--sampler-idle-seconds", "9"),
                          "elastic")):
        with pytest.raises(InvalidInput) as e:
            config(*flags)
        assert words in e.value.message, e.value.message


def test_elastic_replicas_of_whitneys_own_sampler_on_ray_are_placed_by_their_bounds():
    from whitney.backends.ray.placement import placements

    [p] = placements(BackendSpec(EngineConfig(), (("m", "m"),), samplers=SamplerReplicas(0, 2, idle_seconds=9.0)))
    assert (p.samplers, p.max_samplers, p.sampler_idle_seconds) == (0, 2, 9.0)


def test_an_adapter_of_moe_experts_stays_with_whitneys_sampler(tmp_path):
    import json

    from whitney.backends.vllm.backend import expressible

    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj", "lm_head"]}))
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "adapter_config.json").write_text(json.dumps(
        {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]}))
    assert expressible(tmp_path / "dense") and not expressible(tmp_path / "moe")


def test_the_kv_cache_holds_one_longest_sequence(tmp_path):
    import json

    from whitney.backends.vllm.server import CPU_KV_CACHE_GIB, kv_cache_gib

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 16,
                                                      "num_key_value_heads": 8, "head_dim": 128,
                                                      "hidden_size": 1024}))
    # 28 layers x K,V x 8 heads x 128 x 4 bytes = 229,376 bytes a token: 40,960 tokens are 8.75 GiB, x 1.25
    assert kv_cache_gib(str(tmp_path), "float32", 40960) == 11
    assert kv_cache_gib(str(tmp_path), "bfloat16", 40960) == 6
    assert kv_cache_gib(str(tmp_path), "float32", 512) == CPU_KV_CACHE_GIB


def test_a_trainer_sharded_over_gpus_gets_tensor_parallel_vllm_replicas_of_as_many_gpus():
    """gpus:4 shards the trainer over 4 GPUs (a base larger than one): its vLLM replicas are tensor parallel over 4
    GPUs each; a model sharded over CPU ranks, or on one GPU, samples on one device; the operator's own
    --tensor-parallel-size stands."""
    from whitney.backends.vllm import _tensor_parallel, _with_tensor_parallel

    spec = BackendSpec(EngineConfig(), (("big", "big"), ("cpu", "cpu"), ("one", "one")),
                       samplers=SamplerReplicas(1, 1, engine=SamplerEngine.VLLM),
                       worker_resources={"big": {"gpus": 4}, "cpu": {"shards": 2}, "one": {"gpus": 1}})
    assert _tensor_parallel(spec) == {"big": 4}
    assert _with_tensor_parallel(("--enforce-eager",), 4) == ("--enforce-eager", "--tensor-parallel-size", "4")
    assert _with_tensor_parallel(("--tensor-parallel-size", "2"), 4) == ("--tensor-parallel-size", "2")
    assert _with_tensor_parallel((), 1) == ()
