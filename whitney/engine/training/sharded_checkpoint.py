"""Checkpoints written by the ranks of a process group (training/sharded.py), and read back onto any number of
ranks or into one process.

The adapter and AdamW moments as DTensors sharded on dim 0 over the ranks, written with
torch.distributed.checkpoint (DCP: each rank writes its shards, rank 0 the metadata) into a temporary directory
that rank 0 renames into place beside the project's manifest (`whitney_state.json`, format `sharded-1`, sha256 of
every file). `load_sharded_run` verifies the checksums, then reads onto any number of ranks (DCP reshards) or into
the unsharded `Engine` of one process. All ranks must see one filesystem (one machine, or a shared one).

Shape legend: r LoRA rank.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from whitney.engine.families.lora import load_adapter_weights
from whitney.engine.training import checkpoint as ckpt
from whitney.engine.training.optim import OptimizerState
from whitney.engine.training.run import Run
from whitney.errors import Conflict, InvalidInput, NotFound
from whitney.protocol.files import publish, temp_beside
from whitney.protocol.training import LoraConfig

_MOMENTS = ("exp_avg", "exp_avg_sq")


def from_rank0(fn: Callable, *args) -> Any:
    """fn(*args) on rank 0 alone; every rank returns its result or raises its error."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn(*args))
        except Exception as e:  # handed to every rank, raised there
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _manifest(path: str | Path) -> dict:
    file = Path(path) / ckpt.MANIFEST
    if not file.is_file():
        raise NotFound(f"no checkpoint at {path}", field="path")
    return json.loads(file.read_text())


def _publish(tmp: Path, target: Path, manifest: dict) -> dict:
    """Rank 0: checksum every file the ranks wrote, add the manifest, publish the directory as `target`."""
    files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    manifest = {**manifest, "sha256": {f: ckpt.sha256(tmp / f) for f in files}}
    (tmp / ckpt.MANIFEST).write_text(json.dumps(manifest, indent=2))
    publish(tmp, target)
    return manifest


def save_sharded_run(run: Run, path: str | Path, include_optimizer: bool, mesh: DeviceMesh) -> dict:
    """Write the run's adapter (and AdamW moments), each tensor sharded on dim 0 over the ranks of `mesh`; return
    the manifest. Every rank calls it; the directory appears at `path` whole or not at all."""
    target = Path(path)
    if target.exists():  # one filesystem: every rank refuses, before any collective
        raise Conflict(f"{target} already exists", field="path")
    tensors = {f"adapter.{k}": w for k, w in run.weights().items()}
    if include_optimizer:
        tensors |= {f"{m}.{k}": t for m in _MOMENTS for k, t in getattr(run.optimizer, m).items()}
    shards = {k: distribute_tensor(t.detach(), mesh, [Shard(0)], src_data_rank=None)
              for k, t in tensors.items()}  # this rank's rows of each, no communication
    manifest = {"format_version": ckpt.SHARDED_FORMAT, "base_model": run.base.name,
                "lora": run.adapter.config.to_dict(), "has_optimizer": include_optimizer,
                "optimizer_step": run.optimizer.step if include_optimizer else None,
                "world_size": dist.get_world_size()}
    tmp = Path(from_rank0(temp_beside, target))
    try:
        dcp.save(shards, checkpoint_id=tmp)  # returns on every rank once rank 0 wrote the metadata
        return from_rank0(_publish, tmp, target, manifest)
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed


def _check(manifest: dict, path: Path, run: Run, with_optimizer: bool) -> None:
    """The rules of ckpt.load_into, and every file's checksum."""
    if manifest.get("format_version") != ckpt.SHARDED_FORMAT:
        raise InvalidInput(f"{path} is not a sharded checkpoint: load it with load_state", field="path")
    if manifest["base_model"] != run.base.name:
        raise InvalidInput(f"checkpoint was saved on base model {manifest['base_model']!r}, this run uses "
                           f"{run.base.name!r}", field="path")
    saved, own = LoraConfig.from_dict(manifest["lora"]), run.adapter.config
    if (saved.rank, saved.alpha) != (own.rank, own.alpha):
        raise InvalidInput(f"checkpoint LoRA rank/alpha {saved.rank}/{saved.alpha} differ from the run's "
                           f"{own.rank}/{own.alpha}", field="path")
    if with_optimizer and not manifest["has_optimizer"]:
        raise InvalidInput("checkpoint has no optimizer state; use load_state (weights only)", field="path")
    for name, digest in manifest["sha256"].items():
        file = path / name
        if not file.is_file() or ckpt.sha256(file) != digest:
            raise InvalidInput(f"checkpoint file {file} is missing or fails its checksum: the checkpoint is "
                               "corrupt", field="path")


def load_sharded_run(run: Run, path: str | Path, with_optimizer: bool = False, mesh: DeviceMesh | None = None) -> None:
    """Restore a run from a sharded checkpoint: its weights (fresh optimizer) or weights and AdamW state.

    With `mesh`, on any number of ranks (every rank calls it; each reads its shard of every tensor, then the
    shards are gathered); without, in one process (reads everything). Checks checksums, base model and LoRA
    geometry before changing anything; clears gradients.
    """
    path = Path(path)
    manifest = _manifest(path)
    _check(manifest, path, run, with_optimizer)
    weights = {k: w.detach() for k, w in run.weights().items()}
    saved = {k: tuple(m.size) for k, m in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()}
    wanted = {f"adapter.{k}": w for k, w in weights.items()}
    moments = [k for k in saved if k.partition(".")[0] in _MOMENTS] if with_optimizer else []
    saved_adapter = {k for k in saved if k.startswith("adapter.")}
    unknown = [k for k in moments if k.partition(".")[2] not in weights]
    if saved_adapter != set(wanted) or unknown:
        missing = sorted(set(wanted) - saved_adapter)[:3]
        extra = (sorted(saved_adapter - set(wanted)) + unknown)[:3]
        raise InvalidInput(f"checkpoint LoRA modules differ from the run's (missing {missing}, unexpected {extra})",
                           field="path")
    wanted |= {k: weights[k.partition(".")[2]] for k in moments}
    for key, t in wanted.items():
        if saved[key] != tuple(t.shape):
            raise InvalidInput(f"checkpoint tensor {key} has shape {list(saved[key])}, the run expects "
                               f"{list(t.shape)}", field="path")
    if mesh is not None:
        targets = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)], src_data_rank=None)
                   for k, t in wanted.items()}
        dcp.load(targets, checkpoint_id=path)
    else:
        targets = {k: torch.zeros(t.shape, dtype=t.dtype, device="cpu") for k, t in wanted.items()}
        with warnings.catch_warnings():  # DCP warns that it reads in one process, which is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, checkpoint_id=path, no_dist=True)
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t) for k, t in targets.items()}
    load_adapter_weights(run.adapter, {k[len("adapter."):]: t for k, t in full.items() if k.startswith("adapter.")})
    optimizer = OptimizerState()
    if with_optimizer:
        optimizer.step = int(manifest["optimizer_step"])
        for moment in _MOMENTS:
            setattr(optimizer, moment, {k.partition(".")[2]: t.to(run.adapter.device) for k, t in full.items()
                                        if k.partition(".")[0] == moment})
    run.optimizer = optimizer
    run.grads.clear()
