"""The Backend: the narrow interface the service drives an engine through, over plain data (torch-free).

Everything that crosses it is a dataclass of lists, numbers and strings (no tensors, no live objects,
no exception objects in results), so a backend can live in this process (backends/in_process.py, over the
`Engine`) or in other ones (backends/ray: a proxy to actors) behind the same calls. Three small interfaces:

Backend, what operations call (17 methods, plus `config` and `separate_sampling`):
  models                          {name: ModelInfo}: what routes read (vocabulary, context, modules, dtype, device)
  losses()                        the loss table as plain data: each loss's inputs, config keys and defaults
  check_custom_loss(definition)   a custom loss graph checked against the allow-lists (InvalidInput names the node)
  adapter_bytes(base, lora)       memory one run of that LoRA config holds (validates the config)
  validate(request, backward)     check a forward request without running it -> Checked: each datum's positions
                                  and its cost (positions, plus a custom loss's graph work), which the
                                  scheduler shares the engine by
  image_tokens(base, chunks)      the positions each image chunk of a prompt or sequence takes: each image decoded
                                  and processed on the calling thread (a request's), kept for the request that
                                  carries it, so the worker that runs it does not decode it again
  create_run / delete_run         a run's adapter (optionally loaded from a checkpoint), and its end
  run_batch(requests, backward)   forward(_backward) of several runs' requests: a result or a Failure each
  settle_gradients(run_id, stage, keep)   a micro-batched operation's staged gradient, added (keep) or dropped
  optim_steps([(run_id, params)]) several runs' optim_steps in one call: a result or a Failure each, each
                                  bitwise the run's own optim_step
  save(run_id, kind, path, include_optimizer) -> sampler version | None: the run written to `path` as a
                                  package of `kind` (PackageKind), atomically
  load_state(run_id, path, with_optimizer)
  compute_logprobs(sequences, weights)
  submit_sample(request_id, prompt, params, weights, stream=False); sample_step() -> [(request_id, result |
                                  Failure | SampleProgress)]: a request's end, or (streaming requests only)
                                  the tokens it chose since its last report; a request's progress always
                                  comes before its end
  cancel_sample(request_id)       stop a sample whose client went away or cancelled it: it leaves the queue,
                                  or its rows leave the batch before the next decode step and their cache is
                                  freed; sample_step never names it again. An unknown or ended id is ignored
  separate_sampling               True when sampling and scoring run apart from training (other workers):
                                  the service then drives them from a second thread

Tokenizers, a base model's own tokenizer and chat template (callable from any thread; no engine state):
  render_chat(base_model, messages, add_generation_prompt, mark_assistant) -> ChatTokens
  encode(base_model, text) -> [int]; decode(base_model, sequences, skip_special_tokens) -> [str]

Housekeeping, what the scheduler and the metrics do between operations:
  take_lost_runs()                runs whose worker died since the last call (their state is gone)
  page_out_idle()                 page out runs idle for `config.page_idle_seconds` (engine/memory/paging.py);
                                  the scheduler's training thread calls it between engine calls
  residency() -> Residency        runs in memory and paged out, and the paging so far; from any thread
  sampling_in_flight              sampling requests in flight (the metrics' batch occupancy)
  close()                         stop the workers

`ServedBackend` is all three: what `whitney.backends.start` returns and the service holds. Single calls raise
a `WhitneyError` for the caller's mistakes and `WorkerLost` when the worker holding the state died; anything
else is a bug of the backend.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol, runtime_checkable

from whitney.errors import Conflict, InvalidInput, NotFound, TooLarge, Unavailable, WhitneyError
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, ForwardRequest, ForwardResult, LoraConfig


@dataclass(frozen=True)
class ModelInfo:
    """A loaded base model as routes see it: read-only, and the same wherever the model lives."""

    name: str
    model_type: str
    vocab_size: int
    max_context: int
    adaptable_modules: tuple[str, ...]  # LoRA target names (q_proj, ..., lm_head)
    compute_dtype: str  # resolved: "float32" or "bfloat16"
    device: str  # resolved: "cpu" or "cuda:N"
    eos_token_ids: tuple[int, ...]
    linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # path -> (in, out[, E])
    weight_bytes: int = 0  # the frozen base's tensors held by the worker (its shard, when sharded)
    vision: bool = False  # takes image chunks (a vision-language checkpoint with its processor; engine/vision.py)
    compute_threads: int = 1  # torch's threads in the process that trains it when idle (EngineConfig.threads)
    files: str = ""  # its Hugging Face directory where the worker that loaded it runs (what a vLLM replica loads)
    sampler_engine: str = "whitney"  # what serves its samples: SamplerEngine (vLLM replicas: vllm)


@dataclass(frozen=True)
class ChatTokens:
    """A rendered conversation: its token ids [N] and, when asked for, 1 on each assistant message's tokens
    (end-of-turn tokens included) and 0 elsewhere [N]."""

    tokens: list[int]
    assistant_mask: list[int] | None = None


class WorkerLost(RuntimeError):
    """The worker process that held a run's state (or ran a request) died; what it held is gone."""

    code = "worker_lost"


@dataclass(frozen=True)
class Weights:
    """Which weights to score or sample with: a run's sampler version, a saved checkpoint, or a base model."""

    run_id: str | None = None
    version: int | None = None
    checkpoint_path: str | None = None
    base_model: str | None = None

    def as_kwargs(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Failure:
    """An operation's error as data. category "user": the caller's mistake (a 4xx kind); "server": a bug."""

    code: str
    message: str
    category: str = "user"
    field: str | None = None
    datum_index: int | None = None

    @classmethod
    def of(cls, error: BaseException) -> "Failure":
        if isinstance(error, WhitneyError):
            return cls(error.code, error.message, "user", error.field, error.datum_index)
        if isinstance(error, WorkerLost):
            return cls(WorkerLost.code, str(error), "server")
        return cls("internal", f"{type(error).__name__}: {error}", "server")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


_ERRORS = {cls.code: cls for cls in (InvalidInput, NotFound, TooLarge, Conflict, Unavailable)}


def raise_failure(failure: Failure) -> None:
    """Raise the error a Failure carries: a user's as its WhitneyError, a lost worker's as WorkerLost."""
    if failure.code == WorkerLost.code:
        raise WorkerLost(failure.message)
    if failure.category == "user":
        raise _ERRORS.get(failure.code, WhitneyError)(failure.message, field=failure.field,
                                                      datum_index=failure.datum_index)
    raise RuntimeError(f"{failure.code}: {failure.message}")


class SamplerEngine(StrEnum):
    """What a sampler replica runs: Whitney's own sampler (exact: its log-probs are compute_logprobs'), or a
    vLLM server (whitney/backends/vllm: paged attention, CUDA graphs; its log-probs are close, not equal)."""

    WHITNEY = "whitney"
    VLLM = "vllm"


class ExactOnly(StrEnum):
    """What vLLM replicas do not serve exactly as Whitney's contract says: such a sample goes to Whitney's own
    sampler (the capabilities list these for a model whose sampler engine is vLLM)."""

    IMAGES = "prompts with image chunks"
    # Whitney's are exact; and vLLM 0.32's CPU build with LoRA enabled fails its whole batch on them when they
    # share a batch or ask for several samples (docs/DEPLOY.md).
    PROMPT_LOGPROBS = "prompt log-probs (prompt_logprobs, topk_prompt_logprobs)"
    TARGET_LOGPROBS = "target_prompt_logprobs"
    STOP_SEQUENCES = "stop sequences of several token ids"
    LONG = "a prompt plus max_tokens beyond the replicas' context (whitney serve --vllm-max-model-len)"
    STATE_CHECKPOINTS = "sampling a state checkpoint (save_state); sampler versions are served, an ended run's too"


@dataclass(frozen=True)
class SamplerReplicas:
    """Each base model's sampler replicas: between `minimum` and `maximum` of them (elastic when they differ: one
    starts when a sample finds none, or all busy, and one idle for `idle_seconds` stops), run by `engine`."""

    BUSY: ClassVar[int] = 32  # samples in flight on every replica before an elastic model starts one more

    minimum: int = 0
    maximum: int = 0
    engine: SamplerEngine = SamplerEngine.WHITNEY
    vllm_python: str | None = None  # the interpreter of vLLM's environment (None: `make vllm-env`'s .venv-vllm)
    idle_seconds: float = 300.0
    max_loras: int = 8  # vLLM: adapters held at once on its device (more are reloaded from their files on demand)
    max_model_len: int = 8192  # vLLM: the longest prompt plus max_tokens it serves (beyond: Whitney's sampler)
    vllm_args: tuple[str, ...] = ()  # vLLM: more arguments of its server, as given (e.g. --gpu-memory-utilization)

    @property
    def elastic(self) -> bool:
        return self.minimum < self.maximum

    @classmethod
    def parse(cls, text: str, **options) -> "SamplerReplicas":
        """`--samplers`: K (always K), "auto" (0..1: one while sampling is asked for) or "MIN..MAX"."""
        text = text.strip()
        low, sep, high = ("0", "..", "1") if text == "auto" else text.partition("..")
        if not sep:
            high = low
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise InvalidInput(f"samplers must be K, auto or MIN..MAX with 0 <= MIN <= MAX, got {text!r}",
                               field="samplers")
        return cls(int(low), int(high), **options)


@dataclass(frozen=True)
class BackendSpec:
    """What `whitney serve` starts a backend with (whitney/backends: the registry of backends by name)."""

    engine: EngineConfig
    models: tuple[tuple[str, str], ...]  # (as given to --model, the name it is served under)
    ray_address: str | None = None  # ray: a running cluster; None: start a local one
    samplers: SamplerReplicas = SamplerReplicas()  # each base model's sampler replicas
    # ray: each model's worker resources, by the name it is given or served under ({"cpus": 2, "gpus": 1, ...})
    worker_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    # A highly available service's name (service/cluster): its members share its workers (Ray: named actors that
    # outlive any member), where the backend can; None: this process's own workers, stopped with it.
    service: str | None = None


class PackageKind(StrEnum):
    """What a save writes (a model package's kind in the store, and `Backend.save`'s `kind`)."""

    STATE = "state"  # the adapter, and the optimizer state when asked: load_state and resume read it
    WEIGHTS = "weights"  # the adapter as a PEFT directory (save_weights)
    MERGED = "merged"  # the base with the adapter merged in (save_weights with merge)
    LORA = "lora"  # the adapter exported for other tools (export_lora)
    SAMPLER = "sampler"  # a frozen sampler version (save_weights_for_sampler): its version number is returned


@dataclass(frozen=True)
class PagingEvents:
    """One kind of paging event so far (page-outs, page-ins or moment reads): how many, their total seconds,
    and their seconds' histogram {upper bound in seconds, as text: count}."""

    count: int = 0
    seconds: float = 0.0
    histogram: dict[str, int] = field(default_factory=dict)

    def plus(self, other: "PagingEvents") -> "PagingEvents":
        bounds = {**self.histogram, **other.histogram}
        return PagingEvents(self.count + other.count, self.seconds + other.seconds,
                            {b: self.histogram.get(b, 0) + other.histogram.get(b, 0) for b in bounds})


@dataclass(frozen=True)
class Residency:
    """Where runs' state is: runs in memory, runs paged out to disk, and the paging done so far."""

    in_memory: int = 0
    paged_out: int = 0
    page_outs: PagingEvents = PagingEvents()
    page_ins: PagingEvents = PagingEvents()
    moment_reads: PagingEvents = PagingEvents()

    EVENTS = ("page_out", "page_in", "moment_read")  # each event's name in the engine's counts

    @classmethod
    def of_counts(cls, counts: dict) -> "Residency":
        """From the engine's counts (engine/memory/paging.py Pager.residency)."""
        events = [PagingEvents(int(counts.get(f"{e}s", 0)), float(counts.get(f"{e}_seconds", 0.0)),
                               dict(counts.get(f"{e}_histogram") or {})) for e in cls.EVENTS]
        return cls(int(counts["in_memory"]), int(counts["paged_out"]), *events)

    def plus(self, other: "Residency") -> "Residency":
        """Two workers' residency together."""
        return Residency(self.in_memory + other.in_memory, self.paged_out + other.paged_out,
                         self.page_outs.plus(other.page_outs), self.page_ins.plus(other.page_ins),
                         self.moment_reads.plus(other.moment_reads))


@runtime_checkable
class Backend(Protocol):
    config: EngineConfig
    separate_sampling: bool

    @property
    def models(self) -> dict[str, ModelInfo]: ...
    def losses(self) -> dict: ...
    def check_custom_loss(self, definition: dict) -> None: ...
    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int: ...
    def validate(self, request: ForwardRequest, backward: bool) -> Checked: ...
    def image_tokens(self, base_model: str, chunks: list) -> list[int]: ...
    def create_run(self, run_id: str, base_model: str, lora: LoraConfig, resume_path: str | None = None,
                   resume_with_optimizer: bool = False) -> None: ...
    def delete_run(self, run_id: str) -> None: ...
    def run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | Failure]: ...
    def settle_gradients(self, run_id: str, stage: str, keep: bool) -> None: ...
    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Failure]: ...
    def save(self, run_id: str, kind: PackageKind, path: str, include_optimizer: bool = True) -> int | None: ...
    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None: ...
    def compute_logprobs(self, sequences: list[list[int]], weights: Weights) -> list[list[float | None]]: ...
    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> None: ...
    def sample_step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]: ...
    def cancel_sample(self, request_id: str) -> None: ...


@runtime_checkable
class Tokenizers(Protocol):
    def render_chat(self, base_model: str, messages: list[dict], add_generation_prompt: bool = True,
                    mark_assistant: bool = False) -> ChatTokens: ...
    def encode(self, base_model: str, text: str) -> list[int]: ...
    def decode(self, base_model: str, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]: ...


@runtime_checkable
class Housekeeping(Protocol):
    def take_lost_runs(self) -> list[str]: ...
    def adopt(self) -> list[str]: ...  # a new scheduling leader takes the workers over: the runs they hold
    def page_out_idle(self) -> int: ...
    def residency(self) -> Residency: ...
    @property
    def sampling_in_flight(self) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class ServedBackend(Backend, Tokenizers, Housekeeping, Protocol):
    """A backend as `whitney serve` runs it: operations, tokenizers and housekeeping."""
