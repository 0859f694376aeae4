"""Metrics a training loop logs for its run (an RL loop's reward...), and the series it logged
(whitney.service.store.run_metrics holds the rules and the table)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query
from pydantic import Field

from whitney.service.api.native.schemas import INT64_LIMIT, Out, Wire
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.store import run_metrics

router = new_router(prefix="/v1", tags=["runs"])


class MetricsLog(Wire):
    """Values by name at one step. Names and values are checked by run_metrics.check_metrics (a 400 naming the
    metric), so that a NaN or an overlong name reads as the rule it breaks."""

    step: Annotated[int, Field(ge=0, lt=INT64_LIMIT)] | None = Field(
        default=None, description="default: the run's current optimizer step (optim_steps taken)")
    metrics: dict[str, float] = Field(description="name -> a finite number, e.g. {\"reward/mean\": 0.41}")


class LoggedMetrics(Out):
    run_id: str
    step: int
    metrics: dict[str, float]


class Series(Out):
    steps: list[int]
    values: list[float]


class MetricSeries(Out):
    run_id: str
    metrics: dict[str, Series]


@router.post("/runs/{run_id}/metrics", response_model=LoggedMetrics, status_code=200)
def log_metrics(run_id: str, body: MetricsLog, st: State, who: Owner):
    """Store the values at `step`; a name logged before at that step is replaced. Any run of the caller's,
    whatever its status (a final evaluation after finish is usual)."""
    return run_metrics.log_metrics(st.store, run_id, who, body.metrics, body.step)


@router.get("/runs/{run_id}/metrics", response_model=MetricSeries)
def get_metrics(run_id: str, st: State, who: Owner,
                name: Annotated[list[str], Query()] = []):  # noqa: B006 (FastAPI's form)
    """The run's logged series by name, each ordered by step; `name` (repeatable) keeps only those."""
    return {"run_id": run_id, "metrics": run_metrics.metric_series(st.store, run_id, who, name or None)}
