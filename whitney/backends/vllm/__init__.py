"""vLLM sampler replicas beside any backend (`whitney serve --samplers K --sampler-engine vllm`): the backend
trains, scores and saves as always; each base model's samples go to vLLM servers that load every run's sampler
versions as LoRA adapters. docs/DEPLOY.md says when to choose them.

- server.py: one vLLM server, a child process running vLLM's environment (`--vllm-python`, .venv-vllm);
- ray_host.py: the same server on a Ray node, in an actor that lives as long as it does;
- requests.py: a sampling request as vLLM's completions request, its answer back; what vLLM does not serve;
- replicas.py: each model's replicas (elastic, restarted), the adapters they load, the samples in flight;
- backend.py: VllmSampling, the ServedBackend that routes samples to them.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from whitney.backends.vllm.backend import VllmSampling
from whitney.backends.vllm.replicas import Launch, ReplicaPool
from whitney.backends.vllm.server import ServerSpec, check_python, default_python, kv_cache_gib
from whitney.protocol.backend import BackendSpec, PackageKind, SamplerReplicas, ServedBackend
from whitney.protocol.training import LoraConfig

__all__ = ["VllmSampling", "with_replicas", "without_replicas"]


def with_replicas(inner: ServedBackend, spec: BackendSpec, on_ray: bool = False) -> VllmSampling:
    """`inner` (started with `spec`'s models) with vLLM replicas per model as `spec.samplers` says: child
    processes of this one, or on Ray (`on_ray`) actors placed with each model's worker resources. The replicas
    the minimum asks for serve before this returns."""
    settings = spec.samplers
    python = settings.vllm_python or default_python()
    check_python(python)
    settings = replace(settings, vllm_python=python)
    names = {**{given: served for given, served in spec.models}, **{served: served for _, served in spec.models}}
    work = Path(tempfile.mkdtemp(prefix="whitney-vllm-"))
    parallel = _tensor_parallel(spec) if on_ray else {}
    models, bases = {}, {}
    for served in dict.fromkeys(names.values()):
        info = inner.models[served]
        if info.vision:
            continue  # Whitney's sampler serves vision models (their images and their processors are its own)
        length = min(info.max_context, settings.max_model_len)
        models[served] = (ServerSpec(python, info.files, served, info.compute_dtype, length,
                                     spec.engine.max_lora_rank, settings.max_loras,
                                     "cpu" if info.device == "cpu" else info.device,
                                     kv_cache_gib(info.files, info.compute_dtype, length),
                                     _with_tensor_parallel(settings.vllm_args, parallel.get(served, 1))),
                          info.eos_token_ids)
        bases[served] = base_adapter(inner, served, work / f"base-{len(bases)}")
    pool = ReplicaPool(models, settings, _ray_launch(spec) if on_ray else None, log_dir=work)
    return VllmSampling(inner, pool, names, {m: pool.register(path) for m, path in bases.items()})


def base_adapter(inner: ServedBackend, model: str, path: Path) -> str:
    """A zero adapter of the model's unembedding, written at `path`: the base model's samples name it. vLLM 0.32's
    CPU build gives a request without an adapter the unembedding delta of whichever adapter holds its last slot;
    a zero delta is the base model exactly (B = 0 at a run's creation: lora.init_adapter)."""
    run_id = f"vllm-base-{path.name}"
    inner.create_run(run_id, model, LoraConfig(rank=1, alpha=1.0, train_attn=False, train_mlp=False,
                                               train_unembed=True))
    try:
        inner.save(run_id, PackageKind.LORA, str(path))
    finally:
        inner.delete_run(run_id)
    return str(path)


def _ray_launch(spec: BackendSpec) -> Launch:
    from whitney.backends.ray.placement import placements
    from whitney.backends.vllm.ray_host import ray_launch

    # Never restarted by Ray: the pool replaces a replica that died (and fails or retries its samples). A model
    # whose trainer is sharded over GPUs gets replicas of as many GPUs, tensor parallel (_tensor_parallel).
    parallel = _tensor_parallel(spec)
    return ray_launch({p.name: {**p.actor_options({"HF_HUB_OFFLINE": "1"}), "max_restarts": 0,
                                "num_gpus": p.num_gpus * parallel.get(p.name, 1)}
                       for p in placements(without_replicas(spec))})


def _tensor_parallel(spec: BackendSpec) -> dict[str, int]:
    """Each model whose trainer is sharded over N > 1 GPUs (`gpus:N`: a base larger than one device): N, the
    tensor-parallel size of its vLLM replicas, each on N GPUs. A model sharded over CPU ranks samples on one."""
    from whitney.backends.ray.placement import placements

    return {p.name: p.shards for p in placements(without_replicas(spec)) if p.shards > 1 and p.num_gpus}


def _with_tensor_parallel(args: tuple[str, ...], size: int) -> tuple[str, ...]:
    """vLLM's arguments with `--tensor-parallel-size size`, unless size is 1 or the operator's arguments set it."""
    if size == 1 or any(a.startswith(("--tensor-parallel-size", "-tp")) for a in args):
        return args
    return (*args, "--tensor-parallel-size", str(size))


def without_replicas(spec: BackendSpec) -> BackendSpec:
    """The spec the wrapped backend starts with: the replicas are this package's."""
    return replace(spec, samplers=SamplerReplicas())
