"""vLLM sampler replicas beside any backend (`whitney serve --samplers K --sampler-engine vllm`): the backend
trains, scores and saves as always; each base model's samples go to vLLM servers that load every run's sampler
versions as LoRA adapters. docs/DEPLOY.md says when to choose them.

- server.py: one vLLM server, a child process running vLLM's environment (`--vllm-python`, .venv-vllm);
- requests.py: a sampling request as vLLM's completions request, its answer back; what vLLM does not serve;
- replicas.py: each model's replicas (elastic, restarted), the adapters they load, the samples in flight;
- backend.py: VllmSampling, the ServedBackend that routes samples to them.
"""

from __future__ import annotations

from dataclasses import replace

from whitney.backends.vllm.backend import VllmSampling
from whitney.backends.vllm.replicas import ReplicaPool
from whitney.backends.vllm.server import ServerSpec, check_python, default_python
from whitney.protocol.backend import BackendSpec, SamplerReplicas, ServedBackend

__all__ = ["VllmSampling", "with_replicas"]


def with_replicas(inner: ServedBackend, spec: BackendSpec) -> VllmSampling:
    """`inner` (started with `spec`'s models) with vLLM replicas per model as `spec.samplers` says; the
    replicas the minimum asks for serve before this returns."""
    settings = spec.samplers
    python = settings.vllm_python or default_python()
    check_python(python)
    settings = replace(settings, vllm_python=python)
    names = {**{given: served for given, served in spec.models}, **{served: served for _, served in spec.models}}
    models = {}
    for served in dict.fromkeys(names.values()):
        info = inner.models[served]
        models[served] = (ServerSpec(python, info.files, served, info.compute_dtype, info.max_context,
                                     spec.engine.max_lora_rank, settings.max_loras,
                                     "cpu" if info.device == "cpu" else info.device), info.eos_token_ids)
    return VllmSampling(inner, ReplicaPool(models, settings), names)


def without_replicas(spec: BackendSpec) -> BackendSpec:
    """The spec the wrapped backend starts with: the replicas are this package's."""
    return replace(spec, samplers=SamplerReplicas())
