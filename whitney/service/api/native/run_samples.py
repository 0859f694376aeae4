"""Samples a training loop logs for its run (prompts and the completions it sampled), and reading them back
(whitney.service.store.run_samples holds the rules, the bounds and the queries)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query
from pydantic import Field, field_validator

from whitney.service.api.native.schemas import INT64_LIMIT, Out, Wire
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.store import run_samples

router = new_router(prefix="/v1", tags=["runs"])


class SampleIn(Wire):
    prompt: str = Field(description="the prompt as text (a rendered chat, or what the loop shows of it)")
    completion: str = Field(description="the completion sampled for it, as text")
    reward: float | None = Field(default=None, description="a finite number, e.g. the RL reward of this completion")
    metadata: dict[str, Any] | None = Field(default=None, description="a JSON object, at most 4,096 bytes compact")


class SamplesLog(Wire):
    step: Annotated[int, Field(ge=0, lt=INT64_LIMIT)] | None = Field(
        default=None, description="default: the run's current optimizer step (optim_steps taken)")
    samples: list[SampleIn] = Field(description="1 to 64 samples: the step's samples, replacing any logged before")

    @field_validator("samples", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        """How many samples and how long each text, on the raw JSON, before any sample is validated (a 413
        naming the field: TooLarge is no ValueError, so it passes through pydantic to the error handler)."""
        run_samples.check_sizes(value)
        return value


class LoggedSamples(Out):
    run_id: str
    step: int
    count: int


class SampleOut(Out):
    step: int
    index: int
    prompt: str
    completion: str
    reward: float | None
    metadata: dict[str, Any] | None
    logged_at: float


class SampleList(Out):
    run_id: str
    samples: list[SampleOut]


@router.post("/runs/{run_id}/samples", response_model=LoggedSamples, status_code=200)
def log_samples(run_id: str, body: SamplesLog, st: State, who: Owner):
    """Store the samples of `step`, replacing those logged at that step before. Any run of the caller's,
    whatever its status."""
    samples = [s.model_dump() for s in body.samples]
    return run_samples.log_samples(st.store, run_id, who, samples, body.step)


@router.get("/runs/{run_id}/samples", response_model=SampleList)
def get_samples(run_id: str, st: State, who: Owner,
                step: Annotated[int | None, Query(ge=0, lt=INT64_LIMIT)] = None,
                before_step: Annotated[int | None, Query(ge=0, lt=INT64_LIMIT)] = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    """The run's samples, newest step first; `step` keeps one step's, `before_step` pages to older steps."""
    return {"run_id": run_id, "samples": run_samples.list_samples(st.store, run_id, who, step, before_step, limit)}
