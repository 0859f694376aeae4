"""What the console reads: light queries over the store's own tables (no second source of truth).

Operation results can be large (a forward_backward's result holds every token's log-prob), so the
curves read only the small parts of a result through JSON paths (`result["loss"]`, `result["metrics"]`),
which SQLite and PostgreSQL both evaluate in the database. Runs execute their operations in seq_id order,
so an operation never ends before one with a lower seq_id of its run (a seq_id waiting for a missing
predecessor stays queued): a poller asks only for points after the last seq_id it has.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sqlalchemy import String, and_, cast, func, or_, select

from whitney.service.store.database import Store
from whitney.service.store.lifecycle import (OPERATION_PENDING, RUN_LIVE, SAMPLING_KINDS, OperationKind,
                                             OperationStatus, RunStatus, SessionStatus)
from whitney.service.store.tables import OperationRow, PackageRow, RunRow, SessionRow

CURVE_KINDS = (OperationKind.FORWARD, OperationKind.FORWARD_BACKWARD, OperationKind.OPTIM_STEP)
TIMELINE_ROWS = 200  # the newest operations a run page shows
RUNS_SHOWN = 500  # the newest runs the runs list shows (a search finds older ones)
RUN_FILTERS = ("live", *RunStatus)  # the runs list's status filter: live (active, finishing, cancelling), or one status


def curve_points(store: Store, run_id: str, after: int = -1, limit: int = 5000) -> list[dict]:
    """A run's metric points after seq_id `after`, oldest first: one per succeeded forward, forward_backward
    or optim_step, `{seq, kind, t, loss, metrics}` (loss None for optim_step, whose metrics hold grad_norm,
    learning_rate and step)."""
    # The loss as_float: SQLite's JSON path would quote a number with 15 digits; a float reads back exactly.
    q = (select(OperationRow.seq_id, OperationRow.kind, OperationRow.finished_at,
                OperationRow.result["loss"].as_float(), OperationRow.result["metrics"])
         .where(OperationRow.run_id == run_id, OperationRow.seq_id > after, OperationRow.kind.in_(CURVE_KINDS),
                OperationRow.status == OperationStatus.SUCCEEDED)
         .order_by(OperationRow.seq_id).limit(limit))
    with store.tx() as db:
        rows = db.execute(q).all()
    return [{"seq": seq, "kind": kind, "t": t, "loss": loss, "metrics": metrics or {}}
            for seq, kind, t, loss, metrics in rows]


def timeline(store: Store, run_id: str, limit: int = TIMELINE_ROWS) -> list[dict]:
    """The run's newest operations, newest first, without their results: seq, kind, status, times, error."""
    q = (select(OperationRow.id, OperationRow.seq_id, OperationRow.kind, OperationRow.status, OperationRow.created_at,
                OperationRow.started_at, OperationRow.finished_at, OperationRow.error)
         .where(OperationRow.run_id == run_id).order_by(OperationRow.seq_id.desc()).limit(limit))
    with store.tx() as db:
        rows = db.execute(q).all()
    out = []
    for op_id, seq, kind, status, created, started, finished, error in rows:
        left_queue = started if started is not None else finished  # None: still queued
        out.append({"id": op_id, "seq": seq, "kind": kind, "status": status, "created_at": created,
                    "started_at": started, "finished_at": finished,
                    "queued_s": None if left_queue is None else left_queue - created,
                    "ran_s": None if started is None or finished is None else finished - started, "error": error})
    return out


def operation_counts(store: Store, run_ids: list[str]) -> dict[str, dict[str, int]]:
    """Per run: operations by status, and succeeded optim_steps as `steps`."""
    if not run_ids:
        return {}
    with store.tx() as db:
        rows = db.execute(select(OperationRow.run_id, OperationRow.kind, OperationRow.status, func.count())
                          .where(OperationRow.run_id.in_(run_ids))
                          .group_by(OperationRow.run_id, OperationRow.kind, OperationRow.status)).all()
    counts: dict[str, dict[str, int]] = {run_id: {"steps": 0} for run_id in run_ids}
    for run_id, kind, status, n in rows:
        c = counts[run_id]
        c[status] = c.get(status, 0) + n
        if kind == OperationKind.OPTIM_STEP and status == OperationStatus.SUCCEEDED:
            c["steps"] += n
    return counts


def last_losses(store: Store, run_ids: list[str]) -> dict[str, float | None]:
    """Per run: the loss per token of its newest succeeded forward_backward (None without one)."""
    if not run_ids:
        return {}
    newest = (select(OperationRow.run_id, func.max(OperationRow.seq_id).label("seq"))
              .where(OperationRow.run_id.in_(run_ids), OperationRow.kind == OperationKind.FORWARD_BACKWARD,
                     OperationRow.status == OperationStatus.SUCCEEDED)
              .group_by(OperationRow.run_id).subquery())
    q = (select(OperationRow.run_id, OperationRow.result["loss"], OperationRow.result["metrics"])
         .join(newest, (OperationRow.run_id == newest.c.run_id) & (OperationRow.seq_id == newest.c.seq)))
    with store.tx() as db:
        rows = db.execute(q).all()
    return {run_id: per_token(loss, metrics or {}) for run_id, loss, metrics in rows}


def recent_losses(store: Store, run_ids: list[str], n: int = 40) -> dict[str, list[float]]:
    """Per run: the loss per token of its last `n` succeeded forward_backwards, oldest first (sparklines)."""
    out: dict[str, list[float]] = {}
    with store.tx() as db:
        for run_id in run_ids:
            rows = db.execute(select(OperationRow.result["loss"], OperationRow.result["metrics"])
                              .where(OperationRow.run_id == run_id, OperationRow.kind == OperationKind.FORWARD_BACKWARD,
                                     OperationRow.status == OperationStatus.SUCCEEDED)
                              .order_by(OperationRow.seq_id.desc()).limit(n)).all()
            values = [per_token(loss, metrics or {}) for loss, metrics in reversed(rows)]
            out[run_id] = [v for v in values if v is not None]
    return out


def per_token(loss: float | None, metrics: dict) -> float | None:
    """The loss divided by its tokens when the loss reports them (losses are summed over tokens)."""
    tokens = metrics.get("tokens:sum")
    if loss is None:
        return None
    return loss / tokens if tokens else loss


def sampler_versions(store: Store, run_id: str) -> list[dict]:
    """The run's sampler versions, newest first: `{version, package_id, created_at}`."""
    q = (select(OperationRow.result["version"], OperationRow.result["package"]["id"], OperationRow.finished_at)
         .where(OperationRow.run_id == run_id, OperationRow.kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER,
                OperationRow.status == OperationStatus.SUCCEEDED).order_by(OperationRow.seq_id.desc()))
    with store.tx() as db:
        rows = db.execute(q).all()
    return [{"version": v, "package_id": p, "created_at": t} for v, p, t in rows if v is not None]


def owner_sampler_versions(store: Store, owner: str, run_ids: list[str]) -> dict[str, list[tuple[int, str]]]:
    """Per run of the owner's (among run_ids): its sampler versions, newest first, as (version, package id)
    (the playground's list)."""
    if not run_ids:
        return {}
    q = (select(OperationRow.run_id, OperationRow.result["version"], OperationRow.result["package"]["id"])
         .where(OperationRow.owner == owner, OperationRow.run_id.in_(run_ids),
                OperationRow.kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER,
                OperationRow.status == OperationStatus.SUCCEEDED).order_by(OperationRow.seq_id.desc()))
    with store.tx() as db:
        rows = db.execute(q).all()
    out: dict[str, list[tuple[int, str]]] = {}
    for run_id, version, package_id in rows:
        if version is not None:
            out.setdefault(run_id, []).append((version, package_id))
    return out


def queue_depth(store: Store) -> dict[str, int]:
    """Operations of every owner waiting or running now: training ones (in runs) and sampling ones."""
    with store.tx() as db:
        rows = db.execute(select(OperationRow.status, OperationRow.run_id.is_(None), func.count())
                          .where(OperationRow.status.in_(OPERATION_PENDING))
                          .group_by(OperationRow.status, OperationRow.run_id.is_(None))).all()
    depth = {"training_queued": 0, "training_running": 0, "sampling_queued": 0, "sampling_running": 0}
    for status, sampling, n in rows:
        depth[f"{'sampling' if sampling else 'training'}_{status}"] += n
    return depth


def owner_summary(store: Store, owner: str) -> dict[str, int]:
    """What an owner holds: active sessions, live runs, checkpoints, operations queued or running."""
    with store.tx() as db:
        sessions = db.scalar(select(func.count()).select_from(SessionRow).where(
            SessionRow.owner == owner, SessionRow.status == SessionStatus.ACTIVE))
        runs = db.scalar(select(func.count()).select_from(RunRow).where(RunRow.owner == owner,
                                                                       RunRow.status.in_(RUN_LIVE)))
        packages = db.scalar(select(func.count()).select_from(PackageRow).where(PackageRow.owner == owner,
                                                                               PackageRow.deleted.is_(False)))
        pending = db.scalar(select(func.count()).select_from(OperationRow).where(
            OperationRow.owner == owner, OperationRow.status.in_(OPERATION_PENDING)))
    return {"sessions": sessions, "runs": runs, "checkpoints": packages, "pending": pending}


def directory_bytes(path: str) -> int:
    """The bytes of the files under a package's directory (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass
    return total


def find_runs(store: Store, owner: str, text: str = "", status: str = "", limit: int = RUNS_SHOWN
              ) -> tuple[list[dict], int]:
    """The owner's runs, newest first (at most `limit`), and how many match in all. `status`: "live" or a run
    status. `text`: words (case-insensitive), each found in the run's id, base model or metadata, or its
    session's id, project, display name, tags or metadata (metadata and tags as their stored JSON)."""
    q = select(RunRow).join(SessionRow, RunRow.session_id == SessionRow.id).where(RunRow.owner == owner)
    if status == "live":
        q = q.where(RunRow.status.in_(RUN_LIVE))
    elif status:
        q = q.where(RunRow.status == status)
    fields = (RunRow.id, RunRow.base_model, cast(RunRow.user_metadata, String), SessionRow.id, SessionRow.project_id,
              SessionRow.display_name, cast(SessionRow.tags, String), cast(SessionRow.user_metadata, String))
    words = text.lower().split()[:8]
    if words:
        q = q.where(and_(*[or_(*[func.lower(f).contains(w, autoescape=True) for f in fields]) for w in words]))
    with store.tx() as db:
        total = db.scalar(select(func.count()).select_from(q.subquery()))
        rows = db.scalars(q.order_by(RunRow.created_at.desc()).limit(limit)).all()
        return [{c.name: getattr(r, c.name) for c in RunRow.__table__.columns} for r in rows], total


def sample_wait(store: Store, owner: str, op_id: str) -> dict:
    """What a sampling operation of the owner's waits behind, for the playground while no token has come:
    `{status, waited_s, ahead, behind: [{kind, status, count}]}`. Ahead are the training operations the engine
    is running (training and sampling take turns on one engine), the training operations queued before this
    one, and, while this one is queued, the sampling requests queued before it. Server-wide counts, as the
    server view shows (never another key's runs). One grouped count over the (few) pending operations."""
    op = store.get_operation(op_id, owner)
    out = {"status": op.status, "waited_s": max(0.0, time.time() - op.created_at), "ahead": 0, "behind": []}
    if op.status not in OPERATION_PENDING:
        return out
    training = OperationRow.kind.notin_(SAMPLING_KINDS)
    ahead = or_(and_(training, OperationRow.status == OperationStatus.RUNNING),
                and_(training, OperationRow.created_at < op.created_at))
    if op.status == OperationStatus.QUEUED:
        ahead = or_(ahead, and_(OperationRow.status == OperationStatus.QUEUED,
                                OperationRow.created_at < op.created_at))
    q = (select(OperationRow.kind, OperationRow.status, func.count())
         .where(OperationRow.status.in_(OPERATION_PENDING), OperationRow.id != op_id, ahead)
         .group_by(OperationRow.kind, OperationRow.status))
    with store.tx() as db:
        rows = db.execute(q).all()
    out["behind"] = [{"kind": kind, "status": status, "count": n}
                     for kind, status, n in sorted(rows, key=lambda r: (r[1] != "running", r[0]))]
    out["ahead"] = sum(n for _, _, n in rows)
    return out
