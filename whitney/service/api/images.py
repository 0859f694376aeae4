"""Image chunks at the edge: wire chunks in, the engine's `ImageInput`s out, every limit checked first.

A model input on either API is token ids or a list of typed chunks (Tinker's type names):
`encoded_text` (token ids), `image` (encoded PNG or JPEG bytes) and `image_asset_pointer` (a file on
this server, under a directory the operator allowed with `whitney serve --image-dir DIR`). Any other
type (audio: Tinker's `dmel`) is a 400 naming the chunk. The service never decodes an image: it checks
what needs no decoding (below); then, before anything is stored or queued, the model's side decodes and
processes each image once (`process_images`, Backend.validate), on a heavy-check thread at a low CPU
priority (http/heavy.py), where bytes that do not decode are a 400 naming the chunk.

Order of the checks, cheapest first, so that no work is done for an image that is refused anyway: a model
that takes no images (`ImageBudget.model`) refuses every image chunk before its bytes are decoded from base64
or read from disk; then the declared numbers (expected_tokens: at most the model's context); then the
encoded bytes; then the file's structure, walked without decoding (`check_structure`: a JPEG's markers, a
PNG's chunks), which refuses a progressive JPEG of more than MAX_JPEG_SCANS scans (each scan is a pass of
the decoder over the whole image: 2,000 tiny scans made a 178 KB JPEG cost 20 s to decode) and files of more
than MAX_JPEG_SEGMENTS segments or MAX_PNG_CHUNKS chunks (each costs the decoder a step in Python); then the
header (format, width x height; a PNG's chunk checksums); all of it off the event loop (the routes that call
this are sync routes or call it through run_in_threadpool).

Limits (`Limits`, each a `whitney serve --max-...` flag): bytes per image, pixels per image (read from
the header, before any decoding, which also keeps decompression bombs out), images and image bytes per
request. Beyond one: a 413 naming the limit, the chunk and the value.

Asset pointers: an absolute path or a `file://` URI (no host, or `localhost`), resolved with
`os.path.realpath` (so `..` and symbolic links are followed to where they really lead) and accepted
only when that real path is a regular file inside the real path of an allowed directory. Any other
scheme (http, https, s3, gs, data, ...) is a 400: the server fetches nothing from the network.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from PIL import Image, UnidentifiedImageError

from whitney.errors import InvalidInput, TooLarge
from whitney.protocol.backend import ModelInfo
from whitney.protocol.training import IMAGE_AFTER_IMAGE, Datum, ImageInput
from whitney.service.scheduling.limits import Limits

FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # wire name -> Pillow's name
TEXT, IMAGE, POINTER = "encoded_text", "image", "image_asset_pointer"
CHUNK_TYPES = (TEXT, IMAGE, POINTER)

Chunks = list  # list[list[int] | ImageInput]: what the engine takes wherever it took token ids

# Decoding work, bounded from the file's structure before Pillow reads it. libjpeg's progressive JPEGs have
# 10 scans (6 in grey), mozjpeg's and Photoshop's about as many; every scan is one more decoding pass.
MAX_JPEG_SCANS = 64
MAX_JPEG_SEGMENTS = 1024  # marker segments (APPn, DQT, DHT, SOF, SOS, ...): a photo has tens
MAX_PNG_CHUNKS = 8192  # a 10 MiB PNG written in libpng's 8 KiB IDAT chunks has 1,280
_JPEG_MARKER = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")  # a marker: not a stuffed 0xFF, a restart or a fill byte
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class ImageBudget:
    """What one request's images have used so far, against the per-request limits. `model`: the model the images
    are for (its name as the request gave it in `model_name`): a model without vision refuses every image chunk
    before reading it, and no image may declare more positions than its context. None: not known here (the
    image limits only; the caller refuses images for a text model itself)."""

    limits: Limits
    model: ModelInfo | None = None
    model_name: str = ""
    images: int = 0
    bytes: int = 0

    def admit_image(self, where: str, datum_index: int | None = None) -> None:
        """Refuse an image chunk for a model that takes no images, before anything of it is read."""
        if self.model is not None and not self.model.vision:
            raise InvalidInput(f"{where}: base model {self.model_name or self.model.name} takes no images",
                               field=where, datum_index=datum_index)

    def add(self, size: int, where: str) -> None:
        self.images += 1
        self.bytes += size
        if self.images > self.limits.max_request_images:
            raise TooLarge(f"{where}: the request holds more than {self.limits.max_request_images} images "
                           "(max_request_images)", field=where)
        if self.bytes > self.limits.max_request_image_bytes:
            raise TooLarge(f"{where}: the request's images reach {self.bytes} bytes; the limit is "
                           f"{self.limits.max_request_image_bytes} per request (max_request_image_bytes)", field=where)


def check_expected_tokens(expected_tokens, where: str, budget: ImageBudget) -> None:
    """A declared expected_tokens: a positive integer, at most the model's context (else max_operation_tokens,
    the most positions any request may hold), checked before anything is sized from it."""
    if expected_tokens is None:
        return
    field = f"{where}.expected_tokens"
    if not isinstance(expected_tokens, int) or isinstance(expected_tokens, bool) or expected_tokens < 1:
        raise InvalidInput(f"{field} must be a positive integer, got {expected_tokens!r}", field=field)
    if budget.model is not None and expected_tokens > budget.model.max_context:
        raise InvalidInput(f"{field} is {expected_tokens}, more positions than the model's context of "
                           f"{budget.model.max_context}", field=field)
    if expected_tokens > budget.limits.max_operation_tokens:
        raise TooLarge(f"{field} is {expected_tokens}; no request may hold more than "
                       f"{budget.limits.max_operation_tokens} positions (max_operation_tokens)", field=field)


def check_structure(data: bytes, where: str) -> None:
    """The decoding work an encoded image asks for, read from its structure without decoding it: a JPEG's scans
    (at most MAX_JPEG_SCANS) and marker segments (MAX_JPEG_SEGMENTS), a PNG's chunks (MAX_PNG_CHUNKS). Each walk
    stops at its cap; anything it cannot follow is left to Pillow, which refuses it (a 400)."""
    if data.startswith(b"\xff\xd8"):
        scans = segments = 0
        pos = 2
        while (m := _JPEG_MARKER.search(data, pos)) is not None:
            marker, pos = m.group()[-1], m.end()
            if marker == 0xD9:  # end of image
                return
            segments += 1
            scans += marker == 0xDA
            if scans > MAX_JPEG_SCANS:
                raise TooLarge(f"{where}: the JPEG has more than {MAX_JPEG_SCANS} progressive scans (each one a "
                               "decoding pass over the whole image)", field=where)
            if segments > MAX_JPEG_SEGMENTS:
                raise TooLarge(f"{where}: the JPEG has more than {MAX_JPEG_SEGMENTS} marker segments", field=where)
            if marker not in (0x01, 0xD8):  # TEM and SOI stand alone; every other marker has a length
                pos += int.from_bytes(data[pos:pos + 2], "big")  # past the segment (SOS: its header; the data
                # that follows is searched for the next marker)
    elif data.startswith(_PNG_SIGNATURE):
        pos, chunks = len(_PNG_SIGNATURE), 0
        while pos + 8 <= len(data):
            chunks += 1
            if chunks > MAX_PNG_CHUNKS:
                raise TooLarge(f"{where}: the PNG has more than {MAX_PNG_CHUNKS} chunks", field=where)
            if data[pos + 4:pos + 8] == b"IEND":
                return
            pos += 12 + int.from_bytes(data[pos:pos + 4], "big")  # length, type, data, CRC


def checked_image(data: bytes, fmt: str, expected_tokens: int | None, where: str, budget: ImageBudget) -> ImageInput:
    """Encoded image bytes checked against the limits, without decoding them: the declared format, at most
    max_image_pixels pixels (from the header), a PNG's chunk checksums. The pixels are decoded once, by the
    model's side before the request is queued (Backend.validate or Backend.image_tokens, at a low priority:
    http/heavy.py), where bytes that do not decode are a 400 naming the chunk."""
    limits = budget.limits
    budget.admit_image(where)
    if fmt not in FORMATS:
        raise InvalidInput(f"{where}.format: {fmt!r} is not an image format this server takes; use one of "
                           f"{sorted(FORMATS)}", field=f"{where}.format")
    check_expected_tokens(expected_tokens, where, budget)
    if len(data) > limits.max_image_bytes:
        raise TooLarge(f"{where}: the image is {len(data)} bytes; the limit is {limits.max_image_bytes} per image "
                       "(max_image_bytes)", field=where)
    budget.add(len(data), where)
    check_structure(data, where)
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS.values())) as image:  # the header only; no other reader
            found = image.format
            width, height = image.size
            if found == FORMATS[fmt] and width * height <= limits.max_image_pixels:
                image.verify()  # PNG: chunk checksums
    except Image.DecompressionBombError:  # over Pillow's own bound, far over any sane max_image_pixels
        raise TooLarge(f"{where}: the image has more than {limits.max_image_pixels} pixels (max_image_pixels)",
                       field=where) from None
    except UnidentifiedImageError:
        raise InvalidInput(f"{where}: the {fmt} image does not decode (the bytes are neither PNG nor JPEG)",
                           field=where) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InvalidInput(f"{where}: the {fmt} image does not decode ({type(e).__name__}: {e})", field=where) from None
    if found != FORMATS[fmt]:
        raise InvalidInput(f"{where}: declared format {fmt!r}, but the bytes are {found or 'unknown'}",
                           field=f"{where}.format")
    if width * height > limits.max_image_pixels:
        raise TooLarge(f"{where}: the image is {width}x{height} = {width * height} pixels; the limit is "
                       f"{limits.max_image_pixels} per image (max_image_pixels)", field=where)
    return ImageInput(data=data, format=fmt, expected_tokens=expected_tokens)


def decode_base64(text: str, where: str, limits: Limits) -> bytes:
    """A chunk's base64 `data` as bytes; sized before decoding (4 characters hold 3 bytes, less the padding)."""
    size = len(text) * 3 // 4 - text[-2:].count("=")  # what valid base64 of this length holds
    if size > limits.max_image_bytes:
        raise TooLarge(f"{where}: the image is {size} bytes; the limit is {limits.max_image_bytes} per image "
                       "(max_image_bytes)", field=where)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where}.data: not valid base64", field=f"{where}.data") from None


def pointed_file(location: str, where: str, limits: Limits) -> bytes:
    """The bytes of the server-local file an asset pointer names, if it lies under an allowed directory."""
    field = f"{where}.location"
    if not limits.image_dirs:
        raise InvalidInput(f"{field}: this server accepts no image asset pointers (the operator allows a "
                           "directory with `whitney serve --image-dir DIR`); send the image bytes in an image chunk",
                           field=field)
    if not isinstance(location, str) or not location or "\0" in location:
        raise InvalidInput(f"{field}: must be an absolute path or a file:// URI", field=field)
    path = location
    if not location.startswith("/"):
        parts = urlsplit(location)
        if not parts.scheme:
            raise InvalidInput(f"{field}: {location!r} is a relative path; give an absolute path or a file:// URI",
                               field=field)
        if parts.scheme.lower() != "file":
            raise InvalidInput(f"{field}: {parts.scheme!r} locations are refused: the server fetches nothing from the "
                               "network; give a path under an allowed image directory, or the image bytes", field=field)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise InvalidInput(f"{field}: a file:// URI names a local path (file:///dir/image.png), not a host",
                               field=field)
        path = unquote(parts.path)
        if not path.startswith("/") or "\0" in path:
            raise InvalidInput(f"{field}: must be an absolute path or a file:// URI", field=field)
    real = os.path.realpath(path)
    allowed = [os.path.realpath(d) for d in limits.image_dirs]
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise InvalidInput(f"{field}: {location!r} is not under an allowed image directory (symbolic links and "
                           "'..' count where they lead)", field=field)
    if not os.path.isfile(real):
        raise InvalidInput(f"{field}: {location!r} is not a file", field=field)
    size = os.path.getsize(real)
    if size > limits.max_image_bytes:
        raise TooLarge(f"{where}: the image is {size} bytes; the limit is {limits.max_image_bytes} per image "
                       "(max_image_bytes)", field=where)
    try:
        with open(real, "rb") as f:
            return f.read(limits.max_image_bytes + 1)
    except OSError as e:
        raise InvalidInput(f"{field}: {location!r} cannot be read ({e.strerror})", field=field) from None


def model_input(chunks: list[dict], where: str, budget: ImageBudget) -> Chunks:
    """Wire chunks ({type, ...} dicts, already shaped by the schema) as the engine's chunks: token lists and
    ImageInputs. `where` names the chunk list in errors ("data[2].input.chunks")."""
    out: Chunks = []
    after_image = False  # only empty text since the last image
    for j, chunk in enumerate(chunks):
        at = f"{where}[{j}]"
        kind = chunk.get("type")
        if kind in (IMAGE, POINTER):
            if after_image:
                raise InvalidInput(f"{at} {IMAGE_AFTER_IMAGE}", field=at)
            after_image = True
            budget.admit_image(at)  # before the bytes are decoded from base64 or read from disk
        elif kind == TEXT and chunk["tokens"]:
            after_image = False
            check_expected_tokens(chunk.get("expected_tokens"), at, budget)
        if kind == TEXT:
            out.append(list(chunk["tokens"]))
        elif kind == IMAGE:
            data = chunk["data"]
            raw = data if isinstance(data, bytes) else decode_base64(data, at, budget.limits)
            out.append(checked_image(raw, chunk["format"], chunk.get("expected_tokens"), at, budget))
        elif kind == POINTER:
            raw = pointed_file(chunk["location"], at, budget.limits)
            out.append(checked_image(raw, chunk["format"], chunk.get("expected_tokens"), at, budget))
        else:
            what = " (audio is not served)" if kind in ("dmel", "audio") else ""
            raise InvalidInput(f"{at}: chunk type {kind!r} is not supported{what}; a chunk is one of "
                               f"{list(CHUNK_TYPES)}", field=f"{at}.type")
    return out


def has_images(tokens_or_chunks) -> bool:
    return isinstance(tokens_or_chunks, list) and any(isinstance(c, ImageInput) for c in tokens_or_chunks)


def known_length(tokens_or_chunks) -> int:
    """Positions of a model input as far as the service knows them: token ids, plus each image's
    expected_tokens (0 where not given: the engine's processor counts it)."""
    n = 0
    for c in tokens_or_chunks:
        if isinstance(c, ImageInput):
            n += c.expected_tokens or 0
        else:
            n += len(c) if isinstance(c, list) else 1
    return n


def token_ids(tokens_or_chunks) -> list[int]:
    """Every token id of a model input (images left out), for the checks the service makes on ids."""
    out: list[int] = []
    for c in tokens_or_chunks:
        if isinstance(c, list):
            out.extend(c)
        elif not isinstance(c, ImageInput):
            out.append(c)
    return out


def check_context(length: int, max_context: int, where: str = "prompt") -> None:
    """A prompt of `length` positions (known_length: images counted by expected_tokens) fits the model's
    context: checked before anything is sized from it."""
    if length > max_context:
        raise InvalidInput(f"{where} holds {length} positions (each image its expected_tokens), more than the "
                           f"model's context of {max_context}", field=where)


def process_images(backend, base_model: str, chunks: list, where: str) -> None:
    """Decode and process each image chunk of a prompt or scored sequence now, on this request thread
    (Backend.image_tokens: the worker that runs the request finds it processed), and set each one's
    expected_tokens to the positions the model's processor gives it, so the service's length checks are exact.
    A refusal names the chunk list as `where` ("prompt", "sequences[2]")."""
    try:
        tokens = backend.image_tokens(base_model, chunks)
    except InvalidInput as e:
        if where != "prompt":
            e.message, e.field = where + e.message.removeprefix("prompt"), where
        raise
    for chunk, n in zip((c for c in chunks if isinstance(c, ImageInput)), tokens):
        chunk.expected_tokens = n


def stand_in(prompt: list, max_context: int) -> list[int]:
    """A sample prompt as token ids for the checks the service makes before queueing it
    (protocol.sampling.validate): each image as its expected_tokens positions (process_images set them), the whole
    checked against the model's context first (so at most `max_context` ids are made)."""
    if not has_images(prompt):
        return prompt
    check_context(known_length(prompt), max_context)
    out: list[int] = []
    for c in prompt:
        out.extend([0] * c.expected_tokens if isinstance(c, ImageInput) else c)
    return out


def refuse_images(model_info, base_model: str, where: str, datum_index: int | None = None) -> None:
    """A model without a vision tower takes no image chunks (ModelInfo.vision; absent: text only)."""
    if not getattr(model_info, "vision", False):
        raise InvalidInput(f"{where}: base model {base_model} takes no images", field=where, datum_index=datum_index)


def datums(data: list[dict], budget: ImageBudget, chunks_at: str = "data[{i}].input.chunks") -> list[Datum]:
    """Wire datums ({input: {token_ids} | {chunks}, loss_inputs}) as engine datums, images read and checked.
    `chunks_at` names datum i's chunks in errors (the Tinker API's: "data[{i}].model_input")."""
    out = []
    for i, d in enumerate(data):
        given = {k for k in ("token_ids", "chunks") if d["input"].get(k) is not None}
        if len(given) != 1:
            raise InvalidInput(f"data[{i}].input: give token_ids or chunks" + (", not both" if given else ""),
                               field=f"data[{i}].input", datum_index=i)
        try:
            ids = (d["input"]["token_ids"] if "token_ids" in given
                   else model_input(d["input"]["chunks"], chunks_at.format(i=i), budget))
        except (InvalidInput, TooLarge) as e:
            e.datum_index = i
            raise
        out.append(Datum(ids if has_images(ids) else _flat(ids), d.get("loss_inputs") or {}))
    return out


def prompt(tokens_or_chunks: list, where: str, budget: ImageBudget) -> list:
    """A prompt or scored sequence (token ids, or chunk dicts) as token ids, or as chunks when it holds an image."""
    if not tokens_or_chunks or not isinstance(tokens_or_chunks[0], dict):
        return list(tokens_or_chunks)
    chunks = model_input(tokens_or_chunks, where, budget)
    return chunks if has_images(chunks) else _flat(chunks)


def _flat(ids: list) -> list[int]:
    return [t for c in ids for t in c] if ids and isinstance(ids[0], list) else list(ids)
