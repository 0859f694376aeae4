"""Image chunks on the native API (service/images.py): every refusal up front (4xx naming the chunk, the limit and
the value, nothing stored or queued), a text model's before any image is read, decoding work bounded from the
file's structure, declared sizes bounded before anything is made of them, asset pointers only under the
operator's directories, and, on a tiny vision model, training, scoring and sampling with images through a real
server."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import threading
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from tests.images import draw_image, png_with_chunks, progressive_jpeg
from tests.models import make_tiny_vision_model
from tests.service.conftest import start_server
from whitney.engine.families.vision import expander
from whitney.protocol.training import ImageInput
from whitney.service.api import images
from whitney.service.app import ServiceConfig
from whitney.service.scheduling.limits import Limits
from whitney.service.store.projects import owner_operations

# Small limits, so each is reached with small images: 50 kB and 128 x 128 pixels per image, 3 images and 60 kB
# per request.
LIMITS = Limits(max_image_bytes=50_000, max_image_pixels=128 * 128, max_request_images=3,
                max_request_image_bytes=60_000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_chunk(data: bytes, fmt: str = "png", **extra) -> dict:
    return {"type": "image", "data": b64(data), "format": fmt, **extra}


def noise_png(size: int, seed: int = 0) -> bytes:
    """An incompressible RGB PNG of size x size (about 3 bytes per pixel)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and that holds almost no data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def datum(chunks: list[dict], n: int = 4) -> dict:
    return {"input": {"chunks": chunks},
            "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [n], "values": [1] * n}}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """An allowed image directory (an image, a subdirectory, a symbolic link leading out) and a file outside it."""
    root = tmp_path_factory.mktemp("images")
    allowed, outside = root / "allowed", root / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "cat.png").write_bytes(draw_image(32, 32, 1))
    (allowed / "photo.png").write_bytes(draw_image(64, 96, 5))  # the end-to-end tests' image
    (allowed / "big.png").write_bytes(b"\x89PNG" + b"\0" * 60_000)
    (outside / "secret.png").write_bytes(draw_image(32, 32, 2))
    os.symlink(outside / "secret.png", allowed / "link.png")
    os.symlink(outside, allowed / "escape")
    return allowed, outside


@pytest.fixture(scope="module")
def srv(tmp_path_factory, vision_model, tiny_llama, dirs):
    """A server on the tiny Qwen3-VL (the default model: it takes images) and the tiny Llama (a text model) with
    one allowed image directory and LIMITS."""
    limits = Limits(**{**LIMITS.as_dict(), "image_dirs": (str(dirs[0]),)})
    server = start_server(ServiceConfig(models=[vision_model, tiny_llama],
                                        data_dir=tmp_path_factory.mktemp("img") / "data", limits=limits))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def run_id(srv) -> str:
    """A run on the vision model."""
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        return http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 2}}).json()["id"]


@pytest.fixture(scope="module")
def text_model(srv) -> str:
    return srv.app.state.whitney.models[1]


@pytest.fixture(scope="module")
def text_run(srv, text_model) -> str:
    """A run on the text model."""
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        return http.post(f"/v1/sessions/{session}/runs", json={"base_model": text_model,
                                                                "lora": {"rank": 2}}).json()["id"]


def operations(srv) -> int:
    """Every operation the server holds (no keys: all are owner '')."""
    return len(owner_operations(srv.app.state.whitney.store, "", 0, 2**40))


def nothing_stored(srv, run_id: str, before: int) -> None:
    """A refused request leaves no operation anywhere (no run's, no sample's, no scoring's)."""
    with srv.http() as http:
        assert http.get(f"/v1/runs/{run_id}/operations").json() == []
    assert operations(srv) == before


def refused(srv, run_id: str, chunks: list[dict], status: int, *words: str, field: str | None = None,
            base_model: str | None = None) -> dict:
    """Send `chunks` as a datum to forward, as a sample prompt and as a scored sequence (to `base_model`, else the
    default model): each is refused with `status`, a message holding every one of `words`, and nothing is stored."""
    before = operations(srv)
    model = {"base_model": base_model} if base_model else {}
    with srv.http() as http:
        answers = [http.post(f"/v1/runs/{run_id}/forward", json={"seq_id": 0, "data": [datum(chunks)]}),
                   http.post("/v1/samples", json={"prompt": chunks, "max_tokens": 2, **model}),
                   http.post("/v1/logprobs", json={"sequences": [[1, 2], chunks], **model})]
    for r, where in zip(answers, ("data[0].input.chunks", "prompt", "sequences[1]")):
        assert r.status_code == status, r.text
        body = r.json()
        for word in words:
            assert word in body["message"], body
        if field is not None:
            assert body["field"] == f"{where}{field}", body
    assert answers[0].json()["datum_index"] == 0
    nothing_stored(srv, run_id, before)
    return answers[0].json()


# ---- chunk types -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dmel", "audio", "video"])
def test_other_chunk_types_are_refused_naming_type_and_index(srv, run_id, kind):
    chunks = [{"type": "encoded_text", "tokens": [1, 2]}, {"type": kind, "dmel": "AAAA"}]
    body = refused(srv, run_id, chunks, 400, repr(kind), "[1]", field="[1].type")
    assert ("audio" in body["message"]) == (kind != "video")


def test_token_ids_and_chunks_together_or_neither_are_refused(srv, run_id):
    text = [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]
    before = operations(srv)
    with srv.http() as http:
        for model_input in ({"token_ids": [1, 2, 3, 4], "chunks": text}, {}):
            body = {"seq_id": 0, "data": [{**datum(text), "input": model_input}]}
            r = http.post(f"/v1/runs/{run_id}/forward", json=body)
            assert r.status_code == 400 and r.json()["field"] == "data[0].input", r.text
            assert "token_ids or chunks" in r.json()["message"]
    nothing_stored(srv, run_id, before)


def test_text_chunks_alone_equal_token_ids(srv, run_id):
    """Chunks of text only are the same input as their token ids concatenated (here: the same log-probs)."""
    with srv.http() as http:
        plain = http.post("/v1/logprobs", json={"base_model": srv.app.state.whitney.models[0],
                                                 "sequences": [[5, 6, 7, 8]]}).json()
        chunked = http.post("/v1/logprobs", json={"sequences": [[{"type": "encoded_text", "tokens": [5, 6]},
                                                                  {"type": "encoded_text", "tokens": [7, 8]}]]}).json()
        a, b = (http.get(f"/v1/operations/{op['id']}?wait=30").json() for op in (plain, chunked))
    assert a["status"] == b["status"] == "succeeded", (a, b)
    assert a["result"] == b["result"]


def test_a_malformed_chunk_is_a_422_naming_its_field(srv, run_id):
    before = operations(srv)
    with srv.http() as http:
        for chunk, field in (({"type": "image", "data": b64(draw_image(8, 8)), "format": "gif"}, "format"),
                             ({"type": "image", "format": "png"}, "data"),
                             ({"type": "image_asset_pointer", "format": "png"}, "location"),
                             ({"type": "encoded_text", "tokens": [1], "extra": 1}, "extra")):
            r = http.post(f"/v1/runs/{run_id}/forward", json={"seq_id": 0, "data": [datum([chunk])]})
            assert r.status_code == 422 and r.json()["field"] == f"data.0.input.chunks.0.{field}", r.text
            r = http.post("/v1/samples", json={"prompt": [chunk]})
            assert r.status_code == 422 and r.json()["field"] == f"prompt.0.{field}", r.text
    nothing_stored(srv, run_id, before)


# ---- what an image must be ------------------------------------------------------------------------------

def count_calls(monkeypatch, *names: str) -> list[str]:
    """The names of images.py's functions (the server runs in this process) each time one is called."""
    calls: list[str] = []
    for name in names:
        real = getattr(images, name)
        monkeypatch.setattr(images, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_a_text_model_refuses_images_before_reading_any(srv, text_run, text_model, dirs, monkeypatch):
    """Issue 31, item 5: a progressive JPEG of many scans took 20 s to be refused by a text model, every image being
    decoded before the refusal. Now no image is decoded from base64, read from disk or opened: the first image
    chunk is refused, named, whatever the others hold."""
    calls = count_calls(monkeypatch, "decode_base64", "pointed_file", "checked_image")
    chunks = [{"type": "encoded_text", "tokens": [1, 2]}, image_chunk(progressive_jpeg(16, 16, 40), "jpeg"),
              image_chunk(b"not an image"), pointer(str(dirs[0] / "cat.png"))]
    refused(srv, text_run, chunks, 400, "takes no images", field="[1]", base_model=text_model)
    refused(srv, text_run, [pointer(str(dirs[0] / "big.png"))], 400, "takes no images", field="[0]",
            base_model=text_model)
    assert calls == []


@pytest.mark.parametrize("case", ["jpeg declared png", "png declared jpeg", "not an image", "truncated png",
                                  "truncated jpeg", "bad base64"])
def test_images_that_are_not_what_they_say_are_refused_naming_the_chunk(srv, run_id, case):
    png, jpeg = draw_image(40, 40, 3), draw_image(40, 40, 3, "jpeg")
    chunk = {"jpeg declared png": image_chunk(jpeg, "png"), "png declared jpeg": image_chunk(png, "jpeg"),
             "not an image": image_chunk(b"hello, world" * 10), "truncated png": image_chunk(png[:len(png) // 2]),
             "truncated jpeg": image_chunk(jpeg[:len(jpeg) // 2], "jpeg"),
             "bad base64": {"type": "image", "data": "not base64!", "format": "png"}}[case]
    words = {"jpeg declared png": ("declared format 'png'", "JPEG"),
             "png declared jpeg": ("declared format 'jpeg'", "PNG"), "bad base64": ("base64",)}.get(case, ("decode",))
    text = {"type": "encoded_text", "tokens": [1]}
    # A truncated JPEG's header is whole: the model's side finds it as it decodes the image, before queueing.
    at = "chunk 3" if case == "truncated jpeg" else "[3]"
    refused(srv, run_id, [text, image_chunk(png), text, chunk], 400, at, *words)


def test_two_images_without_text_between_are_refused_naming_the_chunk(srv, run_id):
    """The models read a run of image placeholders as one image (Qwen's mrope grid, Gemma 3's image block): two
    adjacent images were an internal error; they are the client's to separate with text."""
    text, image = {"type": "encoded_text", "tokens": [1]}, image_chunk(draw_image(40, 40, 3))
    refused(srv, run_id, [text, image, image], 400, "[2]", "right after another image", field="[2]")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, for the 100 MP header
def test_image_limits_are_413s_naming_the_limit_the_chunk_and_the_value(srv, run_id):
    text = {"type": "encoded_text", "tokens": [1]}
    small = image_chunk(draw_image(16, 16))
    refused(srv, run_id, [text, image_chunk(b"\x89PNG" + b"\0" * 50_001)], 413, "max_image_bytes", "[1]", "50005",
            "50000")
    refused(srv, run_id, [text, image_chunk(draw_image(200, 100))], 413, "max_image_pixels", "[1]", "200x100",
            "20000", "16384")
    refused(srv, run_id, [small, text] * 3 + [small], 413, "max_request_images", "[6]", "3")
    noisy = [image_chunk(noise_png(128, seed)) for seed in (1, 2)]
    refused(srv, run_id, [text, noisy[0], text, noisy[1]], 413, "max_request_image_bytes", "[3]", "60000")
    # A header claiming 20000 x 20000 (400 MP: over Pillow's own bound) or 10000 x 10000: refused from the
    # header, never decoded.
    for side in (20_000, 10_000):
        refused(srv, run_id, [text, image_chunk(png_header_only(side, side))], 413, "max_image_pixels", "[1]")


def test_image_limits_count_across_a_requests_datums(srv, run_id):
    img, text = image_chunk(draw_image(16, 16)), {"type": "encoded_text", "tokens": [1]}
    before = operations(srv)
    with srv.http() as http:
        r = http.post(f"/v1/runs/{run_id}/forward", json={"seq_id": 0, "data": [datum([img, text, img]),
                                                                                  datum([img, text, img])]})
    assert r.status_code == 413 and "max_request_images" in r.json()["message"], r.text
    assert r.json()["datum_index"] == 1 and r.json()["field"] == "data[1].input.chunks[2]"
    nothing_stored(srv, run_id, before)


def test_declared_positions_are_bounded_before_anything_is_made_of_them(srv, run_id):
    """Issue 31, item 2: a 200-byte sample request declaring an image of 10^9 positions made the server build a
    list of that many ids (16 GB). An expected_tokens beyond the model's context is a 400 naming it on every
    route, found before anything is sized from it: the peak of this process's traced allocations (the server
    runs in it) stays far below the 80 MB a list of 10^7 ids takes."""
    chunks = [{"type": "encoded_text", "tokens": [1]}, image_chunk(draw_image(16, 16), expected_tokens=10**7)]
    with srv.http() as http:
        tracemalloc.start()
        try:
            r = http.post("/v1/samples", json={"prompt": chunks, "max_tokens": 2})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a refusal"
    refused(srv, run_id, chunks, 400, "expected_tokens", "10000000", "context", field="[1].expected_tokens")


def test_capabilities_show_vision_and_the_image_limits(srv):
    with srv.http() as http:
        caps = http.get("/v1/training/capabilities").json()
    assert [m["vision"] for m in caps["models"]] == [True, False]
    for name, value in LIMITS.as_dict().items():
        if "image" in name:
            assert caps["limits"][name] == value
    assert caps["features"]["image_asset_pointers"] is True
    assert "image_dirs" not in caps["limits"]  # no server path is shown


# ---- asset pointers -------------------------------------------------------------------------------------

def pointer(location: str, fmt: str = "png") -> dict:
    return {"type": "image_asset_pointer", "location": location, "format": fmt}


def test_a_pointer_under_the_allowed_directory_is_read(srv, run_id, dirs):
    """The file is read and checked: a path, a file:// URI, a path through '..' that stays inside, each read
    (its PNG bytes are found not to be the JPEG it is declared; the engine never sees the path)."""
    allowed = dirs[0]
    for location in (str(allowed / "cat.png"), f"file://{allowed / 'cat.png'}", f"file://localhost{allowed}/cat.png",
                     str(allowed / "sub" / ".." / "cat.png")):
        refused(srv, run_id, [pointer(location, "jpeg")], 400, "declared format 'jpeg'")
    refused(srv, run_id, [pointer(str(allowed / "big.png"))], 413, "max_image_bytes", "60004")


@pytest.mark.parametrize("location", ["http://example.com/cat.png", "https://example.com/cat.png",
                                      "s3://bucket/cat.png", "gs://bucket/cat.png", "data:image/png;base64,AAAA",
                                      "ftp://example.com/cat.png", "file://example.com/cat.png"])
def test_network_locations_are_refused(srv, run_id, location):
    words = ("fetches nothing from the network",) if not location.startswith("file:") else ("not a host",)
    refused(srv, run_id, [pointer(location)], 400, *words, field="[0].location")


def test_pointers_outside_the_allowed_directory_are_refused(srv, run_id, dirs):
    allowed, outside = dirs
    for location in (str(outside / "secret.png"), str(allowed / ".." / "outside" / "secret.png"),
                     str(allowed / "link.png"), str(allowed / "escape" / "secret.png"), "/etc/passwd",
                     f"file://{outside}/secret.png"):
        refused(srv, run_id, [pointer(location)], 400, "not under an allowed image directory", field="[0].location")
    for location, words in ((str(allowed / "nope.png"), "is not a file"), (str(allowed / "sub"), "is not a file"),
                            ("cat.png", "relative path"), ("", "absolute path")):
        refused(srv, run_id, [pointer(location)], 400, words, field="[0].location")


def test_without_an_image_directory_every_pointer_is_refused(make_server, vision_model, dirs):
    server = make_server(models=[vision_model])
    with server.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 2}}).json()["id"]
        assert http.get("/v1/training/capabilities").json()["features"]["image_asset_pointers"] is False
    refused(server, run, [pointer(str(dirs[0] / "cat.png"))], 400, "accepts no image asset pointers", "--image-dir")


def test_serve_refuses_an_image_dir_that_is_not_a_directory(tmp_path, capsys):
    from whitney.cli import main

    assert main(["serve", "--image-dir", str(tmp_path / "nope"), "--data-dir", str(tmp_path / "data")]) == 2
    assert "--image-dir" in capsys.readouterr().err


# ---- end to end on a tiny vision-language model ---------------------------------------------------------

@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> str:
    """A tiny random Qwen3-VL with its image processor (tests/models.py), saved offline."""
    return str(make_tiny_vision_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl", "qwen3_vl"))


@pytest.fixture(scope="module")
def vsrv(tmp_path_factory, vision_model, tiny_llama, dirs):
    """A server on the vision model and the tiny Llama, images allowed from the test directory."""
    server = start_server(ServiceConfig(models=[vision_model, tiny_llama], limits=Limits(image_dirs=(str(dirs[0]),)),
                                        data_dir=tmp_path_factory.mktemp("vl-data") / "data"))
    yield server
    server.stop()


def wait(http, op: dict) -> dict:
    done = http.get(f"/v1/operations/{op['id']}", params={"wait": 30}).json()
    assert done["status"] == "succeeded", done
    return done["result"]


def new_run(http, base_model: str, seed: int = 7) -> str:
    session = http.post("/v1/sessions", json={}).json()["id"]
    r = http.post(f"/v1/sessions/{session}/runs", json={"base_model": base_model, "lora": {"rank": 4, "seed": seed}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def image_positions(vsrv, vision_model: str, data: bytes) -> int:
    """How many positions the model's own processor gives the image (the engine's expander)."""
    return expander(vsrv.engine.load_model(vision_model)).expand(ImageInput(data, "png"), 0, 0).tokens


def vl_datum(image: dict, k: int, seed: int = 0) -> dict:
    """Text (5 tokens), the image (k positions), text (3 tokens); targets and weights over all 8 + k positions."""
    rng = np.random.default_rng(seed)
    n = 8 + k
    return {"input": {"chunks": [{"type": "encoded_text", "tokens": rng.integers(0, 49152, 5).tolist()}, image,
                                 {"type": "encoded_text", "tokens": rng.integers(0, 49152, 3).tolist()}]},
            "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [n],
                                              "values": rng.integers(0, 49152, n).tolist()},
                            "weights": {"dtype": "float32", "shape": [n],
                                        "values": [1.0] * 4 + [0.0] * (k + 1) + [1.0] * 3}}}


def test_decoding_work_is_bounded_from_the_files_structure(vsrv, vision_model, monkeypatch):
    """Issue 31, item 5: a 178 KB progressive JPEG whose one tiny scan was repeated 2,000 times cost 20 s to decode
    (a pass over the whole image per scan). A JPEG of more than MAX_JPEG_SCANS scans, or of more than
    MAX_JPEG_SEGMENTS marker segments, and a PNG of more than MAX_PNG_CHUNKS chunks (a step of the decoder in
    Python each) are 413s naming the chunk and the bound, found by walking the file's structure before Pillow
    reads it. Pillow's own progressive JPEG (10 scans) is taken, and decoded on a worker thread, never on the
    server's event loop."""
    text = {"type": "encoded_text", "tokens": [1]}
    many_segments = b"\xff\xd8" + b"\xff\xfe\x00\x02" * (images.MAX_JPEG_SEGMENTS + 1) + progressive_jpeg(16, 16)[2:]
    with vsrv.http() as http:
        for data, fmt, words in ((progressive_jpeg(16, 16, images.MAX_JPEG_SCANS), "jpeg", "progressive scans"),
                                 (many_segments, "jpeg", "marker segments"),
                                 (png_with_chunks(images.MAX_PNG_CHUNKS + 1), "png", "chunks")):
            r = http.post("/v1/samples", json={"base_model": vision_model, "prompt": [text, image_chunk(data, fmt)],
                                               "max_tokens": 1})
            assert r.status_code == 413 and r.json()["field"] == "prompt[1]", r.text
            assert words in r.json()["message"], r.text

        threads = []
        real = images.checked_image
        monkeypatch.setattr(images, "checked_image", lambda *a: threads.append(threading.current_thread()) or real(*a))
        for data, fmt in ((progressive_jpeg(16, 16), "jpeg"), (png_with_chunks(40), "png")):
            r = http.post("/v1/samples", json={"base_model": vision_model, "prompt": [text, image_chunk(data, fmt)],
                                               "max_tokens": 1})
            assert r.status_code == 202, r.text
            wait(http, r.json())
    assert len(threads) == 2 and vsrv.thread not in threads  # the server's event loop runs in vsrv.thread


def test_capabilities_say_which_model_takes_images(vsrv):
    with vsrv.http() as http:
        models = http.get("/v1/training/capabilities").json()["models"]
    assert [m["vision"] for m in models] == [True, False]


def test_forward_with_an_image_inline_or_by_pointer_and_its_length_rules(vsrv, vision_model, dirs):
    """Inline bytes, a pointer to the same file and an image without expected_tokens give the same numbers; the
    loss inputs have the expanded length, and a wrong expected_tokens or length is a 400 naming them."""
    photo = (dirs[0] / "photo.png").read_bytes()
    k = image_positions(vsrv, vision_model, photo)
    assert k > 1
    inline = image_chunk(photo, expected_tokens=k)
    by_pointer = {"type": "image_asset_pointer", "location": f"file://{dirs[0] / 'photo.png'}", "format": "png",
                  "expected_tokens": k}
    with vsrv.http() as http:
        run = new_run(http, vision_model)
        results = []
        for seq, image in enumerate((inline, by_pointer, image_chunk(photo))):
            op = http.post(f"/v1/runs/{run}/forward", json={"seq_id": seq, "data": [vl_datum(image, k)]})
            assert op.status_code == 202, op.text
            results.append(wait(http, op.json()))
        assert results[0] == results[1] == results[2]
        assert len(results[0]["outputs"][0]["logprobs"]) == 8 + k

        wrong = http.post(f"/v1/runs/{run}/forward", json={"seq_id": 3, "data": [
            vl_datum(inline, k), vl_datum(image_chunk(photo, expected_tokens=k + 1), k)]})
        assert wrong.status_code == 400 and wrong.json()["datum_index"] == 1, wrong.text
        assert all(w in wrong.json()["message"] for w in ("chunk 1", str(k), str(k + 1))), wrong.text
        short = vl_datum(inline, k)
        short["loss_inputs"] = {"target_tokens": {"dtype": "int64", "shape": [7 + k], "values": [1] * (7 + k)}}
        r = http.post(f"/v1/runs/{run}/forward", json={"seq_id": 3, "data": [vl_datum(inline, k), short]})
        assert r.status_code == 400 and r.json()["datum_index"] == 1, r.text
        assert str(7 + k) in r.json()["message"] and str(8 + k) in r.json()["message"], r.text
        assert len(http.get(f"/v1/runs/{run}/operations").json()) == 3  # the refusals queued nothing


def test_a_mixed_batch_equals_each_datum_alone_and_scoring_agrees(vsrv, vision_model, dirs):
    """An image datum and a text datum in one forward equal each alone; compute_logprobs of the same sequence
    (the scoring path) gives the forward's log-probs where the target is the next token."""
    photo = (dirs[0] / "photo.png").read_bytes()
    k = image_positions(vsrv, vision_model, photo)
    image, text = vl_datum(image_chunk(photo), k, seed=1), {
        "input": {"token_ids": [3, 5, 7, 11]},
        "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [4], "values": [5, 7, 11, 13]}}}
    with vsrv.http() as http:
        run = new_run(http, vision_model)
        ops = [http.post(f"/v1/runs/{run}/forward", json={"seq_id": i, "data": data}).json()
               for i, data in enumerate(([image, text], [image], [text]))]
        both, alone_image, alone_text = (wait(http, op) for op in ops)
        np.testing.assert_allclose(both["outputs"][0]["logprobs"], alone_image["outputs"][0]["logprobs"], atol=1e-5)
        np.testing.assert_allclose(both["outputs"][1]["logprobs"], alone_text["outputs"][0]["logprobs"], atol=1e-5)

        # The same sequence scored (the fresh run's LoRA is zero, so the base model scores the same) and run
        # forward with each next text token as its target: position t + 1 of the scores is the forward's t.
        chunks = image["input"]["chunks"]
        a, b = chunks[0]["tokens"], chunks[2]["tokens"]
        targets = a[1:] + [0] * k + b + [0]  # [8 + k]: 0 where the next position is an image's (or none)
        shifted = {"input": {"chunks": chunks},
                   "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [8 + k], "values": targets}}}
        fwd = wait(http, http.post(f"/v1/runs/{run}/forward", json={"seq_id": 3, "data": [shifted]}).json())
        scored = wait(http, http.post("/v1/logprobs", json={"base_model": vision_model, "sequences": [chunks]}).json())
    lp, fwd_lp = scored["logprobs"][0], fwd["outputs"][0]["logprobs"]
    assert len(lp) == 8 + k and lp[0] is None and all(v is None for v in lp[5:5 + k])  # images are not predicted
    np.testing.assert_allclose(lp[1:5], fwd_lp[0:4], atol=1e-5)
    np.testing.assert_allclose(lp[5 + k:], fwd_lp[4 + k:7 + k], atol=1e-5)


def test_sample_with_an_image_and_train_on_it(vsrv, vision_model, dirs):
    """Greedy sampling with an image prompt: the sampled tokens' log-probs equal compute_logprobs of the prompt
    followed by them; a few steps of training on an image datum lower its loss, and the new sampler version
    samples with the image too."""
    photo = (dirs[0] / "photo.png").read_bytes()
    k = image_positions(vsrv, vision_model, photo)
    prompt = [{"type": "encoded_text", "tokens": [1, 2, 3]}, image_chunk(photo),
              {"type": "encoded_text", "tokens": [4]}]
    with vsrv.http() as http:
        out = wait(http, http.post("/v1/samples", json={"base_model": vision_model, "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0.0, "prompt_logprobs": True, "stop": []}).json())
        seq = out["sequences"][0]
        assert len(seq["tokens"]) == 4 and len(out["prompt_logprobs"]) == 4 + k
        scored = wait(http, http.post("/v1/logprobs", json={"base_model": vision_model, "sequences": [
            prompt + [{"type": "encoded_text", "tokens": seq["tokens"]}]]}).json())["logprobs"][0]
        np.testing.assert_allclose(scored[4 + k:], seq["logprobs"], atol=1e-4)
        assert [v is None for v in scored[:4 + k]] == [v is None for v in out["prompt_logprobs"]]

        run = new_run(http, vision_model)
        data = [vl_datum(image_chunk(photo), k, seed=2)]
        losses = []
        for step in range(3):
            losses.append(wait(http, http.post(f"/v1/runs/{run}/forward_backward",
                                               json={"seq_id": 2 * step, "data": data}).json())["loss"])
            wait(http, http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 2 * step + 1,
                                                                     "adam_params": {"learning_rate": 0.02}}).json())
        assert losses[-1] < losses[0], losses
        saved = http.post(f"/v1/runs/{run}/save_weights_for_sampler", json={"seq_id": 6}).json()
        version = wait(http, saved)["version"]
        tuned = wait(http, http.post("/v1/samples", json={"run_id": run, "version": version, "prompt": prompt,
                                                         "max_tokens": 2, "seed": 0}).json())
    assert len(tuned["sequences"][0]["tokens"]) >= 1


def test_images_are_decoded_before_queueing_at_a_low_priority_never_on_the_worker(vsrv, vision_model, monkeypatch):
    """Issue 31: a sample of large images held the worker thread (decoding and processing them) while every run's
    training waited behind it. Each image is decoded and processed once, before the request is queued (a sample's
    and a scoring's too, so their expanded length is known then), on a heavy-check thread whose CPU priority is
    lowered (http/heavy.py), and the worker finds it processed: the worker thread never decodes one."""
    from whitney.engine.families.vision import ImageExpander
    from whitney.priority import LOWERED_NICE

    decoded, real = [], ImageExpander._process

    def process(self, *args):
        decoded.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(self, *args)

    images = [draw_image(64, 64, seed) for seed in (901, 902, 903)]  # processed by no test before
    k = image_positions(vsrv, vision_model, images[2])
    monkeypatch.setattr(ImageExpander, "_process", process)
    fresh = [image_chunk(data) for data in images]
    text = {"type": "encoded_text", "tokens": [1, 2]}
    with vsrv.http() as http:  # wait(): each succeeds
        wait(http, http.post("/v1/samples", json={"base_model": vision_model, "prompt": [text, fresh[0]],
                                                  "max_tokens": 2}).json())
        wait(http, http.post("/v1/logprobs", json={"base_model": vision_model,
                                                   "sequences": [[text, fresh[1], text]]}).json())
        run = new_run(http, vision_model)
        wait(http, http.post(f"/v1/runs/{run}/forward_backward", json={"seq_id": 0,
                                                                       "data": [vl_datum(fresh[2], k)]}).json())
    assert len(decoded) == 2, decoded
    assert all(name.startswith("whitney-heavy") and nice >= LOWERED_NICE for name, nice in decoded), decoded
