"""Base models bigger than one device, and training faster with more ranks: the decoder layers sharded over the
ranks of a process group (FSDP2), each pass's rows split over them (data parallelism).

`ShardedEngine` is the `Engine` of one rank. Every rank of the group makes the same calls in the same order
(SPMD: whatever drives the worker sends each call to every rank) and gets the same results.

Sharded (`Decoder.shard`, families/): each decoder layer's frozen weights live in a module (a fast family's
layer weights as parameters without gradients, `transformer.LayerStack`) wrapped by FSDP2
(`torch.distributed.fsdp.fully_shard`, one unit per layer), so at rest a rank holds 1/N of every layer weight
(dim 0). Each layer runs through its module's `__call__`: FSDP2's hooks all-gather the layer's weights before its
forward and again before its backward, and free them after each.
Replicated on every rank: the embedding, final norm and unembedding (a small share of a large model; a
general-path model's embedding is a unit of its own, gathered for its forward), and each run's LoRA weights and
AdamW moments (r * (in + out) per module).

Data parallel (data_parallel.py): each rank runs its share of a pass's datums (whole, balanced by tokens), the
values every loss reads are all-gathered so each rank applies every loss to the whole request, and each rank
keeps its share of the gradients until an optim_step sums them over the ranks (one all-reduce). N ranks do 1/N of
a pass's compute each, and the results equal the unsharded engine's to float32 rounding.

Checkpoints (`save_sharded_state`, `load_sharded_state`): each rank writes its shards of the adapter and AdamW
moments, read back onto any number of ranks or into one process (sharded_checkpoint.py).

`spawn_ranks` starts N processes forming one group: gloo on the CPU (tested), NCCL with one CUDA device per
rank (written, untested here: no GPU). Each rank reads only its shards of the layers (families/rank_local.py).

Shape legend: D hidden, r LoRA rank, N ranks.
"""

from __future__ import annotations

import gc
import pickle
import queue
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from whitney.engine.families.decoder import BaseModel
from whitney.ports import free_port
from whitney.engine.families.rank_local import load_sharded
from whitney.engine.training import checkpoint as ckpt
from whitney.engine.training.batch import Prepared
from whitney.engine.training.data_parallel import compute_split_pass, sum_gradients
from whitney.engine.training.run import Run
from whitney.engine.training.runs import Engine
from whitney.engine.training.sharded_checkpoint import from_rank0, load_sharded_run, save_sharded_run
from whitney.errors import InvalidInput, WhitneyError
from whitney.protocol.config import DEFAULT_MODEL, usable_cpus
from whitney.protocol.training import ForwardResult


# ---- the sharded base ----------------------------------------------------------------------


def shard_unit(mesh: DeviceMesh) -> Callable[[torch.nn.Module], None]:
    """What `Decoder.shard` calls on each unit: FSDP2 over `mesh`. Every unit frees its gathered weights after its
    forward, a unit without a parent unit too (FSDP2 would keep a root's for the backward: the general path's units
    have no root over them, families/general.py)."""
    return lambda module: fully_shard(module, mesh=mesh, reshard_after_forward=True)


# ---- the engine of one rank ----------------------------------------------------------------


class ShardedEngine(Engine):
    """The Engine of one rank of the default process group; its base models are sharded over every rank, and each
    pass's rows split over them.

    gloo: the CPU. NCCL: the rank's current CUDA device (spawn_ranks sets it). Every rank makes the same
    calls in the same order; results, LoRA weights and optimizer state are equal on every rank (gradients: each
    rank holds its share until an optim_step sums them).
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
        """Load a base model once, this rank reading only its shard of the layers where the family allows
        (families/rank_local.py)."""
        if name not in self.models:
            self.models[name] = load_sharded(name, self.compute_dtype, shard_unit(self.mesh), self.device, self.rank,
                                             self.world_size)
            gc.collect()  # a Hugging Face model sits in reference cycles that hold its weights
        return self.models[name]

    def _compute(self, base: BaseModel, items: list[Prepared], backward: bool) -> list[ForwardResult | WhitneyError]:
        """One pass, its rows split over the ranks (data_parallel.py)."""
        return compute_split_pass(base, items, backward)

    def _pass_budget(self, base: BaseModel) -> int:
        """Engine._pass_budget for the whole group: each rank keeps the activations of about 1/N of a pass."""
        return super()._pass_budget(base) * self.world_size

    def _sum_gradients(self, runs: list[Run]) -> None:
        """Every rank's share of the runs' gradients summed, on every rank (data_parallel.py)."""
        sum_gradients(runs)

    def save_state(self, run_id: str, path: str, include_optimizer: bool = True) -> dict:
        """A sharded checkpoint (sharded_checkpoint.py); every rank calls it."""
        return save_sharded_state(self, run_id, path, include_optimizer)

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        """Engine.load_state; a sharded checkpoint is read as every rank's shard of each tensor, then gathered."""
        if ckpt.is_sharded(path):
            return load_sharded_run(self.get_run(run_id), path, with_optimizer, self.mesh)
        return super().load_state(run_id, path, with_optimizer)

    def save_version(self, run_id: str, version: int, path: str) -> dict:
        """Rank 0 writes the frozen version (an ordinary checkpoint: the adapter is the same on every rank)."""
        self.get_run(run_id)
        return from_rank0(super().save_version, run_id, version, path)

    def export_lora(self, run_id: str, path: str) -> None:
        """Rank 0 writes the PEFT directory (the adapter is the same on every rank)."""
        self.get_run(run_id)
        from_rank0(super().export_lora, run_id, path)

    def save_weights(self, run_id: str, path: str, merge: bool = False) -> None:
        """Rank 0 writes the adapter or merged model (the adapter is the same on every rank)."""
        self.get_run(run_id)
        from_rank0(super().save_weights, run_id, path, merge)


def save_sharded_state(engine: ShardedEngine, run_id: str, path: str | Path, include_optimizer: bool = True) -> dict:
    """Write the run's adapter (and AdamW moments) sharded over the engine's ranks; return the manifest (every
    rank calls it)."""
    return save_sharded_run(engine.get_run(run_id), path, include_optimizer, engine.mesh)


def load_sharded_state(engine: Engine, run_id: str, path: str | Path, with_optimizer: bool = False) -> None:
    """Restore a run from a sharded checkpoint: onto the ranks of a ShardedEngine (every rank calls it) or into
    an unsharded Engine in one process."""
    mesh = engine.mesh if isinstance(engine, ShardedEngine) else None
    load_sharded_run(engine.get_run(run_id), path, with_optimizer, mesh)


# ---- launching ranks -----------------------------------------------------------------------


def _rank_main(rank: int, n: int, port: int, backend: str, threads: int | None, fn: Callable, args: tuple,
               results) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # n ranks share the CPU's cores, unless told how many threads each computes with
    torch.set_num_threads(threads or max(1, usable_cpus() // n))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        # Pickled here, by value: a tensor put on the queue as is would be shared through a file
        # descriptor that dies with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def spawn_ranks(n: int, fn: Callable, *args, backend: str | None = None, timeout: float = 600.0,
                threads: int | None = None) -> list:
    """Run fn(*args) in n new processes forming one process group; return each rank's result, in rank order.

    backend: "gloo" (the CPU) or "nccl" (one CUDA device per rank; untested here); default NCCL when
    CUDA is present. threads: each rank's compute threads (default: the usable CPUs shared out). fn and its
    results must pickle (fn a module-level function). A rank that raises,
    dies or outlasts `timeout` seconds fails the call, and the other ranks are ended.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, n, port, backend, threads, fn, args, results))
             for rank in range(n)]
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
