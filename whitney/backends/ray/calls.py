"""The calls the Ray backend sends its workers, one type each (torch-free: the proxy builds them).

A call is plain data: its fields are the Backend call's arguments (protocol types, pickled), and `on` says what
the worker runs with them on its `InProcessBackend` (actor.py `ModelWorker.run`). So each operation is named once,
by a class a linter checks, and a call's answer has the type its `on` returns. The lifecycle of the actor itself
(`describe`, `address`, `join`) is the actor's own methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from whitney.protocol.backend import Failure, PackageKind, Residency, Weights
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, ForwardRequest, ForwardResult, LoraConfig

if TYPE_CHECKING:
    from whitney.backends.in_process import InProcessBackend

T = TypeVar("T")
CHECKS = "checks"  # the Ray concurrency group of a worker's heavy calls
CHECK_THREADS = 2  # its threads: a worker's heavy calls at once (each key has at most 2 heavy checks at once)


class Call(Generic[T]):
    """One call for a worker's backend; the worker sends back what `on` returns. A `heavy` call (a request's check:
    images decoded and processed) runs beside the others, on one of CHECK_THREADS threads of the worker's at a
    lowered CPU priority (whitney/priority.py), not in their turn: training never waits behind one."""

    heavy: ClassVar[bool] = False

    def on(self, backend: InProcessBackend) -> T:
        raise NotImplementedError


@dataclass(frozen=True)
class Raised:
    """A WhitneyError raised in a worker, carried back as data (the proxy raises it again)."""

    failure: Failure


@dataclass(frozen=True)
class Validate(Call[Checked]):
    request: ForwardRequest
    backward: bool
    heavy: ClassVar[bool] = True

    def on(self, backend: InProcessBackend) -> Checked:
        return backend.validate(self.request, self.backward)


@dataclass(frozen=True)
class ImageTokens(Call[list[int]]):
    base_model: str
    chunks: list
    heavy: ClassVar[bool] = True

    def on(self, backend: InProcessBackend) -> list[int]:
        return backend.image_tokens(self.base_model, self.chunks)


@dataclass(frozen=True)
class CreateRun(Call[None]):
    run_id: str
    base_model: str
    lora: LoraConfig
    resume_path: str | None = None
    resume_with_optimizer: bool = False

    def on(self, backend: InProcessBackend) -> None:
        backend.create_run(self.run_id, self.base_model, self.lora, self.resume_path, self.resume_with_optimizer)


@dataclass(frozen=True)
class DeleteRun(Call[None]):
    run_id: str

    def on(self, backend: InProcessBackend) -> None:
        backend.delete_run(self.run_id)


@dataclass(frozen=True)
class RunBatch(Call[list]):
    requests: list[ForwardRequest]
    backward: bool

    def on(self, backend: InProcessBackend) -> list[ForwardResult | Failure]:
        return backend.run_batch(self.requests, self.backward)


@dataclass(frozen=True)
class SettleGradients(Call[None]):
    run_id: str
    stage: str
    keep: bool

    def on(self, backend: InProcessBackend) -> None:
        backend.settle_gradients(self.run_id, self.stage, self.keep)


@dataclass(frozen=True)
class OptimSteps(Call[list]):
    steps: list[tuple[str, AdamParams]]

    def on(self, backend: InProcessBackend) -> list[dict[str, float] | Failure]:
        return backend.optim_steps(self.steps)


@dataclass(frozen=True)
class Save(Call[int | None]):
    run_id: str
    kind: PackageKind
    path: str
    include_optimizer: bool = True

    def on(self, backend: InProcessBackend) -> int | None:
        return backend.save(self.run_id, self.kind, self.path, self.include_optimizer)


@dataclass(frozen=True)
class LoadState(Call[None]):
    run_id: str
    path: str
    with_optimizer: bool = False

    def on(self, backend: InProcessBackend) -> None:
        backend.load_state(self.run_id, self.path, self.with_optimizer)


@dataclass(frozen=True)
class ComputeLogprobs(Call[list]):
    sequences: list[list[int]]
    weights: Weights

    def on(self, backend: InProcessBackend) -> list[list[float | None]]:
        return backend.compute_logprobs(self.sequences, self.weights)


@dataclass(frozen=True)
class Warm(Call[None]):
    """Load a frozen sampler version (checksums verified) so the first sample on it does not wait: one token
    scored on it, which loads it the way every later sample and score on it finds it."""

    checkpoint_path: str

    def on(self, backend: InProcessBackend) -> None:
        backend.compute_logprobs([[0]], Weights(checkpoint_path=self.checkpoint_path))


@dataclass(frozen=True)
class SubmitSample(Call[None]):
    request_id: str
    prompt: list
    params: SamplingParams
    weights: Weights
    stream: bool = False

    def on(self, backend: InProcessBackend) -> None:
        backend.submit_sample(self.request_id, self.prompt, self.params, self.weights, self.stream)


@dataclass(frozen=True)
class CancelSample(Call[None]):
    """Stop a sample: its rows and their cache leave the worker's batch before its next step."""

    request_id: str

    def on(self, backend: InProcessBackend) -> None:
        backend.cancel_sample(self.request_id)


@dataclass(frozen=True)
class SampleSteps(Call[list]):
    """Decode steps until a request ends or `seconds` pass (0: one step): the streaming requests' progress over
    those steps (one report each), then the requests that ended (whose results hold every token, so a request
    that ended reports no progress)."""

    seconds: float

    def on(self, backend: InProcessBackend) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        start = time.monotonic()
        progress: dict[str, SampleProgress] = {}
        while True:
            ended = []
            for request_id, outcome in backend.sample_step():
                if not isinstance(outcome, SampleProgress):
                    ended.append((request_id, outcome))
                elif request_id in progress:
                    progress[request_id].extend(outcome)
                else:
                    progress[request_id] = outcome
            if ended or not backend.sampling_in_flight or time.monotonic() - start >= self.seconds:
                done = {request_id for request_id, _ in ended}
                return [(r, p) for r, p in progress.items() if r not in done] + ended


@dataclass(frozen=True)
class TokenizerFiles(Call[dict[str, bytes]]):
    """The model's own tokenizer as plain data, its files (the proxy makes it once and renders chats with it)."""

    base_model: str

    def on(self, backend: InProcessBackend) -> dict[str, bytes]:
        return backend.tokenizer_files(self.base_model)


@dataclass(frozen=True)
class PageOutIdle(Call[int]):
    def on(self, backend: InProcessBackend) -> int:
        return backend.page_out_idle()


@dataclass(frozen=True)
class TakeLostRuns(Call[list]):
    """The trainer's runs whose paged-out state could not be read back since the last call."""

    def on(self, backend: InProcessBackend) -> list[str]:
        return backend.take_lost_runs()


@dataclass(frozen=True)
class CountResidency(Call[Residency]):
    def on(self, backend: InProcessBackend) -> Residency:
        return backend.residency()


@dataclass(frozen=True)
class Adopt(Call[list]):
    """A new scheduling leader takes the worker over: its samples in flight cancelled, the runs it holds."""

    def on(self, backend: InProcessBackend) -> list[str]:
        return backend.adopt()
