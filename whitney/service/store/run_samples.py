"""Samples a training loop logs for its own run: prompts and the completions it sampled for them (an RL loop's
rollouts, an evaluation's answers), with a reward and metadata if it has them; shown as a table, step by step,
on the run's console page.

A run's samples are kept by step (the table `run_samples`, tables.py): logging samples at a step replaces
the ones logged at that step before (last write wins, as for metrics), so a client that resends a request
after a network error stores it once. The step defaults to the run's current optimizer step (as for
metrics). Every run that exists takes them, whatever its status (runs are never deleted, so no sample
outlives its run).

Bounds (SampleLimits): what one request may hold is checked on the request's raw JSON, before a sample is
validated, measured in bytes or stored (`check_sizes`, called by the wire schema and again here); what a run
and a key may hold is checked in the write's transaction, with the step's old samples already deleted.
Runs are never deleted, so the key's bound is the most one key can ever store.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from sqlalchemy import delete, func, select

from whitney.errors import InvalidInput, TooLarge
from whitney.service.flags import flag
from whitney.service.store.database import Store
from whitney.service.store.json_values import check_json
from whitney.service.store.run_metrics import current_step
from whitney.service.store.tables import RunRow, RunSampleRow

TEXTS = ("prompt", "completion")


@dataclass(frozen=True)
class SampleLimits:
    """What one request, one run and one key may log (413 beyond each)."""

    max_samples_per_request: int = flag(64, "samples in one request, so in one step")
    max_text_chars: int = flag(32_768, "characters of a prompt, and of a completion")
    max_metadata_bytes: int = flag(4096, "bytes of a sample's metadata, as compact UTF-8 JSON")
    max_samples_per_run: int = flag(10_000, "samples stored for one run")
    max_samples_per_key: int = flag(100_000, "samples stored for one key, over all its runs")
    max_bytes_per_key: int = flag(256 * 2**20, "UTF-8 bytes of prompts, completions and metadata of one key")


LIMITS = SampleLimits()


def check_sizes(samples: object, limits: SampleLimits = LIMITS) -> None:
    """The per-request bounds on the raw JSON list: how many samples, how long each text. Only len() is taken,
    so an oversized request is refused before any of it is copied, validated or measured."""
    if not isinstance(samples, list):
        return  # the schema names the type
    if len(samples) > limits.max_samples_per_request:
        raise TooLarge(f"samples holds {len(samples)} samples; the limit is {limits.max_samples_per_request} per "
                       "request (and per step)", field="samples")
    for i, sample in enumerate(samples):
        for name in TEXTS:
            text = sample.get(name) if isinstance(sample, dict) else None
            if isinstance(text, str) and len(text) > limits.max_text_chars:
                raise TooLarge(f"samples[{i}].{name} has {len(text)} characters; the limit is "
                               f"{limits.max_text_chars}", field=f"samples.{i}.{name}")


def _measured(samples: list[dict], limits: SampleLimits) -> list[tuple[dict, int]]:
    """Each sample with its stored bytes; a 400 or 413 naming the sample's field that breaks a rule."""
    if not samples:
        raise InvalidInput("samples must hold at least one sample", field="samples")
    out = []
    for i, sample in enumerate(samples):
        reward = sample.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise InvalidInput(f"samples[{i}].reward must be a finite number or null, got {reward!r}",
                               field=f"samples.{i}.reward")
        metadata = sample.get("metadata")
        meta_bytes = 0
        if metadata is not None:
            check_json(metadata, f"samples.{i}.metadata")  # first: serialising a deep value would recurse
            meta_bytes = len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode())
            if meta_bytes > limits.max_metadata_bytes:
                raise TooLarge(f"samples[{i}].metadata is {meta_bytes} bytes as compact JSON; the limit is "
                               f"{limits.max_metadata_bytes}", field=f"samples.{i}.metadata")
        out.append((sample, meta_bytes + sum(len(sample[name].encode()) for name in TEXTS)))
    return out


def log_samples(store: Store, run_id: str, owner: str, samples: list[dict], step: int | None = None,
                limits: SampleLimits = LIMITS) -> dict:
    """Store `samples` ({prompt, completion, reward?, metadata?} each) as the samples of `step` (default: the
    run's current optimizer step) of the owner's run, replacing those logged at that step before; return
    {run_id, step, count}. NotFound for a run that is not the owner's; nothing is stored when a bound refuses."""
    check_sizes(samples, limits)
    measured = _measured(samples, limits)
    store.get_run(run_id, owner)  # NotFound for another key's run
    if step is None:
        step = current_step(store, run_id)
    now = time.time()
    with store.tx() as db:
        # Writers of one run take turns (as for metrics): on PostgreSQL on the run's row, on SQLite from the delete on.
        db.execute(select(RunRow.id).where(RunRow.id == run_id).with_for_update())
        store.lock_owner(db, owner)  # and one key's writers across its runs (its totals, _check_room)
        db.execute(delete(RunSampleRow).where(RunSampleRow.run_id == run_id, RunSampleRow.step == step))
        _check_room(db, run_id, owner, [size for _, size in measured], limits)  # a refusal rolls the delete back
        db.add_all([RunSampleRow(run_id=run_id, owner=owner, step=step, idx=i, prompt=s["prompt"],
                                 completion=s["completion"], reward=_float(s.get("reward")),
                                 sample_metadata=s.get("metadata"), bytes=size, logged_at=now)
                    for i, (s, size) in enumerate(measured)])
    return {"run_id": run_id, "step": step, "count": len(samples)}


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)


def _check_room(db, run_id: str, owner: str, sizes: list[int], limits: SampleLimits) -> None:
    """413 when the run or the key, with these samples added, would hold more than the limits allow."""
    in_run = db.scalar(select(func.count()).select_from(RunSampleRow).where(RunSampleRow.run_id == run_id))
    if in_run + len(sizes) > limits.max_samples_per_run:
        raise TooLarge(f"run {run_id} holds {in_run} samples, {len(sizes)} more would pass the limit of "
                       f"{limits.max_samples_per_run} per run", field="samples")
    count, size = db.execute(select(func.count(), func.coalesce(func.sum(RunSampleRow.bytes), 0))
                             .where(RunSampleRow.owner == owner)).one()
    if count + len(sizes) > limits.max_samples_per_key:
        raise TooLarge(f"this key holds {count} samples, {len(sizes)} more would pass the limit of "
                       f"{limits.max_samples_per_key} per key", field="samples")
    if size + sum(sizes) > limits.max_bytes_per_key:
        raise TooLarge(f"this key holds {size} bytes of samples, {sum(sizes)} more would pass the limit of "
                       f"{limits.max_bytes_per_key} per key", field="samples")


def list_samples(store: Store, run_id: str, owner: str, step: int | None = None, before_step: int | None = None,
                 limit: int = 100) -> list[dict]:
    """The owner's run's samples, newest step first and in their logged order within a step, at most `limit`:
    only those of `step`, or of the steps below `before_step` (the next page), when given."""
    store.get_run(run_id, owner)
    q = select(RunSampleRow).where(RunSampleRow.run_id == run_id)
    if step is not None:
        q = q.where(RunSampleRow.step == step)
    if before_step is not None:
        q = q.where(RunSampleRow.step < before_step)
    with store.tx() as db:
        rows = db.scalars(q.order_by(RunSampleRow.step.desc(), RunSampleRow.idx).limit(limit)).all()
    return [{"step": r.step, "index": r.idx, "prompt": r.prompt, "completion": r.completion, "reward": r.reward,
             "metadata": r.sample_metadata, "logged_at": r.logged_at} for r in rows]


def sample_steps(store: Store, run_id: str, limit: int = 500) -> list[tuple[int, int]]:
    """The run's steps that have samples, newest first, with how many each has (the console's step picker)."""
    q = (select(RunSampleRow.step, func.count()).where(RunSampleRow.run_id == run_id)
         .group_by(RunSampleRow.step).order_by(RunSampleRow.step.desc()).limit(limit))
    with store.tx() as db:
        return [(step, n) for step, n in db.execute(q).all()]
