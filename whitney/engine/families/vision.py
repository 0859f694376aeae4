"""Images in: a datum's image chunks expanded into the model's own placeholder positions, and passes that carry them.

A vision-language checkpoint (Qwen3.5 `qwen3_5`, Qwen3-VL `qwen3_vl`, Gemma 3 `gemma3`) saved with its image
processor is loaded whole: `GeneralModel.hf` stays the causal LM the general path runs (for Qwen3.5 the text-only
Qwen3_5ForCausalLM, exactly as before), and `BaseModel.vision` holds the checkpoint's inner multimodal module
(vision tower, projector or merger, and the very same language-model modules), frozen, in the compute dtype.
LoRA adapts the language model's linears only: the vision tower and the projector are not adaptable (naming
them in target_modules is refused like any unknown module).

An image chunk occupies exactly the positions of the model's image placeholder token, as many as its processor
makes of that image (see docs/MODELS.md, "Images"):
  qwen3_5, qwen3_vl  (grid_t * grid_h * grid_w) / merge_size^2 positions of <|image_pad|>; the
                     <|vision_start|> and <|vision_end|> around it are text the client writes
  gemma3             mm_tokens_per_image positions of <image_soft_token>; <start_of_image>, <end_of_image>
                     (and the processor's blank lines) are text the client writes
This is the Tinker SDK's `ModelInput.length` convention (an image counts its `expected_tokens`). A token chunk
may not hold the placeholder id itself (it would take an image's place), and two images need text between them
(the models read a run of placeholders as one image).

A pass with image rows (general.GeneralModel.forward_hidden) runs the inner module's own forward with
`model_inputs`: its image features scattered at the placeholder positions (`get_image_features`), Qwen's 3-D mrope
positions from its own `get_rope_index` (passed explicitly,
so the module's cached `rope_deltas` are never read), Qwen3-VL's deepstack features, and Gemma 3's bidirectional
attention within an image block from `token_type_ids` (the model's own mask functions). Text rows of the same
batch get the same numbers as alone: positions of text are 0..T-1 and padding stays on the right.

Shape legend: B rows, T positions, I images of a pass, P patches of an image, D hidden.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from whitney.engine.families.checkpoint_tensors import checkpoint_sources, read_into, tensor_files
from whitney.heap import release_memory
from whitney.errors import InvalidInput
from whitney.protocol.config import shown_name
from whitney.protocol.training import IMAGE_AFTER_IMAGE, ImageInput

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
CACHED_PIXEL_BYTES = 256 * 2**20  # processed images kept per base model (ProcessedImages)
DECODING_PIXELS = 1 << 23  # pixels decoded at once in one process (PixelBudget): one image of the service's default
# max_image_pixels (4096 x 2048)
RELEASE_PIXELS = 1 << 20  # decoding an image this large (or larger) gives freed memory back to the system after
FAMILIES = ("qwen3_5", "qwen3_vl", "gemma3")  # tested in tests/engine/test_vision.py; others are served as text
FIELD = "model_input"


@dataclass
class ProcessedImage:
    """One image after the model's processor, and where it sits in its expanded sequence."""

    pixel_values: torch.Tensor  # qwen: [P, C * temporal_patch * patch^2]; gemma3: [1, 3, H, W]
    grid_thw: torch.Tensor | None  # qwen: [3] patches in time, height, width; gemma3: None
    tokens: int  # positions it occupies
    start: int = 0  # its first position in the expanded sequence


class ProcessedImages:
    """A base model's processed images by content (the encoded bytes' SHA-256 and format), the most recently used
    kept up to `max_bytes` of pixel values: an image a request thread decoded and processed (a forward's
    validation, a prompt's `image_tokens`) is not decoded again by the worker that runs the request. Thread-safe;
    each `get` is a copy of its own (`start` is per sequence; the tensors are shared, never written)."""

    def __init__(self, max_bytes: int = CACHED_PIXEL_BYTES):
        self.max_bytes = max_bytes
        self._images: OrderedDict[tuple[bytes, str], ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(image: ImageInput) -> tuple[bytes, str]:
        return hashlib.sha256(image.data).digest(), image.format

    def get(self, key: tuple[bytes, str]) -> ProcessedImage | None:
        with self._lock:
            found = self._images.get(key)
            if found is None:
                return None
            self._images.move_to_end(key)
        return replace(found, start=0)

    def put(self, key: tuple[bytes, str], image: ProcessedImage) -> None:
        size = image.pixel_values.numel() * image.pixel_values.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._images:
                return
            self._images[key] = replace(image, start=0)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._images.popitem(last=False)
                self._bytes -= old.pixel_values.numel() * old.pixel_values.element_size()


class PixelBudget:
    """At most `budget` pixels being decoded and processed at once in this process, across every thread and base
    model (an image larger than the budget alone): a decode's buffers (a progressive JPEG's coefficients, the
    full-size RGB image) are the largest transient memory a request can make, and several request threads
    decoding the largest images at once multiplied it. A thread waits for its turn."""

    def __init__(self, budget: int):
        self.budget, self.used, self.most = budget, 0, 0  # most: the highest `used` seen (tests read it)
        self._turn = threading.Condition()

    @contextmanager
    def hold(self, pixels: int):
        with self._turn:
            self._turn.wait_for(lambda: self.used == 0 or self.used + pixels <= self.budget)
            self.used += pixels
            self.most = max(self.most, self.used)
        try:
            yield
        finally:
            with self._turn:
                self.used -= pixels
                self._turn.notify_all()


DECODING = PixelBudget(DECODING_PIXELS)


@dataclass
class VisionModel:
    """What a base model needs to take images: its inner multimodal module and its image processor."""

    family: str  # "qwen" (3-D mrope positions, a rope delta per row) | "gemma3" (bidirectional image blocks)
    model: torch.nn.Module  # Qwen3_5Model / Qwen3VLModel / Gemma3Model; its language model is the text decoder
    image_processor: object
    image_token_id: int
    tokens_per_image: int | None = None  # gemma3: fixed; qwen: from each image's grid
    processed: ProcessedImages = field(default_factory=ProcessedImages)


def load_vision(path, hf: torch.nn.Module, compute_dtype: torch.dtype, device) -> VisionModel | None:
    """The vision side of a checkpoint at `path` whose config has a vision tower and whose directory has an image
    processor, else None (served as text only). `hf` is the loaded causal LM (already on `device`): when it is the
    text model alone (Qwen3.5), the checkpoint's multimodal module is built around hf's text modules
    (`_around_text_model`), so no text weight is held twice."""
    cfg = hf.config
    if not any((path / f).exists() for f in ("preprocessor_config.json", "processor_config.json")):
        return None
    from transformers import AutoConfig, AutoImageProcessor

    full_cfg = AutoConfig.from_pretrained(path)
    if getattr(full_cfg, "vision_config", None) is None or full_cfg.model_type not in FAMILIES:
        return None
    if getattr(cfg, "vision_config", None) is not None:  # hf is the whole multimodal model (Gemma 3, Qwen3-VL)
        inner = hf.model
    else:  # Qwen3.5: the checkpoint's multimodal module around hf's text modules
        inner = _around_text_model(path, full_cfg, hf)
        inner.to(device=device, dtype=compute_dtype)
    for p in inner.parameters():
        p.requires_grad_(False)
    inner.eval()
    processor = AutoImageProcessor.from_pretrained(path)
    if full_cfg.model_type == "gemma3":
        return VisionModel("gemma3", inner, processor, full_cfg.image_token_id, full_cfg.mm_tokens_per_image)
    return VisionModel("qwen", inner, processor, full_cfg.image_token_id)


def _around_text_model(path, full_cfg, hf: torch.nn.Module) -> torch.nn.Module:
    """The inner multimodal module of the checkpoint at `path` with hf's text model as its language model: built
    with its parameters on the meta device and only its other weights (vision tower, merger) read from the
    checkpoint; where the checkpoint's tensors do not map to them (checkpoint_tensors.py), the whole checkpoint is
    read and its duplicate text weights and head freed."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText

    files = tensor_files(path)
    with init_empty_weights(include_buffers=False):
        full = AutoModelForImageTextToText.from_config(full_cfg, dtype=torch.float32)
    sources = checkpoint_sources(full, files) if files is not None else None
    own = [n for n, _ in full.model.named_parameters() if not n.startswith("language_model.")]
    if sources is None or any(f"model.{n}" not in sources for n in own):
        full = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)  # its text weights dropped below
    else:
        buffers = [n for n, _ in full.model.named_buffers()
                   if not n.startswith("language_model.") and f"model.{n}" in sources]
        read_into(full.model, [*own, *buffers], files, sources, "model.")
    inner = full.model
    inner.language_model = hf.model
    return inner


def _subject(index: int | None) -> str:
    return "prompt" if index is None else f"datum {index}"


def _field(index: int | None) -> str:
    return "prompt" if index is None else FIELD


class ImageExpander:
    """Expands a datum's image chunks for one base model (or refuses them: a model without a vision tower)."""

    def __init__(self, name: str, vision: VisionModel | None):
        self.name = name
        self.vision = vision

    @property
    def placeholder(self) -> int | None:
        """The image placeholder token id (not allowed in token chunks), None for a text model."""
        return self.vision.image_token_id if self.vision else None

    def expand(self, image, index: int | None, chunk: int) -> ProcessedImage:
        """Decode chunk `chunk` of datum `index` (None: of a sampling prompt) with Pillow and run the model's image
        processor on it."""
        where = f"{_subject(index)}: chunk {chunk}"
        if self.vision is None:
            raise InvalidInput(f"{where}: base model {shown_name(self.name)!r} takes no images", field=FIELD,
                               datum_index=index)
        if not isinstance(image, ImageInput) or not isinstance(image.data, (bytes, bytearray)):
            raise InvalidInput(f"{where}: an image chunk must hold encoded bytes", field=_field(index),
                               datum_index=index)
        if image.format not in FORMATS:
            raise InvalidInput(f"{where}: image format must be one of {sorted(FORMATS)}, got {image.format!r}",
                               field=_field(index), datum_index=index)
        key = ProcessedImages.key(image)
        processed = self.vision.processed.get(key)
        if processed is None:
            processed, pixels = self._process(image, where, index)
            self.vision.processed.put(key, processed)
            if pixels >= RELEASE_PIXELS:  # its decoded buffers, freed, would stay in the heap (to its trim threshold)
                release_memory()
        if image.expected_tokens is not None and image.expected_tokens != processed.tokens:
            raise InvalidInput(f"{where}: expected_tokens is {image.expected_tokens}, but the model's processor "
                               f"expands this image to {processed.tokens} positions", field=_field(index),
                               datum_index=index)
        return processed

    def _process(self, image: ImageInput, where: str, index: int | None) -> tuple[ProcessedImage, int]:
        """Decode an image with Pillow (its declared format checked) and run the model's image processor on it;
        the processed image and its decoded pixels (width x height)."""
        from PIL import Image

        try:
            decoded = Image.open(io.BytesIO(bytes(image.data)))  # the header only
        except Exception as e:  # Pillow raises many kinds for corrupt data
            raise self._undecodable(image, where, index, e) from None
        if decoded.format != FORMATS[image.format]:
            raise InvalidInput(f"{where}: the image is declared {image.format} but its bytes are {decoded.format}",
                               field=_field(index), datum_index=index)
        pixels = decoded.width * decoded.height
        with DECODING.hold(pixels):
            try:
                decoded.load()  # reads every pixel: a truncated file fails here
                rgb = decoded if decoded.mode == "RGB" else decoded.convert("RGB")
            except Exception as e:
                raise self._undecodable(image, where, index, e) from None
            out = self.vision.image_processor(images=[self._presized(rgb, where, index)], return_tensors="pt")
            del decoded, rgb
        if self.vision.family == "qwen":
            grid = out["image_grid_thw"][0]  # [3]
            merge = int(self.vision.image_processor.merge_size)
            processed = ProcessedImage(out["pixel_values"], grid, int(grid.prod()) // merge ** 2)
        else:
            processed = ProcessedImage(out["pixel_values"], None, int(self.vision.tokens_per_image))
        return processed, pixels

    @staticmethod
    def _undecodable(image: ImageInput, where: str, index: int | None, e: Exception) -> InvalidInput:
        return InvalidInput(f"{where}: the image cannot be decoded as {image.format} ({type(e).__name__})",
                            field=_field(index), datum_index=index)

    def _presized(self, rgb, where: str, index: int | None):
        """The decoded image resized by Pillow to the size the model's processor resizes it to, as the processor's
        own Pillow backend does it: the same resize of the same 8-bit pixels, so the processed image is bitwise the
        same, but before the processor makes its full-size array copies (about 160 MB more at 4096 x 4096). A
        processor of another kind, or that does not resize, gets the image as it is."""
        from transformers.image_processing_backends import PilBackend

        processor = self.vision.image_processor
        if not isinstance(processor, PilBackend) or not processor.do_resize:
            return rgb
        size = processor.size
        if self.vision.family == "qwen":
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            def target(h: int, w: int) -> tuple[int, int]:
                return smart_resize(h, w, factor=processor.patch_size * processor.merge_size,
                                    min_pixels=size.shortest_edge, max_pixels=size.longest_edge)

            try:
                height, width = target(rgb.height, rgb.width)
            except ValueError as e:  # an aspect ratio over the processor's bound
                raise InvalidInput(f"{where}: {e} ({rgb.width} x {rgb.height})", field=_field(index),
                                   datum_index=index) from None
            if target(height, width) != (height, width):  # the processor would resize it again: let it do both
                return rgb
        elif size.height and size.width:
            height, width = size.height, size.width
        else:
            return rgb
        return rgb.resize((width, height), resample=processor.resample)

    def flatten(self, seq, index: int | None) -> tuple[list[int], list[ProcessedImage]]:
        """A sequence (datum `index`, or a sampling prompt: None) given as token ids or chunks, as expanded token ids
        (placeholders at image positions) and its processed images (each with its start); token ids are checked
        later, where the caller checks ints."""
        if not isinstance(seq, (list, tuple)):
            return seq, []
        if not any(isinstance(c, (list, tuple, ImageInput)) for c in seq):
            seq = [seq]  # flat token ids: one token chunk
        flat: list = []
        images: list[ProcessedImage] = []
        for c, chunk in enumerate(seq):
            if isinstance(chunk, ImageInput):
                if flat and self.placeholder is not None and flat[-1] == self.placeholder:
                    # The models' position and attention rules take a run of placeholders as one image.
                    raise InvalidInput(f"{_subject(index)}: chunk {c} {IMAGE_AFTER_IMAGE}", field=_field(index),
                                       datum_index=index)
                image = self.expand(chunk, index, c)
                image.start = len(flat)
                flat.extend([self.placeholder] * image.tokens)
                images.append(image)
            elif isinstance(chunk, (list, tuple)):
                if self.placeholder is not None and self.placeholder in chunk:
                    raise InvalidInput(f"{_subject(index)}: token ids hold {self.placeholder}, the model's "
                                       "image placeholder; send the image as an image chunk", field=_field(index),
                                       datum_index=index)
                flat.extend(chunk)
            else:
                raise InvalidInput(f"{_subject(index)}: chunk {c} must be a list of token ids or an image",
                                   field=_field(index), datum_index=index)
        return flat, images


def expander(base) -> ImageExpander:
    """The expander of a base model (decoder.BaseModel: its name, and its vision side or None)."""
    return ImageExpander(base.name, base.vision)


def model_inputs(vision: VisionModel, tokens: torch.Tensor, images: list[list[ProcessedImage]],
                 dtype: torch.dtype) -> dict:
    """The inner module's keyword arguments for right-padded tokens [B, T] whose rows hold `images` (per row, in
    position order): pixel values of all I images in row-major order (in `dtype`), and Qwen's image grids [I, 3]
    and mrope positions [3, B, T], or Gemma 3's token types [B, T] (1 on image positions)."""
    dev = tokens.device
    flat = [im for row in images for im in row]
    pixels = torch.cat([im.pixel_values for im in flat]).to(dev, dtype=dtype)
    is_image = (tokens == vision.image_token_id).long()  # [B, T]
    if vision.family == "gemma3":
        return dict(pixel_values=pixels, token_type_ids=is_image)
    grid = torch.stack([im.grid_thw for im in flat]).to(dev)  # [I, 3]
    positions, _ = vision.model.get_rope_index(tokens, mm_token_type_ids=is_image, image_grid_thw=grid)
    return dict(pixel_values=pixels, image_grid_thw=grid, position_ids=positions)


def rope_deltas(vision: VisionModel | None, tokens: torch.Tensor, images: list[ProcessedImage]) -> int:
    """How far a Qwen row's next mrope position is ahead of its length once `images` are in its tokens [T]
    (negative: an image's positions advance by its largest side, not its token count); 0 for Gemma 3 and for a
    model without images."""
    if vision is None or vision.family != "qwen" or not images:
        return 0
    row = tokens[None, :]  # [1, T]
    grid = torch.stack([im.grid_thw for im in images]).to(tokens.device)  # [I, 3]
    positions, _ = vision.model.get_rope_index(row, mm_token_type_ids=(row == vision.image_token_id).long(),
                                               image_grid_thw=grid)
    return int(positions.max()) + 1 - int(tokens.shape[0])


def image_positions(length: int, images: list[ProcessedImage]) -> torch.Tensor:
    """[length] bool: True at the positions the images occupy."""
    mask = torch.zeros(length, dtype=torch.bool)
    for im in images:
        mask[im.start:im.start + im.tokens] = True
    return mask


def logprob_datum(expand: ImageExpander, seq, index: int):
    """compute_logprobs' datum for one sequence of N positions, and where its images are ([N] bools). Token ids:
    inputs s[:-1], targets s[1:] (as ever). With image chunks: the whole expanded sequence is the input (an image
    cannot be cut), its targets the ids shifted by one, the last position's (nothing to predict) repeating the
    last id; `sequence_logprobs` drops it."""
    from whitney.protocol.training import Datum

    if not (isinstance(seq, list) and any(isinstance(c, ImageInput) for c in seq)):
        if isinstance(seq, list) and seq and all(isinstance(c, list) for c in seq):
            seq = [t for c in seq for t in c]  # token chunks only
        return Datum(seq[:-1] or seq, {"target_tokens": seq[1:] or seq}), [False] * len(seq)
    flat, images = expand.flatten(seq, index)
    return Datum(seq, {"target_tokens": flat[1:] + flat[-1:]}), image_positions(len(flat), images).tolist()


def sequence_logprobs(logprobs: list[float], images: list[bool]) -> list[float | None]:
    """A sequence's log-probs [N] from its datum's ([N - 1], or [N] with the last dropped): None first (no
    context) and where an image's position would be predicted (the model predicts no image)."""
    n = len(images)
    return [None] + [None if images[t + 1] else lp for t, lp in enumerate(logprobs[:n - 1])]
