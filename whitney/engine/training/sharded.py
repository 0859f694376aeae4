"""Base models bigger than one device: the decoder layers sharded over the ranks of a process group (FSDP2).

`ShardedEngine` is the `Engine` of one rank. Every rank of the group makes the same calls in the same
order (SPMD: whatever drives the worker sends each call to every rank) and gets the same results.

Sharded: each decoder layer's frozen weights live in a small module (`_Layer`, parameters without
gradients) wrapped by FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per layer, then the root
`_Layers`), so at rest a rank holds 1/N of every layer weight (dim 0). `transformer._decoder` calls
`base.layers(step, h)`, which runs each layer through its module's `__call__`: FSDP2's hooks all-gather
the layer's weights before its forward and again before its backward, and free them after each.
Replicated on every rank: the embedding, final norm and unembedding (a small share of a large model), and
each run's LoRA weights, gradients and AdamW moments (r * (in + out) per module).

Every rank computes the whole batch; rows are not split across ranks. FSDP2's all-gathers are
collectives, so every rank must run every layer forward and backward the same number of times: with
rows split, a rank holding no row of some run, no opsd teacher row or no layer adapter would skip a pass
and the group would hang. Whole batches keep that true by construction and give exactly the unsharded
engine's numbers (the same kernels on the same gathered weights); the price is N times the compute (data
parallelism is future work). Before each optim_step the run's gradient is broadcast from rank 0, so ranks
cannot drift apart where kernels are not bitwise deterministic (CUDA); on the CPU it changes nothing.

Checkpoints (`save_sharded_state`): the adapter and AdamW moments as DTensors sharded on dim 0 over the
ranks, written with torch.distributed.checkpoint (DCP: each rank writes its shards, rank 0 the metadata)
into a temporary directory that rank 0 renames into place beside the project's manifest
(`whitney_state.json`, format `sharded-1`, sha256 of every file). `load_sharded_state` verifies the
checksums, then reads onto any number of ranks (DCP reshards) or into the unsharded `Engine` of one process.
All ranks must see one filesystem (one machine, or a shared one).

`spawn_ranks` starts N processes forming one group: gloo on the CPU (tested), NCCL with one CUDA device per
rank (written, untested here: no GPU). Each rank reads the whole base on the CPU before sharding it (host
memory N times the model while loading); reading only a rank's slices of the safetensors is future work.

Shape legend: D hidden, r LoRA rank, N ranks.
"""

from __future__ import annotations

import gc
import json
import pickle
import queue
import shutil
import socket
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from whitney.engine.families.lora import load_adapter_weights
from whitney.engine.families.model import BaseModel, LayerWeights, load_base_model
from whitney.engine.training import checkpoint as ckpt
from whitney.engine.training.optim import OptimizerState
from whitney.engine.training.run import Run
from whitney.engine.training.runs import Engine
from whitney.errors import Conflict, InvalidInput, NotFound
from whitney.protocol.config import DEFAULT_MODEL, usable_cpus
from whitney.protocol.files import publish, temp_beside
from whitney.protocol.training import AdamParams, LoraConfig

_MOMENTS = ("exp_avg", "exp_avg_sq")


# ---- the sharded base ----------------------------------------------------------------------


class _Layer(nn.Module):
    """One decoder layer's frozen weights as parameters without gradients, for FSDP2 to shard and gather."""

    def __init__(self, lw: LayerWeights):
        super().__init__()

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.input_norm = frozen(lw.input_norm)  # [D]
        self.post_attn_norm = frozen(lw.post_attn_norm)  # [D]
        self.linear = nn.ParameterDict({k: frozen(w) for k, w in lw.linear.items()})  # [out, in]
        self.bias = nn.ParameterDict({k: frozen(b) for k, b in lw.bias.items()})  # [out]
        self.q_norm = None if lw.q_norm is None else frozen(lw.q_norm)  # [head_dim]
        self.k_norm = None if lw.k_norm is None else frozen(lw.k_norm)

    def forward(self, step: Callable, layer: int, h: torch.Tensor) -> torch.Tensor:
        """step(layer, weights, h [B, T, D]) over this layer's whole weights (FSDP2 gathered them)."""
        weights = LayerWeights(self.input_norm, self.post_attn_norm, dict(self.linear.items()),
                               dict(self.bias.items()), self.q_norm, self.k_norm)
        return step(layer, weights, h)


class _Layers(nn.Module):
    """FSDP2's root: every layer, each run through its own module so that its hooks fire around it."""

    def __init__(self, layers: list[LayerWeights]):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(lw) for lw in layers)

    def forward(self, step: Callable, h: torch.Tensor) -> torch.Tensor:
        for layer, module in enumerate(self.layers):
            h = module(step, layer, h)
        return h


def shard_base(base: BaseModel, mesh: DeviceMesh, device: torch.device) -> BaseModel:
    """`base` (loaded on the CPU) with its decoder layers sharded over `mesh` and the rest on `device`.

    Takes the layers' weights over: once FSDP2 has copied this rank's shard of a weight, nothing
    references the whole one, so it is freed. The fast-path families only (llama, qwen2, qwen3): a model
    of the general path runs its own Hugging Face modules, which are not sharded here.
    """
    if base.hf is not None:
        raise InvalidInput(f"base model {base.name!r} ({base.config.model_type}) runs on the general path, which "
                           "is not sharded yet: serve it on one device (no shards)", field="base_model")
    root = _Layers(base.layers)
    base.layers = []
    for module in root.layers:
        fully_shard(module, mesh=mesh)
    fully_shard(root, mesh=mesh)
    tied = base.lm_head.data_ptr() == base.embed.data_ptr()
    embed = base.embed.to(device)
    # packed={}: no oneDNN-prepacked copies (they would be whole copies of every layer's weights).
    return replace(base, embed=embed, layers=root, final_norm=base.final_norm.to(device),
                   lm_head=embed if tied else base.lm_head.to(device), inv_freq=base.inv_freq.to(device),
                   packed={})


# ---- the engine of one rank ----------------------------------------------------------------


class ShardedEngine(Engine):
    """The Engine of one rank of the default process group; its base models are sharded over every rank.

    gloo: the CPU. NCCL: the rank's current CUDA device (spawn_ranks sets it). Every rank makes the same
    calls in the same order; results, LoRA weights and optimizer state are equal on every rank.
    """

    def __init__(self, device: str | torch.device | None = None, **engine_kwargs):
        """`device` is the process group's (gloo: the CPU; NCCL: the rank's current CUDA device); another
        one given is refused."""
        if not dist.is_initialized():
            raise RuntimeError("ShardedEngine runs on a rank of an initialised process group (see spawn_ranks)")
        cuda = dist.get_backend() == "nccl"
        own = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if device not in (None, "auto") and torch.device(device).type != own.type:
            raise InvalidInput(f"a {dist.get_backend()} process group computes on {own.type}, not {device}",
                               field="device")
        device = own
        super().__init__(device=device, **engine_kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def load_model(self, name: str = DEFAULT_MODEL) -> BaseModel:
        """Load a base model once, whole on the CPU, then keep this rank's shard of its layers."""
        if name not in self.models:
            self.models[name] = shard_base(load_base_model(name, self.compute_dtype, "cpu"), self.mesh, self.device)
            gc.collect()  # the loaded Hugging Face model sits in reference cycles that hold the whole weights
        return self.models[name]

    def optim_step(self, run_id: str, params: AdamParams | dict | None = None) -> dict[str, float]:
        """Engine.optim_step from rank 0's gradient (equal to every rank's where kernels are deterministic)."""
        _broadcast(list(self.get_run(run_id).grads.values()))
        return super().optim_step(run_id, params)

    def save_state(self, run_id: str, path: str, include_optimizer: bool = True) -> dict:
        """A sharded checkpoint (see save_sharded_state); every rank calls it."""
        return save_sharded_state(self, run_id, path, include_optimizer)

    def save_version(self, run_id: str, version: int, path: str) -> dict:
        """Rank 0 writes the frozen version (an ordinary checkpoint: the adapter is the same on every rank)."""
        self.get_run(run_id)
        return _from_rank0(super().save_version, run_id, version, path)

    def export_lora(self, run_id: str, path: str) -> None:
        """Rank 0 writes the PEFT directory (the adapter is the same on every rank)."""
        self.get_run(run_id)
        _from_rank0(super().export_lora, run_id, path)

    def save_weights(self, run_id: str, path: str, merge: bool = False) -> None:
        """Rank 0 writes the adapter or merged model (the adapter is the same on every rank)."""
        self.get_run(run_id)
        _from_rank0(super().save_weights, run_id, path, merge)


def _broadcast(tensors: list[torch.Tensor]) -> None:
    """Overwrite `tensors` with rank 0's values: one collective over a flat copy."""
    if not tensors or dist.get_world_size() == 1:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def _from_rank0(fn: Callable, *args) -> Any:
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


# ---- sharded checkpoints -------------------------------------------------------------------


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


def save_sharded_state(engine: ShardedEngine, run_id: str, path: str | Path, include_optimizer: bool = True) -> dict:
    """Write the run's adapter (and AdamW moments), each tensor sharded on dim 0 over the ranks; return
    the manifest. Every rank calls it; the directory appears at `path` whole or not at all."""
    run = engine.get_run(run_id)
    target = Path(path)
    if target.exists():  # one filesystem: every rank refuses, before any collective
        raise Conflict(f"{target} already exists", field="path")
    tensors = {f"adapter.{k}": w for k, w in run.weights().items()}
    if include_optimizer:
        tensors |= {f"{m}.{k}": t for m in _MOMENTS for k, t in getattr(run.optimizer, m).items()}
    shards = {k: distribute_tensor(t.detach(), engine.mesh, [Shard(0)], src_data_rank=None)
              for k, t in tensors.items()}  # this rank's rows of each, no communication
    manifest = {"format_version": ckpt.SHARDED_FORMAT, "base_model": run.base.name,
                "lora": run.adapter.config.to_dict(), "has_optimizer": include_optimizer,
                "optimizer_step": run.optimizer.step if include_optimizer else None,
                "world_size": engine.world_size}
    tmp = Path(_from_rank0(temp_beside, target))
    try:
        dcp.save(shards, checkpoint_id=tmp)  # returns on every rank once rank 0 wrote the metadata
        return _from_rank0(_publish, tmp, target, manifest)
    finally:
        if engine.rank == 0:
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


def load_sharded_state(engine: Engine, run_id: str, path: str | Path, with_optimizer: bool = False) -> None:
    """Restore a run from a sharded checkpoint: its weights (fresh optimizer) or weights and AdamW state.

    `engine` is a ShardedEngine on any number of ranks (every rank calls it; each reads its shard of
    every tensor, then the shards are gathered) or an unsharded Engine in one process (reads everything).
    Checks checksums, base model and LoRA geometry before changing anything; clears gradients.
    """
    run = engine.get_run(run_id)
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
    if isinstance(engine, ShardedEngine):
        targets = {k: distribute_tensor(torch.zeros_like(t), engine.mesh, [Shard(0)], src_data_rank=None)
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


# ---- launching ranks -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, n: int, port: int, backend: str, fn: Callable, args: tuple, results) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # n ranks share the CPU's cores
        torch.set_num_threads(max(1, usable_cpus() // n))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        # Pickled here, by value: a tensor put on the queue as is would be shared through a file
        # descriptor that dies with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def spawn_ranks(n: int, fn: Callable, *args, backend: str | None = None, timeout: float = 600.0) -> list:
    """Run fn(*args) in n new processes forming one process group; return each rank's result, in rank order.

    backend: "gloo" (the CPU) or "nccl" (one CUDA device per rank; untested here); default NCCL when
    CUDA is present. fn and its results must pickle (fn a module-level function). A rank that raises,
    dies or outlasts `timeout` seconds fails the call, and the other ranks are ended.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, n, port, backend, fn, args, results)) for rank in range(n)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    late = sorted(set(range(n)) - set(out))
                    raise TimeoutError(f"ranks {late} did not finish in {timeout} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[rank] for rank in range(n)]
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == n else 0)
            if p.is_alive():
                p.terminate()
                p.join()
