"""Image chunks through the real Tinker SDK: `ModelInput(chunks=[EncodedTextChunk, ImageChunk, ...])` trains,
scores and samples on a tiny vision-language model with the same numbers as the native API; an
`ImageAssetPointerChunk` under the server's image directory samples as the inline bytes do; audio, undecodable
images, network locations and images for a text model are refused (the last before any image is read), and
declared sizes before anything is made of them."""

from __future__ import annotations

import base64
import tracemalloc

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.images import draw_image, progressive_jpeg
from tests.models import make_tiny_vision_model
from tests.service.conftest import start_server
from tests.service.test_images_api import png_header_only
from tests.tinker.helpers import close
from whitney.engine.families.vision import expander
from whitney.protocol.training import ImageInput
from whitney.service.api import images
from whitney.service.app import ServiceConfig
from whitney.service.scheduling.limits import Limits

ADAM = dict(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


@pytest.fixture(scope="module")
def vl(tmp_path_factory, tiny_llama):
    """A server on a tiny Qwen3-VL and the tiny Llama (text only), images allowed from one directory; the SDK's
    client on it; the image and the positions the model's processor gives it."""
    root = tmp_path_factory.mktemp("tinker-vl")
    model = str(make_tiny_vision_model(root / "tiny-qwen3-vl", "qwen3_vl"))
    (root / "images").mkdir()
    photo = draw_image(64, 96, 4)
    (root / "images" / "photo.png").write_bytes(photo)
    server = start_server(ServiceConfig(models=[model, tiny_llama], data_dir=root / "data",
                                        limits=Limits(image_dirs=(str(root / "images"),))))
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-whitney-tests")
    k = expander(server.engine.load_model(model)).expand(ImageInput(photo, "png"), 0, 0).tokens
    yield {"server": server, "client": client, "model": model, "text_model": tiny_llama, "photo": photo, "k": k,
           "path": root / "images" / "photo.png"}
    client.close("success").result()
    server.stop()


TEXT_A, TEXT_B = [11, 230, 4051, 7, 99], [5, 1200, 42]


def sdk_input(vl, image: types.ModelInputChunk | None = None) -> types.ModelInput:
    image = image or types.ImageChunk(data=vl["photo"], format="png", expected_tokens=vl["k"])
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=TEXT_A), image,
                                    types.EncodedTextChunk(tokens=TEXT_B)])


def native_chunks(vl) -> list[dict]:
    return [{"type": "encoded_text", "tokens": TEXT_A},
            {"type": "image", "data": base64.b64encode(vl["photo"]).decode(), "format": "png",
             "expected_tokens": vl["k"]},
            {"type": "encoded_text", "tokens": TEXT_B}]


def targets(vl) -> tuple[np.ndarray, np.ndarray]:
    """target_tokens and weights over the 8 + k positions (weight 0 on the image and the token before it)."""
    n = 8 + vl["k"]
    rng = np.random.default_rng(0)
    weights = np.array([1.0] * 4 + [0.0] * (vl["k"] + 1) + [1.0] * 3, dtype=np.float32)
    return rng.integers(0, 49152, n).astype(np.int64), weights


def native(vl, method: str, path: str, **body) -> dict:
    with httpx.Client(base_url=vl["server"].url, timeout=60) as http:
        r = http.request(method, path, json=body)
        assert r.status_code < 300, r.text
        op = r.json()
        if "status" in op and "kind" in op:
            op = http.get(f"/v1/operations/{op['id']}", params={"wait": 30}).json()
            assert op["status"] == "succeeded", op
            return op["result"]
        return op


def test_model_input_length_is_the_expanded_length(vl):
    assert sdk_input(vl).length == 8 + vl["k"]


def test_forward_backward_with_an_image_chunk_equals_native(vl):
    """forward_backward, optim_step, forward: the SDK's run and a native run of the same LoRA seed agree."""
    target, weights = targets(vl)
    datum = types.Datum(model_input=sdk_input(vl), loss_fn_inputs={"target_tokens": target, "weights": weights})
    tc = vl["client"].create_lora_training_client(base_model=vl["model"], rank=4, seed=7).result()
    fb = tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    after = tc.forward([datum], "cross_entropy").result()

    session = native(vl, "POST", "/v1/sessions")["id"]
    run = native(vl, "POST", f"/v1/sessions/{session}/runs", base_model=vl["model"], lora={"rank": 4, "seed": 7})["id"]
    wire = [{"input": {"chunks": native_chunks(vl)}, "loss_inputs": {
        "target_tokens": {"dtype": "int64", "shape": [len(target)], "values": target.tolist()},
        "weights": {"dtype": "float32", "shape": [len(weights)], "values": weights.tolist()}}}]
    nfb = native(vl, "POST", f"/v1/runs/{run}/forward_backward", seq_id=0, data=wire)
    native(vl, "POST", f"/v1/runs/{run}/optim_step", seq_id=1, adam_params={**ADAM, "gradient_clip_norm": 0.0})
    nafter = native(vl, "POST", f"/v1/runs/{run}/forward", seq_id=2, data=wire)

    for got, expected in ((fb, nfb), (after, nafter)):
        close(got.loss_fn_outputs[0]["logprobs"].to_numpy().tolist(), expected["outputs"][0]["logprobs"])
        close(got.metrics["loss:sum"], expected["loss"])
    assert after.metrics["loss:sum"] < fb.metrics["loss:sum"]  # the step trained on the image datum


def test_sample_and_compute_logprobs_with_an_image_equal_native(vl):
    """The SDK's sample (seeded) and compute_logprobs with an image prompt give the native API's numbers; an asset
    pointer to the same file samples the same."""
    sampler = vl["client"].create_sampling_client(base_model=vl["model"]).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    got = sampler.sample(prompt=sdk_input(vl), num_samples=2, sampling_params=params,
                         include_prompt_logprobs=True).result()
    expected = native(vl, "POST", "/v1/samples", base_model=vl["model"], prompt=native_chunks(vl), max_tokens=4,
                      seed=3, num_samples=2, stop=[], prompt_logprobs=True)
    assert [s.tokens for s in got.sequences] == [s["tokens"] for s in expected["sequences"]]
    for s, e in zip(got.sequences, expected["sequences"]):
        close(s.logprobs, e["logprobs"])
    assert [v is None for v in got.prompt_logprobs] == [v is None for v in expected["prompt_logprobs"]]
    close([v for v in got.prompt_logprobs if v is not None], [v for v in expected["prompt_logprobs"] if v is not None])

    pointer = types.ImageAssetPointerChunk(location=str(vl["path"]), format="png", expected_tokens=vl["k"])
    by_pointer = sampler.sample(prompt=sdk_input(vl, pointer), num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in by_pointer.sequences] == [s.tokens for s in got.sequences]

    scored = sampler.compute_logprobs(sdk_input(vl)).result()
    expected = native(vl, "POST", "/v1/logprobs", base_model=vl["model"], sequences=[native_chunks(vl)])
    assert len(scored) == 8 + vl["k"]
    assert [v is None for v in scored] == [v is None for v in expected["logprobs"][0]]
    close([v for v in scored if v is not None], [v for v in expected["logprobs"][0] if v is not None])


def bad_request(call) -> str:
    with pytest.raises(tinker.BadRequestError) as info:
        call()
    return str(info.value)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, for the 100 MP header
def test_audio_bad_images_and_network_locations_are_refused(vl):
    tc = vl["client"].create_lora_training_client(base_model=vl["model"], rank=4, seed=1).result()
    target, weights = targets(vl)

    def fb(chunk) -> None:
        datum = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=TEXT_A), chunk]),
                            loss_fn_inputs={"target_tokens": target[:5], "weights": weights[:5]})
        tc.forward_backward([datum], "cross_entropy").result()

    assert "dmel" in bad_request(lambda: fb(types.DmelChunk(dmel=b"\0" * 16)))
    assert "does not decode" in bad_request(lambda: fb(types.ImageChunk(data=b"not an image", format="png")))
    jpeg = draw_image(32, 32, 1, "jpeg")
    assert "declared format 'png'" in bad_request(lambda: fb(types.ImageChunk(data=jpeg, format="png")))
    with pytest.raises(tinker.APIStatusError) as info:  # a header claiming 10000 x 10000 pixels: a 413, not decoded
        fb(types.ImageChunk(data=png_header_only(10_000, 10_000), format="png"))
    assert info.value.status_code == 413 and "max_image_pixels" in str(info.value)

    sampler = vl["client"].create_sampling_client(base_model=vl["model"]).result()
    params = types.SamplingParams(max_tokens=2)
    for location in ("https://example.com/cat.png", "s3://bucket/cat.png"):
        chunk = types.ImageAssetPointerChunk(location=location, format="png")
        message = bad_request(lambda: sampler.sample(prompt=sdk_input(vl, chunk), num_samples=1,
                                                     sampling_params=params).result())
        assert "fetches nothing from the network" in message
    outside = types.ImageAssetPointerChunk(location="/etc/passwd", format="png")
    assert "not under an allowed image directory" in bad_request(
        lambda: sampler.sample(prompt=sdk_input(vl, outside), num_samples=1, sampling_params=params).result())


def test_a_text_model_refuses_images(vl, monkeypatch):
    """Sampling answers a 400; forward_backward keeps its place in the run's order and fails in its turn. Neither
    reads an image first (issue 31, item 5: a progressive JPEG of many scans was decoded, for seconds, before a
    text model refused it): no image is decoded from base64, read from disk or checked."""
    calls: list[str] = []
    for name in ("decode_base64", "pointed_file", "checked_image"):
        real = getattr(images, name)
        monkeypatch.setattr(images, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    jpeg = types.ImageChunk(data=progressive_jpeg(16, 16, 40), format="jpeg")
    sampler = vl["client"].create_sampling_client(base_model=vl["text_model"]).result()
    message = bad_request(lambda: sampler.sample(prompt=sdk_input(vl, jpeg), num_samples=1,
                                                 sampling_params=types.SamplingParams(max_tokens=2)).result())
    assert "takes no images" in message and "prompt.chunks[1]" in message

    tc = vl["client"].create_lora_training_client(base_model=vl["text_model"], rank=4, seed=1).result()
    target, weights = targets(vl)
    datum = types.Datum(model_input=sdk_input(vl), loss_fn_inputs={"target_tokens": target, "weights": weights})
    with pytest.raises(Exception, match="takes no images"):
        tc.forward_backward([datum], "cross_entropy").result()
    assert calls == []
    text = types.Datum(model_input=types.ModelInput.from_ints(TEXT_A),
                       loss_fn_inputs={"target_tokens": np.array(TEXT_A[1:] + [1]), "weights": np.ones(5)})
    assert tc.forward_backward([text], "cross_entropy").result().metrics["loss:sum"] > 0  # the run goes on


def test_declared_positions_are_bounded_before_anything_is_made_of_them(vl):
    """Issue 31, item 2: an image declaring 10^9 positions made the server build a list of that many ids before any
    length check. An expected_tokens beyond the model's context is a 400 naming it before anything is sized from
    it: the peak of this process's traced allocations (the server runs in it) stays far below the 80 MB a list
    of 10^7 ids takes."""
    sampler = vl["client"].create_sampling_client(base_model=vl["model"]).result()
    huge = types.ImageChunk(data=vl["photo"], format="png", expected_tokens=10**7)
    tracemalloc.start()
    try:
        message = bad_request(lambda: sampler.sample(prompt=sdk_input(vl, huge), num_samples=1,
                                                     sampling_params=types.SamplingParams(max_tokens=2)).result())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a refusal"
    assert "prompt.chunks[1].expected_tokens" in message and "context" in message, message


def test_server_capabilities_say_which_model_takes_images(vl):
    """get_server_capabilities lists both models (the SDK parses it); each carries Whitney's own `vision` field."""
    caps = vl["client"].get_server_capabilities()
    assert len(caps.supported_models) == 2
    with httpx.Client(base_url=vl["server"].url, timeout=60) as http:
        models = http.get("/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-whitney-tests"}).json()
    assert [m["vision"] for m in models["supported_models"]] == [True, False]
