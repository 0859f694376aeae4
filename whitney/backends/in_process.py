"""The "inprocess" backend (whitney/backends): InProcessBackend, the Backend (protocol/backend.py) over an `Engine`
in this process, and what it derives from a loaded model (`model_info`, `adapter_bytes`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass

import torch

from whitney.engine.families import chat
from whitney.engine.families.lora import adaptable_short_names, lora_numel, validate_lora_config
from whitney.engine.families.model import COMPUTE_DTYPES, BaseModel
from whitney.engine.losses.builtin import LossMethods
from whitney.heap import keep_freed_memory
from whitney.engine.sampling.sampler import SampleRequest
from whitney.engine.threads import ComputeThreads
from whitney.engine.training.runs import Engine
from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec, Failure, ModelInfo, PackageKind, Residency, Weights
from whitney.protocol.config import EngineConfig, check_threads, usable_cpus
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, ForwardRequest, ForwardResult, LoraConfig

BYTES_PER_PARAMETER = 16  # a float32 LoRA weight, AdamW's two moments, and the gradient accumulator


def model_info(base: BaseModel, name: str) -> ModelInfo:
    """What routes see of a loaded base model, served as `name`."""
    return ModelInfo(name=name, model_type=base.config.model_type, vocab_size=base.config.vocab_size,
                     max_context=base.config.max_context,
                     adaptable_modules=tuple(sorted(adaptable_short_names(base.linear_shapes))),
                     compute_dtype=next(k for k, v in COMPUTE_DTYPES.items() if v == base.compute_dtype),
                     device=str(base.device), eos_token_ids=tuple(base.eos_token_ids),
                     linear_shapes=dict(base.linear_shapes), weight_bytes=tensor_bytes(vars(base)),
                     vision=base.vision is not None, compute_threads=torch.get_num_threads(),
                     files=str(base.path))


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors reachable from `obj` (tensors, dicts, lists, dataclasses, modules). oneDNN's
    prepacked copies (caches built on first use, no plain storage) are not counted."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.is_mkldnn or obj.device.type == "meta" or obj.data_ptr() in seen:
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(t, seen) for t in (*obj.parameters(), *obj.buffers()))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in fields(obj))
    return 0


def adapter_bytes(linear_shapes: dict[str, tuple[int, int]], lora: LoraConfig, max_rank: int) -> int:
    """Memory one run of this LoRA config holds on a model with these adaptable linears (validates the
    config: InvalidInput)."""
    paths = validate_lora_config(lora, linear_shapes, max_rank)
    return BYTES_PER_PARAMETER * sum(lora_numel(linear_shapes[p], lora.rank) for p in paths)


@dataclass
class InProcessBackend(chat.TextMethods, LossMethods):
    """The Backend over an `Engine` in this process (its numbers are the engine's, unchanged)."""

    engine: Engine
    # This process's compute threads (engine/threads.py), adjusted before each engine call; None: left as they are.
    threads: ComputeThreads | None = None
    _samples: dict[str, SampleRequest] = field(default_factory=dict)
    _info: dict[str, ModelInfo] = field(default_factory=dict)
    separate_sampling = False  # one engine, one thread: sampling steps interleave with training calls

    @classmethod
    def start(cls, config: EngineConfig, models: list[str], threads: ComputeThreads | None = None
              ) -> "InProcessBackend":
        """An engine with `config`, its base models loaded; the process's heap keeps freed memory for reuse
        (whitney/heap.py: no page faults on every call's large tensors). Its compute threads: `threads`, else as
        `config.threads` says, on the CPUs this process may use."""
        keep_freed_memory()
        check_threads(config.threads)
        threads = threads or ComputeThreads.of(config.threads, usable_cpus())
        engine = Engine(max_lora_rank=config.max_lora_rank, compute_dtype=config.compute_dtype,
                        max_sequences=config.max_sequences, max_cached_tokens=config.max_cached_tokens,
                        max_prefill_tokens=config.max_prefill_tokens, device=config.device,
                        page_idle_seconds=config.page_idle_seconds, max_resident_runs=config.max_resident_runs,
                        paging_dir=config.paging_dir, max_pass_mib=config.max_pass_mib)
        backend = cls(engine, threads)
        for name in models:
            backend.load_model(name)
        return backend

    @property
    def config(self) -> EngineConfig:
        """The engine's settings, read from the engine itself (so they can never disagree with it)."""
        e = self.engine
        return EngineConfig(max_lora_rank=e.max_lora_rank, device=str(e.device), compute_dtype=e.compute_dtype_name,
                            max_sequences=e.max_sequences, max_cached_tokens=e.max_cached_tokens,
                            max_prefill_tokens=e.max_prefill_tokens, page_idle_seconds=e.pager.idle_seconds,
                            max_resident_runs=e.pager.max_resident, paging_dir=str(e.pager.root),
                            max_pass_mib=e.max_pass_mib,
                            threads=self.threads and ("auto" if self.threads.adaptive else self.threads.ceiling))

    def load_model(self, name: str, alias: str | None = None) -> ModelInfo:
        """Load a base model (once) and describe it; `alias` names the same model a second way."""
        base = self.engine.load_model(name)
        info = model_info(base, alias or name)
        self._info[info.name] = info
        if alias is not None:
            self.engine.models.setdefault(alias, base)
        return info

    @property
    def models(self) -> dict[str, ModelInfo]:
        return dict(self._info)

    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int:
        return adapter_bytes(self.engine.load_model(base_model).linear_shapes, lora, self.engine.max_lora_rank)

    def validate(self, request: ForwardRequest, backward: bool) -> Checked:
        return self.engine.validate(request, backward)

    def image_tokens(self, base_model: str, chunks: list) -> list[int]:
        return self.engine.image_tokens(base_model, chunks)

    def create_run(self, run_id: str, base_model: str, lora: LoraConfig, resume_path: str | None = None,
                   resume_with_optimizer: bool = False) -> None:
        self.engine.create_run(run_id, base_model, lora)
        if resume_path is not None:
            try:
                self.engine.load_state(run_id, resume_path, with_optimizer=resume_with_optimizer)
            except BaseException:
                self.engine.delete_run(run_id)
                raise

    def delete_run(self, run_id: str) -> None:
        self.engine.delete_run(run_id)

    @contextmanager
    def _computing(self):
        """Around an engine call: the compute threads follow the machine's load (engine/threads.py)."""
        if self.threads is None:
            yield
            return
        self.threads.before_call()
        try:
            yield
        finally:
            self.threads.after_call()

    def run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | Failure]:
        with self._computing():
            results = self.engine.run_batch(requests, backward)
        return [Failure.of(r) if isinstance(r, BaseException) else r for r in results]

    def settle_gradients(self, run_id: str, stage: str, keep: bool) -> None:
        if keep:
            self.engine.commit_gradients(run_id, stage)
        else:
            self.engine.discard_gradients(run_id, stage)

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Failure]:
        return [Failure.of(r) if isinstance(r, BaseException) else r for r in self.engine.optim_steps(steps)]

    def save(self, run_id: str, kind: PackageKind, path: str, include_optimizer: bool = True) -> int | None:
        """The run written to `path` as a package of `kind`; a sampler version's number (else None)."""
        if kind == PackageKind.STATE:
            self.engine.save_state(run_id, path, include_optimizer)
        elif kind in (PackageKind.WEIGHTS, PackageKind.MERGED):
            self.engine.save_weights(run_id, path, merge=kind == PackageKind.MERGED)
        elif kind == PackageKind.LORA:
            self.engine.export_lora(run_id, path)
        elif kind == PackageKind.SAMPLER:
            version = self.engine.save_weights_for_sampler(run_id)
            self.engine.save_version(run_id, version, path)
            return version
        else:
            raise InvalidInput(f"kind must be one of {[k.value for k in PackageKind]}, got {kind!r}", field="kind")
        return None

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        self.engine.load_state(run_id, path, with_optimizer)

    def compute_logprobs(self, sequences: list[list[int]], weights: Weights) -> list[list[float | None]]:
        with self._computing():
            return self.engine.compute_logprobs(sequences, **weights.as_kwargs())

    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> None:
        request = self.engine.submit_sample(prompt, params, **weights.as_kwargs())
        request.stream = stream  # before its first step, which runs on this same thread
        self._samples[request_id] = request

    def sample_step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        """One admit + decode step; the requests that ended in it, and the progress of streaming ones that
        did not. A failure of the step itself (a bug in the shared decode pass) fails every request in flight
        and starts the samplers afresh."""
        if not self._samples:
            return []
        try:
            with self._computing():
                self.engine.sample_step()
        except Exception as e:
            failed = [(request_id, Failure.of(e)) for request_id in self._samples]
            self._samples.clear()
            self.engine.reset_sampling()
            return failed
        ended = []
        for request_id, request in list(self._samples.items()):
            if request.error is not None:
                ended.append((request_id, Failure.of(request.error)))
            elif request.done:
                ended.append((request_id, request.result))
            else:
                progress = request.take_progress()
                if progress is not None:
                    ended.append((request_id, progress))
                continue
            del self._samples[request_id]
        return ended

    def cancel_sample(self, request_id: str) -> None:
        """Stop a sample now: out of its sampler's queue, or its rows and their cache out of the batch before the
        next step (Sampler.cancel); never reported again. An unknown or ended id is ignored."""
        request = self._samples.pop(request_id, None)
        if request is None:
            return
        for sampler in self.engine.samplers.values():
            if sampler.cancel(request):
                return

    def tokenizer(self, base_model: str):
        """A loaded model's own tokenizer; never loads a model (RayBackend makes its own from `tokenizer_files`)."""
        base = self.engine.models.get(base_model)
        if base is None:
            raise InvalidInput(f"base model {base_model!r} is not served here", field="base_model")
        return base.tokenizer

    def tokenizer_files(self, base_model: str) -> dict[str, bytes]:
        """A loaded model's own tokenizer as plain data (chat.tokenizer_files), for a proxy elsewhere."""
        return chat.tokenizer_files(self.tokenizer(base_model))

    def take_lost_runs(self) -> list[str]:
        """Runs whose paged-out state could not be read back since the last call (engine/memory/paging.py);
        the engine itself lives and dies with this process."""
        return self.engine.take_lost_runs()

    def adopt(self) -> list[str]:
        """A new scheduling leader takes this backend over (service/cluster): the samples in flight, the former
        leader's, are cancelled (nobody waits for them); the runs it holds, which the new leader goes on with."""
        for request_id in list(self._samples):
            self.cancel_sample(request_id)
        return list(self.engine.runs)

    def page_out_idle(self) -> int:
        return self.engine.page_out_idle()

    def residency(self) -> Residency:
        return Residency.of_counts(self.engine.residency())

    @property
    def sampling_in_flight(self) -> int:
        """Sampling requests in flight."""
        return len(self._samples)

    def close(self) -> None:
        self.engine.pager.close()  # the paged-out runs' files




def start_backend(spec: BackendSpec) -> InProcessBackend:
    """The in-process backend (whitney/backends: "inprocess") with the spec's models loaded, each also under the
    name it is served by. The Ray settings are refused here, never ignored."""
    if spec.ray_address or spec.samplers.maximum or spec.worker_resources:
        raise InvalidInput("ray_address, worker_resources and samplers of Whitney's own engine need the ray backend "
                           "(--sampler-engine vllm runs replicas beside either backend)", field="backend")
    backend = InProcessBackend.start(spec.engine, [])
    for name, served in spec.models:
        backend.load_model(name, alias=served)
    return backend
