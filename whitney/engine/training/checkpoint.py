"""Checkpoints and exports, all written atomically: a temporary directory, fsync, rename.

A state checkpoint is a directory:
  whitney_state.json    format version, base model, LoRA config, optimizer step, sha256 of each file
  adapter.safetensors   `{module}.lora_A` [r, in] and `{module}.lora_B` [out, r]
  optimizer.safetensors `exp_avg.{weight}` and `exp_avg_sq.{weight}` (only with the optimizer)
Checksums are verified on load. Exports are a PEFT adapter directory or a merged Hugging Face model.
Tensors are written from any device (copied to the CPU) and read onto the adapter's device.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from whitney.engine.families.lora import Adapter, load_adapter_weights
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.modules import UNEMBED
from whitney.engine.training.optim import OptimizerState
from whitney.errors import InvalidInput, NotFound
from whitney.protocol.config import shown_name
from whitney.protocol.files import atomic_dir
from whitney.protocol.training import LoraConfig

FORMAT_VERSION = 1
MANIFEST = "whitney_state.json"
SHARDED_FORMAT = "sharded-1"  # a checkpoint written by N ranks (engine/sharded.py), same manifest name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_state(path: str | Path, adapter: Adapter, optimizer: OptimizerState | None, base_model: str) -> dict:
    """Write adapter weights (and optimizer moments and step) with a manifest; return the manifest."""
    with atomic_dir(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.named_parameters()},
                  tmp / "adapter.safetensors")
        files = ["adapter.safetensors"]
        if optimizer is not None:
            tensors = {f"exp_avg.{k}": v for k, v in optimizer.exp_avg.items()}
            tensors |= {f"exp_avg_sq.{k}": v for k, v in optimizer.exp_avg_sq.items()}
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
            files.append("optimizer.safetensors")
        manifest = {
            "format_version": FORMAT_VERSION,
            "base_model": base_model,
            "lora": adapter.config.to_dict(),
            "has_optimizer": optimizer is not None,
            "optimizer_step": optimizer.step if optimizer is not None else None,
            "sha256": {f: sha256(tmp / f) for f in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def read_manifest(path: str | Path) -> dict:
    """The manifest of a state checkpoint, after checking its format version."""
    file = Path(path) / MANIFEST
    if not file.exists():
        raise NotFound(f"no checkpoint at {path}", field="path")
    manifest = json.loads(file.read_text())
    if manifest.get("format_version") == SHARDED_FORMAT:
        raise InvalidInput(f"{path} is a sharded checkpoint (written by {manifest.get('world_size')} ranks): load it "
                           "into a run (load_state, or a new run resumed from it)", field="path")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InvalidInput(f"checkpoint format {manifest.get('format_version')} is not supported "
                           f"(this server reads {FORMAT_VERSION})", field="path")
    return manifest


def is_sharded(path: str | Path) -> bool:
    """Whether `path` holds a checkpoint written by several ranks (engine/sharded.py reads it)."""
    file = Path(path) / MANIFEST
    return file.is_file() and json.loads(file.read_text()).get("format_version") == SHARDED_FORMAT


def _verified(path: Path, name: str, manifest: dict) -> dict[str, torch.Tensor]:
    file = path / name
    if sha256(file) != manifest["sha256"][name]:
        raise InvalidInput(f"checkpoint file {file} fails its checksum: the checkpoint is corrupt", field="path")
    return load_file(file, device="cpu")


def load_into(path: str | Path, adapter: Adapter, optimizer: OptimizerState | None,
              base_model: str) -> OptimizerState | None:
    """Load a checkpoint into an existing adapter (and a fresh OptimizerState if one is given), onto the
    adapter's device.

    Refuses a different base model or LoRA geometry (rank, alpha, modules) before changing anything.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest["base_model"] != base_model:
        raise InvalidInput(f"checkpoint was saved on base model {manifest['base_model']!r}, this run uses "
                           f"{base_model!r}", field="path")
    saved = LoraConfig.from_dict(manifest["lora"])
    if (saved.rank, saved.alpha) != (adapter.config.rank, adapter.config.alpha):
        raise InvalidInput(f"checkpoint LoRA rank/alpha {saved.rank}/{saved.alpha} differ from the run's "
                           f"{adapter.config.rank}/{adapter.config.alpha}", field="path")
    if optimizer is not None and not manifest["has_optimizer"]:
        raise InvalidInput("checkpoint has no optimizer state; use load_state (weights only)", field="path")
    weights = _verified(path, "adapter.safetensors", manifest)
    moments = _verified(path, "optimizer.safetensors", manifest) if optimizer is not None else None
    load_adapter_weights(adapter, weights)  # checks module names and shapes before writing
    if optimizer is not None:
        device = adapter.device
        optimizer.step = int(manifest["optimizer_step"])
        optimizer.exp_avg = {k[len("exp_avg."):]: v.to(device) for k, v in moments.items() if k.startswith("exp_avg.")}
        optimizer.exp_avg_sq = {k[len("exp_avg_sq."):]: v.to(device) for k, v in moments.items()
                                if k.startswith("exp_avg_sq.")}
    return optimizer


def _is_expert(adapter: Adapter, name: str) -> bool:
    return adapter.A[name].dim() == 3  # A [E, r, in] of a stacked expert projection (engine/experts.py)


def _short_names(adapter: Adapter, experts: bool) -> list[str]:
    """PEFT target_modules (the adapted nn.Linear short names) or, with `experts`, target_parameters (the
    adapted expert projections as `experts.gate_up_proj`), in the order the adapter first has them."""
    return list(dict.fromkeys(".".join(name.split(".")[-2:]) if experts else name.rsplit(".", 1)[-1]
                              for name in adapter.A if _is_expert(adapter, name) == experts))


def _target_modules(adapter: Adapter, base: BaseModel) -> list[str]:
    """PEFT target_modules: the short names, or the full module paths where a short name would also match a
    module the run does not adapt (a multimodal checkpoint's vision tower has its own `q_proj`)."""
    short = _short_names(adapter, experts=False)
    linears = [n for n in adapter.A if not _is_expert(adapter, n)]
    matched = [n for n in base.module_paths() if n.rsplit(".", 1)[-1] in short]
    return short if sorted(matched) == sorted(linears) else linears


def _peft_expert_tensors(adapter: Adapter, name: str, wrappers_outside: int) -> dict[str, torch.Tensor]:
    """One expert projection in PEFT's `target_parameters` layout (peft 0.21 lora.ParamWrapper): lora_A
    [E * r, in] with row e * r + k our A[e, k]; lora_B [out, r * E] with column k * E + e our B[e, :, k]
    (PEFT reshapes it to [out, r, E]). PEFT wraps the experts module once per adapted parameter, in the
    module's parameter order, so a parameter with `wrappers_outside` adapted after it sits that many
    `base_layer`s deep."""
    module, _ = name.rsplit(".", 1)
    prefix = f"base_model.model.{module}." + "base_layer." * wrappers_outside
    a, b = adapter.A[name].detach().cpu(), adapter.B[name].detach().cpu()  # [E, r, in], [E, out, r]
    experts, rank, fan_in = a.shape
    return {f"{prefix}lora_A.weight": a.reshape(experts * rank, fan_in).contiguous(),
            f"{prefix}lora_B.weight": b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous()}


def export_peft(path: str | Path, adapter: Adapter, base: BaseModel) -> None:
    """A PEFT LoRA adapter directory that peft.PeftModel.from_pretrained loads onto the base model. Expert
    projections of MoE layers are PEFT `target_parameters` (peft >= 0.17)."""
    expert_params = _short_names(adapter, experts=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": shown_name(base.name),  # a download never shows a server path
        "r": adapter.config.rank,
        "lora_alpha": adapter.config.alpha,
        "target_modules": _target_modules(adapter, base),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    if expert_params:
        config["target_parameters"] = expert_params
    tensors, names = {}, list(adapter.A)
    for name in names:
        if _is_expert(adapter, name):  # adapter paths keep each module's parameter order
            module = name.rsplit(".", 1)[0]
            later = [n for n in names[names.index(name) + 1:] if n.rsplit(".", 1)[0] == module]
            tensors |= _peft_expert_tensors(adapter, name, len(later))
            continue
        tensors[f"base_model.model.{name}.lora_A.weight"] = adapter.A[name].detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = adapter.B[name].detach().cpu().contiguous()
    with atomic_dir(path) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})


def export_merged(path: str | Path, adapter: Adapter, base: BaseModel) -> None:
    """A standalone Hugging Face model directory with W + scale * B @ A merged into each adapted weight
    (on the CPU, in float32, whatever the engine's device and dtype).

    An adapted unembedding of a model with tied embeddings is untied, so the input embedding stays the base's.
    An expert projection gets each expert's delta, in its parameter's layout ([E, out, in], or [E, in, out]
    when its module `is_transposed`).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
    modules = dict(model.named_modules())
    with torch.no_grad():
        if UNEMBED in adapter.A and model.config.tie_word_embeddings:
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        for name in adapter.A:
            delta = adapter.scale * (adapter.B[name].detach().cpu() @ adapter.A[name].detach().cpu())  # [(E,) out, in]
            if _is_expert(adapter, name):
                module, param = name.rsplit(".", 1)
                weight = getattr(modules[module], param)
                weight += delta.transpose(1, 2) if modules[module].is_transposed else delta
            else:
                weight = modules[name].weight
                weight += delta
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        base.tokenizer.save_pretrained(tmp)
