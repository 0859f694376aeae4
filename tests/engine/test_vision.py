"""Images in (engine/vision.py): vision-language checkpoints (Qwen3.5, Qwen3-VL, Gemma 3) score, train and sample
with image chunks, checked against the Hugging Face model's own forward on the same processed inputs and against a
float64 HF + PEFT reference."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from tests.images import draw_image
from tests.models import VISION_KINDS, built_on_first_use, make_tiny_vision_model, unique_id
from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.families.vision import expander
from whitney.protocol.training import Checked, ImageInput

ATOL = 1e-5
LORA = LoraConfig(rank=4, alpha=8.0, seed=3)
VOCAB = 49152  # the SmolLM2 ids; the added image tokens sit above them


@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory):
    return built_on_first_use(tmp_path_factory.mktemp("vision"), make_tiny_vision_model)


@pytest.fixture(params=list(VISION_KINDS))
def vision_model(request, vision_dirs) -> str:
    return vision_dirs(request.param)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", compute_dtype="float32")


_rid = unique_id


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _image(seed: int, width: int = 64, height: int = 96, fmt: str = "png") -> ImageInput:
    return ImageInput(draw_image(width, height, seed, fmt), fmt)


def _chunked(seed: int) -> list:
    """Text, an image, text, a second image (JPEG, another size), text."""
    return [_tokens(5, seed), _image(seed), _tokens(4, seed + 1), _image(seed + 1, 48, 48, "jpeg"),
            _tokens(3, seed + 2)]


def _hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


def _hf_inputs(engine: Engine, path: str, seq: list) -> dict:
    """The same processed inputs as the model's own forward takes them: input_ids [1, N], pixel values, and Qwen's
    image grids and mm_token_type_ids or Gemma 3's token_type_ids."""
    base = engine.load_model(path)
    flat, images = expander(base).flatten(seq, 0)
    ids = torch.tensor([flat])
    is_image = (ids == base.vision.image_token_id).long()
    if not images:
        return dict(input_ids=ids)
    pixels = torch.cat([im.pixel_values for im in images])
    if base.vision.family == "gemma3":
        return dict(input_ids=ids, pixel_values=pixels, token_type_ids=is_image)
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.stack([im.grid_thw for im in images]),
                mm_token_type_ids=is_image)


def _hf_logprobs(model, inputs: dict) -> torch.Tensor:
    """log p(x[t+1] | x[:t+1]) for t < N - 1 under the model's own forward, [N - 1] float64."""
    logits = model(**inputs).logits[0, :-1].double()
    ids = inputs["input_ids"][0, 1:]
    return torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]


def test_loads_the_vision_tower_frozen_and_adapts_the_language_model_only(engine, vision_model):
    base = engine.load_model(vision_model)
    assert base.vision is not None
    assert all(not p.requires_grad for p in base.vision.model.parameters())
    assert not any("visual" in p or "vision" in p or "projector" in p or "merger" in p for p in base.linear_shapes)
    # the language model the vision module runs is the very decoder the general path runs (no weight twice)
    assert base.vision.model.language_model is base.hf.get_submodule(base.hf_decoder)
    from whitney.backends.in_process import model_info

    assert model_info(base, "m").vision


def test_logprobs_with_images_equal_hf(engine, vision_model):
    """compute_logprobs of sequences with two images equals the HF model's forward on the same processed inputs;
    positions that would predict an image are None."""
    seqs = [_chunked(1), _chunked(4)]
    ours = engine.compute_logprobs(seqs, base_model=vision_model)
    model = _hf(vision_model)
    base = engine.load_model(vision_model)
    for seq, o in zip(seqs, ours):
        inputs = _hf_inputs(engine, vision_model, seq)
        with torch.no_grad():
            theirs = _hf_logprobs(model, inputs)
        target_is_image = (inputs["input_ids"][0, 1:] == base.vision.image_token_id)
        assert len(o) == inputs["input_ids"].shape[1] and o[0] is None
        assert all((v is None) == bool(m) for v, m in zip(o[1:], target_is_image))
        got = torch.tensor([v for v in o[1:] if v is not None], dtype=torch.float64)
        torch.testing.assert_close(got, theirs[~target_is_image], atol=ATOL, rtol=0)
        # the image changes the text after it: not the same as the text alone with placeholders
        assert float(theirs.std()) > 0.1


def test_image_changes_the_logprobs(engine, vision_model):
    """Two different images in the same place give different log-probs after them (the features reach the text)."""
    a = engine.compute_logprobs([[_tokens(3, 0), _image(1), _tokens(4, 2)]], base_model=vision_model)[0]
    b = engine.compute_logprobs([[_tokens(3, 0), _image(7), _tokens(4, 2)]], base_model=vision_model)[0]
    assert max(abs(x - y) for x, y in zip(a[-3:], b[-3:])) > 1e-3


def _data(seqs: list[list], engine: Engine, path: str) -> list[Datum]:
    """Datums over the expanded length: targets the next id (image positions weighted 0), random weights."""
    base = engine.load_model(path)
    g = torch.Generator().manual_seed(1)
    out = []
    for s in seqs:
        flat, _ = expander(base).flatten(s, 0)
        targets = flat[1:] + [0]
        weights = (torch.rand(len(flat), generator=g) + 0.5).tolist()
        weights = [0.0 if t == base.vision.image_token_id else w for t, w in zip(targets, weights)]
        weights[-1] = 0.0
        targets = [0 if t == base.vision.image_token_id else t for t in targets]
        out.append(Datum(s, {"target_tokens": targets, "weights": weights}))
    return out


def _randomise_b(engine: Engine, run_id: str, seed: int = 11) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in engine.get_run(run_id).adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def _onto_full_model(adapter_dir) -> None:
    """A Qwen3.5 export names the text model's modules (model.layers...): renamed for the full multimodal model
    (model.language_model.layers...), which takes images."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    weights = load_file(str(path))
    save_file({k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): v
               for k, v in weights.items()}, str(path))


def test_lora_gradients_with_images_equal_float64_peft(engine, vision_model, tmp_path):
    """forward_backward on image datums: loss and every LoRA gradient equal a float64 HF + PEFT model (PEFT on the
    language model's linears) on the same processed inputs."""
    from peft import PeftModel

    from tests.engine.test_general_path import peft_lora_grads

    run_id = _rid("grad")
    engine.create_run(run_id, vision_model, LORA)
    _randomise_b(engine, run_id)
    data = _data([_chunked(2), [_tokens(6, 9)], [_image(3), _tokens(5, 5)]], engine, vision_model)
    result = engine.forward_backward(run_id, data)
    engine.export_lora(run_id, str(tmp_path / "a"))
    if engine.load_model(vision_model).hf_decoder == "model":  # Qwen3.5: served as its text model's paths
        _onto_full_model(tmp_path / "a")
    model = PeftModel.from_pretrained(_hf(vision_model, torch.float64), str(tmp_path / "a"), is_trainable=True)
    model.double()
    total = 0.0
    for d in data:
        inputs = _hf_inputs(engine, vision_model, d.token_ids)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].double()
        logits = model(**inputs).logits[0]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.loss_inputs["target_tokens"])[:, None])[:, 0]
        total = total - (torch.tensor(d.loss_inputs["weights"], dtype=torch.float64) * lp).sum()
    total.backward()
    ref = peft_lora_grads(model)
    ours = engine.get_run(run_id).grads
    ref = {k.replace("model.language_model.", "model.", 1) if k not in ours else k: v for k, v in ref.items()}
    assert set(ours) == set(ref)
    assert result.loss == pytest.approx(float(total.detach()), rel=1e-5)
    for name, g in ours.items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(g.double(), ref[name], rtol=1e-4, atol=1e-5 * float(ref[name].abs().max()))


def test_mixed_batch_of_image_and_text_rows_and_two_runs_equals_each_alone(engine, vision_model):
    """Image rows, text rows and two runs in one batch: each request's log-probs and loss equal it run alone."""
    from whitney.protocol.training import ForwardRequest

    runs = [_rid("mix"), _rid("mix")]
    for i, r in enumerate(runs):
        engine.create_run(r, vision_model, LoraConfig(rank=4, alpha=8.0, seed=3 + i))
        _randomise_b(engine, r, seed=20 + i)
    requests = [ForwardRequest(runs[0], _data([_chunked(3), [_tokens(11, 1)]], engine, vision_model)),
                ForwardRequest(runs[1], _data([[_tokens(4, 2)], [_tokens(2, 3), _image(5, 32, 64)]], engine,
                                              vision_model)),
                ForwardRequest(runs[1], _data([[_tokens(7, 4)]], engine, vision_model))]
    together = engine.run_batch(requests, backward=False)
    for request, got in zip(requests, together):
        for d, out in zip(request.data, got.outputs):
            (alone,) = engine.run_batch([ForwardRequest(request.run_id, [d])], backward=False)
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone.outputs[0].logprobs),
                                       atol=ATOL, rtol=0)


# ---- sampling with images in the prompt --------------------------------------------------------------------------


def test_sampler_logprobs_equal_compute_logprobs_for_image_prompts(engine, vision_model):
    """Sampling from a prompt with images: its prompt log-probs and every sampled token's log-prob equal
    compute_logprobs of the prompt and the sampled tokens (None at the image positions in both)."""
    from whitney.protocol.sampling import SamplingParams

    prompt = [_tokens(4, 3), _image(2), _tokens(3, 4)]
    result = engine.sample(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=(), num_samples=2,
                                                  prompt_logprobs=True), base_model=vision_model)
    assert result.sequences[0].tokens != result.sequences[1].tokens  # two rows copied from one prefill
    for seq in result.sequences:
        scored = engine.compute_logprobs([prompt + [seq.tokens]], base_model=vision_model)[0]
        P = len(result.prompt_logprobs)
        assert P + len(seq.tokens) == len(scored)
        assert [v is None for v in result.prompt_logprobs] == [v is None for v in scored[:P]]
        assert sum(v is None for v in scored) == 1 + expander(engine.load_model(vision_model)).expand(
            _image(2), 0, 1).tokens
        for a, b in zip(result.prompt_logprobs + seq.logprobs, scored):
            if a is not None:
                assert a == pytest.approx(b, abs=ATOL)


def _hf_generate(engine: Engine, path: str, prompt: list, n: int) -> list[int]:
    model = _hf(path)
    inputs = _hf_inputs(engine, path, prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_sampling_with_an_image_equals_hf_generate(engine, vision_model):
    """Greedy decoding from an image prompt (base weights) equals the HF model's own generate on the same processed
    inputs (its mrope deltas, Gemma 3's image block in the cache)."""
    from whitney.protocol.sampling import SamplingParams

    prompt = [_tokens(3, 8), _image(9), _tokens(2, 10)]
    ours = engine.sample(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=()), base_model=vision_model)
    assert ours.sequences[0].tokens == _hf_generate(engine, vision_model, prompt, 8)


def test_image_and_text_prompts_decode_together_as_alone(engine, vision_model):
    """Prompts of different lengths, with and without images, of two sampler versions, decoding in one batch
    (left-padded, each Qwen row with its own mrope delta) choose the tokens and log-probs each chooses alone."""
    from whitney.protocol.sampling import SamplingParams

    run_id = _rid("smp")
    engine.create_run(run_id, vision_model, LORA)
    _randomise_b(engine, run_id)
    version = engine.save_weights_for_sampler(run_id)
    prompts = [([_tokens(2, 1), _image(4), _tokens(5, 2)], {"base_model": vision_model}),
               ([_tokens(9, 3)], {"run_id": run_id, "version": version}),
               ([_image(6, 48, 48, "jpeg"), _tokens(2, 4)], {"run_id": run_id, "version": version}),
               (_tokens(4, 5), {"base_model": vision_model})]
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=())
    alone = [engine.sample(p, params, **w).sequences[0] for p, w in prompts]
    requests = [engine.submit_sample(p, params, **w) for p, w in prompts]
    while not all(r.done for r in requests):
        engine.sample_step()
    for a, r in zip(alone, requests):
        assert r.error is None
        got = r.result.sequences[0]
        assert got.tokens == a.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


# ---- what is refused ---------------------------------------------------------------------------------------------


def _refused(fn, *needles: str):
    from whitney.errors import InvalidInput

    with pytest.raises(InvalidInput) as e:
        fn()
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return e.value


def test_refusals_name_the_datum_chunk_and_counts(engine, vision_dirs, tiny_llama):
    path = vision_dirs("qwen3_5")
    base = engine.load_model(path)
    n = expander(base).expand(_image(1), 0, 1).tokens
    bad_count = [_tokens(3, 1), ImageInput(draw_image(64, 96, 1), "png", expected_tokens=n + 1)]
    e = _refused(lambda: engine.forward(None, [Datum(bad_count, {"target_tokens": [0] * (3 + n)})],
                                        base_model=path), "datum 0: chunk 1", f"expected_tokens is {n + 1}", str(n))
    assert e.field == "model_input"
    ok = [_tokens(3, 1), ImageInput(draw_image(64, 96, 1), "png", expected_tokens=n)]
    from whitney.protocol.training import ForwardRequest

    request = ForwardRequest(None, [Datum(ok, {"target_tokens": [0] * (3 + n)})], base_model=path)
    assert engine.validate(request, backward=False) == Checked([3 + n], [3 + n])  # the expanded length
    _refused(lambda: engine.forward(None, [Datum(ok, {"target_tokens": [0] * 3})], base_model=path),
             "datum 0", f"[{3 + n}]", "[3]")  # targets must have the expanded length
    corrupt = [_tokens(2, 1), ImageInput(draw_image(64, 64, 1)[:60], "png")]
    _refused(lambda: engine.compute_logprobs([corrupt], base_model=path), "chunk 1", "cannot be decoded")
    wrong = [_tokens(2, 1), ImageInput(draw_image(64, 64, 1, "jpeg"), "png")]
    _refused(lambda: engine.compute_logprobs([wrong], base_model=path), "chunk 1", "declared png", "JPEG")
    for adjacent in ([_tokens(2, 1), _image(1), _image(2)], [_tokens(2, 1), _image(1), [], _image(2)]):
        _refused(lambda: engine.compute_logprobs([adjacent], base_model=path), f"chunk {len(adjacent) - 1}",
                 "right after another image")
    placeholder = [_tokens(2, 1) + [base.vision.image_token_id], _image(1)]
    _refused(lambda: engine.compute_logprobs([placeholder], base_model=path), "image placeholder")
    e = _refused(lambda: engine.compute_logprobs([[_tokens(2, 1), _image(1)]], base_model=tiny_llama),
                 "takes no images")
    assert e.field == "model_input"
    from whitney.protocol.sampling import SamplingParams

    _refused(lambda: engine.sample([_tokens(2, 1), _image(1)], SamplingParams(max_tokens=2), base_model=tiny_llama),
             "takes no images")
    _refused(lambda: engine.forward(None, [Datum(ok, {"target_tokens": [0] * (3 + n)})], loss_fn="opsd",
                                    base_model=path), "datum 0", "opsd", "image chunks")


def test_the_projector_is_not_adaptable(engine, vision_dirs):
    """Qwen's merger (linear_fc1/linear_fc2) and the vision tower's own linears are no LoRA target: naming them is a
    400 listing what is adaptable."""
    path = vision_dirs("qwen3_5")
    assert any(n.endswith("merger.linear_fc1") for n, _ in engine.load_model(path).vision.model.named_modules())
    e = _refused(lambda: engine.create_run(_rid("proj"), path, LoraConfig(rank=4, target_modules=("linear_fc1",))),
                 "unknown module 'linear_fc1'")
    assert e.field == "target_modules"


def test_gemma3_image_positions_are_its_processors(engine, vision_dirs):
    """Gemma 3's own processor (AutoProcessor, offline) puts as many <image_soft_token> between <start_of_image> and
    <end_of_image> as an image chunk occupies."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    path = vision_dirs("gemma3")
    base = engine.load_model(path)
    processor = AutoProcessor.from_pretrained(path)
    ids = processor(text="hi <start_of_image> there", images=[Image.open(io.BytesIO(draw_image(40, 30, 2)))],
                    return_tensors="pt")["input_ids"][0].tolist()
    n = expander(base).expand(_image(2, 40, 30), 0, 0).tokens
    boi, eoi = ids.index(base.hf.config.boi_token_index), ids.index(base.hf.config.eoi_token_index)
    assert ids[boi + 1:eoi] == [base.vision.image_token_id] * n and n == base.hf.config.mm_tokens_per_image


def test_bfloat16_scores_and_samples_images_close_to_float32(vision_model):
    """In bfloat16 (vision tower and decoder) image log-probs stay within bfloat16's error of float32's."""
    from whitney.protocol.sampling import SamplingParams

    seq = _chunked(2)
    full = Engine(device="cpu", compute_dtype="float32").compute_logprobs([seq], base_model=vision_model)[0]
    half_engine = Engine(device="cpu", compute_dtype="bfloat16")
    half = half_engine.compute_logprobs([seq], base_model=vision_model)[0]
    assert [v is None for v in full] == [v is None for v in half]
    assert max(abs(a - b) for a, b in zip(full, half) if a is not None) < 0.05
    out = half_engine.sample(seq, SamplingParams(max_tokens=3, temperature=0.0, stop=()), base_model=vision_model)
    assert len(out.sequences[0].tokens) == 3


def test_sampling_validate_counts_an_image_chunk_by_its_expected_tokens(engine, vision_dirs):
    """The service's check of a prompt with chunks (before the engine expands it): token chunks are checked as
    ids, an image counts its expected_tokens against the context."""
    from whitney.backends.in_process import model_info
    from whitney.errors import InvalidInput
    from whitney.protocol.sampling import SamplingParams, validate

    info = model_info(engine.load_model(vision_dirs("gemma3")), "g")
    image = ImageInput(draw_image(8, 8, 0), "png", expected_tokens=400)
    validate([[1, 2], image], SamplingParams(max_tokens=100), info, 4)
    with pytest.raises(InvalidInput, match="exceeds the model's context of 512"):
        validate([[1, 2], image], SamplingParams(max_tokens=111), info, 4)
    with pytest.raises(InvalidInput, match="token ids must be integers"):
        validate([[1, -2], image], SamplingParams(max_tokens=1), info, 4)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_large_images_decoded_on_request_threads_leave_no_memory_behind(engine, vision_dirs):
    """Issue 31: each request thread that decoded a large image kept its freed buffers in its own malloc arena (the
    hostile benchmark's server grew by hundreds of MB). Decoding an image of RELEASE_PIXELS or more gives freed
    memory back: four threads, each decoding a different 4096 x 4096 image (48 MiB of RGB each), leave the process
    about as large as before. And they take turns: at most DECODING_PIXELS pixels (one such image) are being
    decoded at once (an image over that alone), so the buffers of four decodes are never resident together."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    from whitney.engine.families.vision import DECODING, DECODING_PIXELS, ProcessedImages

    def jpeg(seed: int) -> ImageInput:
        out = io.BytesIO()
        Image.linear_gradient("L").rotate(seed).resize((4096, 4096)).convert("RGB").save(out, format="JPEG")
        return ImageInput(out.getvalue(), "jpeg")

    images = [jpeg(seed) for seed in (10, 20, 30, 40)]
    expand = expander(engine.load_model(vision_dirs("qwen3_vl")))
    expand.vision.processed = ProcessedImages()  # none of these is processed already
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda im: expand.expand(im, None, 1), images[:1]))  # the threads' arenas exist
        before, DECODING.most = _rss_mib(), 0
        list(pool.map(lambda im: expand.expand(im, None, 1), images))
        grown = _rss_mib() - before
    assert grown < 100, f"{grown:.0f} MiB kept after decoding"
    assert DECODING.most == 4096 * 4096 > DECODING_PIXELS  # each over the budget: one at a time, alone


@pytest.mark.parametrize("size", [(300, 200), (64, 96), (1000, 37), (17, 23), (2048, 1536)])
def test_presizing_before_the_processor_changes_no_pixel(engine, vision_model, size):
    """A large image is resized by Pillow to the processor's own target size before the processor sees it (its
    full-size array copies are never made): the processed pixels are bitwise the processor's own on the full image,
    for each family's processor, including sizes where Qwen's smart_resize is not idempotent (1000 x 37)."""
    from PIL import Image

    expand = expander(engine.load_model(vision_model))
    processor = expand.vision.image_processor
    image = Image.open(io.BytesIO(draw_image(64, 64, 2))).convert("RGB").resize(size)
    own = processor(images=[image], return_tensors="pt")["pixel_values"]
    presized = processor(images=[expand._presized(image, "prompt: chunk 1", None)], return_tensors="pt")
    assert torch.equal(presized["pixel_values"], own)


def test_an_aspect_ratio_the_processor_refuses_is_a_400_naming_the_chunk(engine, vision_dirs):
    """Qwen's processor raises ValueError past an aspect ratio of 200: that was an internal error."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (600, 2), (10, 20, 30)).save(out, format="PNG")
    thin = [_tokens(2, 1), ImageInput(out.getvalue(), "png")]
    e = _refused(lambda: engine.compute_logprobs([thin], base_model=vision_dirs("qwen3_vl")), "chunk 1",
                 "aspect ratio", "600 x 2")
    assert e.field == "model_input" and e.datum_index == 0, e.to_dict()
