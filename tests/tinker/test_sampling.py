"""The SDK's SamplingClient: sample with every sampling parameter and compute_logprobs, against the native API."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

import whitney
from tests.tinker.helpers import arrays, close, native_data, tinker_data

RANK, SEED = 4, 5
PROMPT = [1, 17, 250, 4000, 12, 99]


@pytest.fixture(scope="module")
def trained(service_client, tinker_env, tiny_llama):
    """A Tinker model and a native run trained identically one step, each with a saved sampler version."""
    native_client = whitney.Client(tinker_env.url)
    native_session = native_client.create_session()
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    run = native_session.create_run(tiny_llama, rank=RANK, seed=SEED)
    items = arrays("cross_entropy")
    tc.forward_backward(tinker_data(items), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    run.forward_backward(native_data(items)).result()
    run.optim_step(learning_rate=5e-2).result()
    path = tc.save_weights_for_sampler("s1").result().path
    version = run.save_weights_for_sampler().result()["version"]
    yield {"tc": tc, "run": run, "path": path, "version": version, "client": native_client}
    native_session.close()
    native_client.close()


def native_sample(trained, **params):
    return trained["run"].sample(PROMPT, trained["version"], **params).result()


def check_same(got: types.SampleResponse, expected: dict) -> None:
    assert len(got.sequences) == len(expected["sequences"])
    for seq, exp in zip(got.sequences, expected["sequences"]):
        assert list(seq.tokens) == exp["tokens"]
        assert seq.stop_reason == exp["stop_reason"]
        close(seq.logprobs, exp["logprobs"])
        assert seq.sequence_id  # the asample answer's sample_sequence_ids, attached by the SDK


def test_sample_with_every_parameter_matches_native(service_client, trained):
    assert trained["path"] == f"tinker://{trained['tc'].model_id}/sampler_weights/s1"
    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    params = dict(max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    got = sc.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(**params),
                    include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    expected = native_sample(trained, num_samples=3, prompt_logprobs=True, topk_prompt_logprobs=3, **params)
    check_same(got, expected)
    assert got.prompt_logprobs[0] is None
    close(got.prompt_logprobs[1:], expected["prompt_logprobs"][1:])
    assert not got.topk_prompt_logprobs[0]
    for row, exp in zip(got.topk_prompt_logprobs[1:], expected["topk_prompt_logprobs"][1:], strict=True):
        assert [t for t, _ in row] == [t for t, _ in exp]
        close([lp for _, lp in row], [lp for _, lp in exp])


def test_stop_tokens_strings_and_no_eos(service_client, trained):
    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    free = sc.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=7, stop=[])).result()
    expected = native_sample(trained, max_tokens=8, seed=7, stop=[])
    check_same(free, expected)
    assert free.sequences[0].stop_reason == "length" and len(free.sequences[0].tokens) == 8
    stop_id = free.sequences[0].tokens[3]
    by_id = sc.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=7, stop=[stop_id])).result()
    check_same(by_id, native_sample(trained, max_tokens=8, seed=7, stop=[stop_id]))
    assert by_id.sequences[0].stop_reason == "stop" and len(by_id.sequences[0].tokens) <= 4
    text = sc.get_tokenizer().decode(free.sequences[0].tokens[2:4])
    if text.strip():
        by_str = sc.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=7, stop=text)).result()
        check_same(by_str, native_sample(trained, max_tokens=8, seed=7, stop=[text]))


def test_compute_logprobs_matches_native(service_client, trained):
    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    got = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    expected = trained["run"].compute_logprobs([PROMPT], trained["version"]).result()["logprobs"][0]
    assert got[0] is None and expected[0] is None
    close(got[1:], expected[1:])
    last = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * (len(PROMPT) - 2)
    close(last[-2:], expected[-2:])


def test_base_model_sampling_client(service_client, trained, tiny_llama):
    sc = service_client.create_sampling_client(base_model=tiny_llama).result()
    assert sc.get_base_model() == tiny_llama
    got = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    expected = trained["client"].compute_logprobs([PROMPT], base_model=tiny_llama).result()["logprobs"][0]
    close(got[1:], expected[1:])
    params = dict(max_tokens=4, seed=3, temperature=0.5)
    sample = sc.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(**params)).result()
    check_same(sample, trained["client"].sample(PROMPT, base_model=tiny_llama, num_samples=2, **params).result())


def test_save_weights_and_get_sampling_client(service_client, trained):
    tc = trained["tc"]
    sc = tc.save_weights_and_get_sampling_client().result()
    got = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    by_path = service_client.create_sampling_client(model_path=trained["path"]).result()
    close(got[1:], by_path.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:])
    assert sc.get_base_model() == tc.get_info().model_data.model_name


def test_unsupported_sampling_fields_are_refused(service_client, trained):
    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k"):
        sc.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2),
                  prompt_alt_tokens_k=2).result()


def test_sampling_an_unknown_path_is_a_user_error(service_client, trained):
    with pytest.raises(tinker.NotFoundError):
        service_client.create_sampling_client(
            model_path=f"tinker://{trained['tc'].model_id}/sampler_weights/nope").result()


def test_sampler_handle_and_pickle(service_client, trained):
    """A client rebuilt in another process (handle or pickle) samples the same sampler: seq_ids from a
    random clone id (near 10^18) are no problem, since sampling is not ordered."""
    import pickle

    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    expected = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    for clone in (tinker.SamplingClient.from_sampler_handle(sc.get_sampler_handle()), pickle.loads(pickle.dumps(sc))):
        close(clone.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:], expected[1:])


def test_max_tokens_none_samples_to_the_end_of_the_context(service_client, trained, tinker_env):
    sc = service_client.create_sampling_client(model_path=trained["path"]).result()
    got = sc.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(seed=2, stop=[])).result()
    context = tinker_env.app.state.whitney.model_info(trained["tc"].get_info().model_data.model_name).max_context
    assert len(got.sequences[0].tokens) == context - len(PROMPT) and got.sequences[0].stop_reason == "length"
