"""A run's curves as CSV: every value the run page charts, one row each, as the API reports it.

Columns `source, seq_id, step, name, value, time`:
  - a succeeded forward_backward, forward or optim_step (`source` its kind, `seq_id` its own) gives a row for
    its `loss` (as the operation's result has it: summed over tokens, not per token) and one per entry of its
    result's `metrics`; `step` is the optimizer step its values are charted at (1 + the succeeded optim_steps
    before it), `time` the Unix time it finished;
  - a metric the run's loop logged (`source` "logged") gives a row at the step it was logged at, `time` when.
Values are written in full precision (Python's repr of the float), so they read back equal. The file is
streamed, read from the store in pages of PAGE points (the queries the run page's poll uses), so a run of any
length is exported in bounded memory.
"""

from __future__ import annotations

import csv
import io
from typing import Iterator

from whitney.service.console import queries
from whitney.service.store import run_metrics
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind

HEADER = ("source", "seq_id", "step", "name", "value", "time")
PAGE = 5000


def rows(store: Store, run_id: str, page: int = PAGE) -> Iterator[tuple]:
    """The CSV's rows after its header, operations in seq_id order, then the logged metrics in write order."""
    after, step = -1, 1
    while True:
        points = queries.curve_points(store, run_id, after, page)
        for p in points:
            values = ([("loss", p["loss"])] if p["loss"] is not None else []) + sorted(p["metrics"].items())
            for name, value in values:
                yield p["kind"], p["seq"], step, name, value, p["t"]
            if p["kind"] == OperationKind.OPTIM_STEP:
                step += 1
        if len(points) < page:
            break
        after = points[-1]["seq"]
    logged_after = -1
    while True:
        logged = run_metrics.points_after(store, run_id, logged_after, page)
        for p in logged:
            yield "logged", "", p["step"], p["name"], p["value"], p["t"]
        if len(logged) < page:
            break
        logged_after = logged[-1]["id"]


def lines(store: Store, run_id: str) -> Iterator[str]:
    """The CSV text, a chunk of up to PAGE rows at a time."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(HEADER)
    for i, row in enumerate(rows(store, run_id), 1):
        writer.writerow(row)
        if i % PAGE == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()
