"""VllmSampling: a backend (in-process or Ray) whose samples vLLM replicas serve.

    Scheduler ── training, scoring, saves ──────────────> the backend it wraps (exact: the trainer's numbers)
             └─ samples ── vLLM can serve them exactly? ─> ReplicaPool (replicas.py): vLLM servers
                         └ else ─────────────────────────> the wrapped backend's own sampler

A run's sampler version is saved by the wrapped backend as always, and also written as a PEFT adapter inside
the version's package (`ADAPTER_DIR`), which every ready replica loads before the save returns. compute_logprobs
stays exact: it is the trainer's. What vLLM cannot do as Whitney's contract says (requests.exact_only; a
state checkpoint, not a sampler version) goes to Whitney's sampler, which `ModelInfo.sampler_engine` and the
capabilities tell.

Sampling runs on the scheduler's sampling thread (`separate_sampling`). A wrapped backend that samples on the
training thread (in-process) is then called under one lock, so its engine never runs two calls at once.
"""

from __future__ import annotations

import json
import shutil
import threading
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from whitney.backends.vllm.replicas import STEP_WAIT, ReplicaPool, adapter_name
from whitney.backends.vllm.requests import exact_only
from whitney.engine.training.checkpoint import read_manifest
from whitney.protocol.backend import (ChatTokens, Failure, ModelInfo, PackageKind, Residency, SamplerEngine,
                                      ServedBackend, Weights)
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, ForwardRequest, ForwardResult, LoraConfig

ADAPTER_DIR = "vllm_adapter"  # a sampler version's PEFT adapter, inside its package


def expressible(adapter: Path) -> bool:
    """Whether vLLM applies this PEFT adapter as Whitney does: not an adapter of MoE experts' stacked weights
    (PEFT `target_parameters`), which vLLM's LoRA does not load."""
    return not json.loads((adapter / "adapter_config.json").read_text()).get("target_parameters")


class VllmSampling:
    """The ServedBackend `inner` with its samples on vLLM replicas (see the module docstring)."""

    separate_sampling = True

    def __init__(self, inner: ServedBackend, pool: ReplicaPool, names: dict[str, str], bases: dict[str, str]):
        self.inner = inner
        self.pool = pool
        self._names = names  # every name a model goes by -> the name it is served under
        self._bases = bases  # served model -> the zero adapter its base samples name (vllm/__init__.base_adapter)
        self._lock = nullcontext() if inner.separate_sampling else threading.RLock()
        self._runs: dict[str, str] = {}  # run -> its served model
        self._on_pool: set[str] = set()  # request ids the replicas serve (the rest: inner's sampler)

    @property
    def config(self):
        return self.inner.config

    @property
    def models(self) -> dict[str, ModelInfo]:
        return {name: replace(info, sampler_engine=SamplerEngine.VLLM.value) if name in self.pool.models else info
                for name, info in self.inner.models.items()}

    # ---- what vLLM serves -------------------------------------------------------------------

    def _adapter(self, weights: Weights) -> tuple[str, str] | None:
        """(served model, adapter name) when the replicas can serve these weights."""
        if weights.checkpoint_path is not None:  # a sampler version's package (an ended run's version)
            adapter = Path(weights.checkpoint_path) / ADAPTER_DIR
            if not adapter.is_dir():
                return None  # a state checkpoint: Whitney's sampler reads it
            model = self._names.get(read_manifest(weights.checkpoint_path)["base_model"])
            return (model, self.pool.register(str(adapter))) if model in self.pool.models else None
        if weights.run_id is not None:
            model = self._runs.get(weights.run_id)
            if model is None or not self.pool.has(weights.run_id, weights.version):
                return None  # the wrapped backend names the error (unknown run or version)
            return model, adapter_name(weights.run_id, weights.version)
        model = self._names.get(weights.base_model or next(iter(self.inner.models)))
        return (model, self._bases[model]) if model in self.pool.models else None

    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> None:
        target = self._adapter(weights)
        if target is not None and exact_only(prompt, params, self.pool.models[target[0]].spec.max_model_len) is None:
            self.pool.submit(request_id, target[0], prompt, params, target[1], stream)
            self._on_pool.add(request_id)
            return
        with self._lock:
            self.inner.submit_sample(request_id, prompt, params, weights, stream)

    def sample_step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        ended = self.pool.step(wait=0.0 if self.inner.sampling_in_flight else STEP_WAIT)
        if self.inner.sampling_in_flight:
            with self._lock:
                ended += self.inner.sample_step()
        for request_id, outcome in ended:
            if not isinstance(outcome, SampleProgress):
                self._on_pool.discard(request_id)
        return ended

    def cancel_sample(self, request_id: str) -> None:
        if request_id in self._on_pool:
            self._on_pool.discard(request_id)
            self.pool.cancel(request_id)
            return
        with self._lock:
            self.inner.cancel_sample(request_id)

    def save(self, run_id: str, kind: PackageKind, path: str, include_optimizer: bool = True) -> int | None:
        """As the wrapped backend saves; a sampler version is also written as a PEFT adapter in its package and
        loaded by every ready replica before this returns."""
        with self._lock:
            version = self.inner.save(run_id, kind, path, include_optimizer)
            if kind != PackageKind.SAMPLER or self._runs.get(run_id) not in self.pool.models:
                return version
            adapter = Path(path) / ADAPTER_DIR
            self.inner.save(run_id, PackageKind.LORA, str(adapter))  # the adapter the version just froze
        if expressible(adapter) and self.pool.publish(self._runs[run_id], run_id, version, str(adapter)):
            return version
        shutil.rmtree(adapter, ignore_errors=True)  # Whitney's sampler serves this version, from its state
        return version

    def create_run(self, run_id: str, base_model: str, lora: LoraConfig, resume_path: str | None = None,
                   resume_with_optimizer: bool = False) -> None:
        with self._lock:
            self.inner.create_run(run_id, base_model, lora, resume_path, resume_with_optimizer)
        self._runs[run_id] = self._names.get(base_model, base_model)

    def delete_run(self, run_id: str) -> None:
        with self._lock:
            self.inner.delete_run(run_id)
        self._runs.pop(run_id, None)
        self.pool.forget(run_id)

    # ---- the rest: the wrapped backend's ------------------------------------------------------

    def losses(self) -> dict:
        return self.inner.losses()

    def check_custom_loss(self, definition: dict) -> None:
        self.inner.check_custom_loss(definition)

    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int:
        return self.inner.adapter_bytes(base_model, lora)

    def validate(self, request: ForwardRequest, backward: bool) -> Checked:
        return self.inner.validate(request, backward)  # from any thread, as the service calls it

    def image_tokens(self, base_model: str, chunks: list) -> list[int]:
        return self.inner.image_tokens(base_model, chunks)

    def run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | Failure]:
        with self._lock:
            return self.inner.run_batch(requests, backward)

    def settle_gradients(self, run_id: str, stage: str, keep: bool) -> None:
        with self._lock:
            self.inner.settle_gradients(run_id, stage, keep)

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Failure]:
        with self._lock:
            return self.inner.optim_steps(steps)

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        with self._lock:
            self.inner.load_state(run_id, path, with_optimizer)

    def compute_logprobs(self, sequences: list[list[int]], weights: Weights) -> list[list[float | None]]:
        with self._lock:
            return self.inner.compute_logprobs(sequences, weights)

    def render_chat(self, base_model: str, messages: list[dict], add_generation_prompt: bool = True,
                    mark_assistant: bool = False) -> ChatTokens:
        return self.inner.render_chat(base_model, messages, add_generation_prompt, mark_assistant)

    def encode(self, base_model: str, text: str) -> list[int]:
        return self.inner.encode(base_model, text)

    def decode(self, base_model: str, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.inner.decode(base_model, sequences, skip_special_tokens)

    def take_lost_runs(self) -> list[str]:
        with self._lock:
            return self.inner.take_lost_runs()

    def adopt(self) -> list[str]:
        """The trainer's (a highly available service does not run vLLM replicas: cli.backend_config refuses it)."""
        with self._lock:
            return self.inner.adopt()

    def page_out_idle(self) -> int:
        with self._lock:
            return self.inner.page_out_idle()

    def residency(self) -> Residency:
        return self.inner.residency()

    @property
    def sampling_in_flight(self) -> int:
        return self.pool.in_flight + self.inner.sampling_in_flight

    def close(self) -> None:
        self.pool.close()
        self.inner.close()
