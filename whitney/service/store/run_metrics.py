"""Metrics a training loop logs for its own run: what the client computes and the server cannot see (an RL
loop's reward, an evaluation's accuracy), stored beside the run and charted by the console.

A point is (run, name, step) -> value. The step defaults to the run's current optimizer step: the `step` its
newest succeeded optim_step reported (the optimizer's own count, so a run resumed with its optimizer state
goes on counting), 0 before the first. (run_id, name, step) is unique: logging a name again at a step
replaces its value (last write wins), so a client that resends a request after a network error stores it
once. Every run that exists takes metrics, whatever its status: a loop often logs its final evaluation
after finishing the run (runs are never deleted, so no point outlives its run).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sqlalchemy import delete, func, select

from whitney.errors import InvalidInput, TooLarge
from whitney.service.flags import flag
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, OperationStatus
from whitney.service.store.tables import OperationRow, RunMetricRow, RunRow


@dataclass(frozen=True)
class MetricLimits:
    """What one request and one run may log (a name over the length is a 400, over a count a 413)."""

    max_name_chars: int = flag(128, "characters of a metric name (the column's width)")
    max_names_per_request: int = flag(256, "metrics in one request")
    max_names_per_run: int = flag(1024, "distinct metric names of one run")
    max_points_per_run: int = flag(1_000_000, "points (name, step) stored for one run")


LIMITS = MetricLimits()


def check_metrics(metrics: dict, limits: MetricLimits = LIMITS) -> None:
    """Names: 1 to max_name_chars printable characters; values: finite numbers (a bool is no number)."""
    if not metrics:
        raise InvalidInput("metrics must hold at least one name and value", field="metrics")
    if len(metrics) > limits.max_names_per_request:
        raise TooLarge(f"metrics holds {len(metrics)} names; the limit is {limits.max_names_per_request} per request",
                       field="metrics")
    for name, value in metrics.items():
        if not isinstance(name, str) or not 1 <= len(name) <= limits.max_name_chars:
            raise InvalidInput(f"metric name {str(name)[:40]!r} must be 1 to {limits.max_name_chars} characters",
                               field="metrics")
        if not name.isprintable() or name.strip() != name:
            raise InvalidInput(f"metric name {name!r} holds control characters or leading/trailing spaces",
                               field="metrics")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"metric {name!r} must be a number, got {type(value).__name__}", field="metrics")
        if not math.isfinite(value):
            raise InvalidInput(f"metric {name!r} must be a finite number, got {value}", field="metrics")


def current_step(store: Store, run_id: str) -> int:
    """The `step` metric of the run's newest succeeded optim_step: optimizer steps taken (0 before the first)."""
    q = (select(OperationRow.result["metrics"]["step"])
         .where(OperationRow.run_id == run_id, OperationRow.kind == OperationKind.OPTIM_STEP,
                OperationRow.status == OperationStatus.SUCCEEDED)
         .order_by(OperationRow.seq_id.desc()).limit(1))
    with store.tx() as db:
        step = db.scalar(q)
    return int(float(step)) if step is not None else 0


def log_metrics(store: Store, run_id: str, owner: str, metrics: dict[str, float], step: int | None = None,
                limits: MetricLimits = LIMITS) -> dict:
    """Store `metrics` at `step` (default: current_step) for the owner's run; return {run_id, step, metrics}.

    NotFound for a run that is not the owner's; a name logged before at this step is replaced."""
    check_metrics(metrics, limits)
    store.get_run(run_id, owner)  # NotFound for another key's run
    if step is None:
        step = current_step(store, run_id)
    now = time.time()
    with store.tx() as db:
        # Writers of one run take turns: on PostgreSQL on the run's row, on SQLite (one writer at a time) from
        # the delete on. So replacing a point is one move, the limits count what is there, ids commit in order.
        db.execute(select(RunRow.id).where(RunRow.id == run_id).with_for_update())
        db.execute(delete(RunMetricRow).where(RunMetricRow.run_id == run_id, RunMetricRow.step == step,
                                              RunMetricRow.name.in_(list(metrics))))
        _check_room(db, run_id, metrics, limits)  # a refusal rolls the delete back
        db.add_all([RunMetricRow(run_id=run_id, name=name, step=step, value=float(value), logged_at=now)
                    for name, value in metrics.items()])
    return {"run_id": run_id, "step": step, "metrics": {name: float(v) for name, v in metrics.items()}}


def _check_room(db, run_id: str, metrics: dict, limits: MetricLimits) -> None:
    """413 when the run, with `metrics` added (their old points at this step already deleted), would hold more
    distinct names or more points than the limits allow."""
    names = set(db.scalars(select(RunMetricRow.name).where(RunMetricRow.run_id == run_id).distinct()))
    total = len(names | set(metrics))
    if total > limits.max_names_per_run:
        raise TooLarge(f"run {run_id} would log {total} distinct metric names; the limit is "
                       f"{limits.max_names_per_run} per run", field="metrics")
    points = db.scalar(select(func.count()).select_from(RunMetricRow).where(RunMetricRow.run_id == run_id))
    if points + len(metrics) > limits.max_points_per_run:
        raise TooLarge(f"run {run_id} holds {points} metric points, {len(metrics)} more would pass the limit of "
                       f"{limits.max_points_per_run} per run", field="metrics")


def metric_series(store: Store, run_id: str, owner: str, names: list[str] | None = None) -> dict[str, dict]:
    """The owner's run's logged metrics (or only `names`): {name: {"steps": [...], "values": [...]}}, each by
    step, names sorted."""
    store.get_run(run_id, owner)
    q = select(RunMetricRow.name, RunMetricRow.step, RunMetricRow.value).where(RunMetricRow.run_id == run_id)
    if names:
        q = q.where(RunMetricRow.name.in_(names))
    with store.tx() as db:
        rows = db.execute(q.order_by(RunMetricRow.name, RunMetricRow.step)).all()
    out: dict[str, dict] = {}
    for name, step, value in rows:
        series = out.setdefault(name, {"steps": [], "values": []})
        series["steps"].append(step)
        series["values"].append(value)
    return out


def points_after(store: Store, run_id: str, after: int = -1, limit: int = 5000) -> list[dict]:
    """The run's points written after id `after`, oldest write first: `{id, name, step, value, t}` (`t`: when it
    was logged; the console's poll; a replaced point comes again, under its new id)."""
    q = (select(RunMetricRow.id, RunMetricRow.name, RunMetricRow.step, RunMetricRow.value, RunMetricRow.logged_at)
         .where(RunMetricRow.run_id == run_id, RunMetricRow.id > after).order_by(RunMetricRow.id).limit(limit))
    with store.tx() as db:
        rows = db.execute(q).all()
    return [{"id": i, "name": name, "step": step, "value": value, "t": t} for i, name, step, value, t in rows]
