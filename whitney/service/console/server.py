"""The server view: loaded base models, queue depth, live runs and throughput.

Throughput comes from the same counters `GET /metrics` serves (tokens of succeeded training operations,
sampled tokens, operations ended): from the first time the server view is opened, a daemon thread reads them
every PERIOD seconds (three in-memory counters, no database) and keeps HISTORY_SECONDS of readings; each
reading's rate is the counters' change since the one before.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from whitney.service.console import queries
from whitney.service.http.deps import ServiceState

HISTORY_SECONDS = 600.0
PERIOD = 2.0  # seconds between two readings
MIN_INTERVAL = 1.0  # at least this between two readings (a page may ask for one too)
WINDOW = 30.0  # seconds the headline rates are averaged over


def counter_total(counter) -> float:
    """The sum of a prometheus_client counter over all its labels."""
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


class Throughput:
    """Readings of the service's counters over time: (t, training tokens, sampled tokens, operations)."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._readings: deque[tuple[float, float, float, float]] = deque()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def watch(self) -> None:
        """Read now, and from now on every PERIOD seconds (started once, on the first view)."""
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_forever, name="whitney-console-throughput",
                                                daemon=True)
                self._reader.start()
        self.read()

    def _read_forever(self) -> None:
        while True:
            time.sleep(PERIOD)
            self.read()

    def read(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            if self._readings and now - self._readings[-1][0] < MIN_INTERVAL:
                return
            m = self.metrics
            self._readings.append((now, counter_total(m.training_tokens), counter_total(m.sampled_tokens),
                                   counter_total(m.operations)))
            while self._readings and now - self._readings[0][0] > HISTORY_SECONDS:
                self._readings.popleft()

    def series(self, smooth: float = 10.0) -> dict[str, list[float]]:
        """Per reading after the first: its time and the rates (per second) over the `smooth` seconds before it
        (at least since the reading before), so one engine call landing between two readings is no spike."""
        with self._lock:
            readings = list(self._readings)
        out: dict[str, list[float]] = {"t": [], "training": [], "sampling": [], "operations": []}
        start = 0
        for i in range(1, len(readings)):
            while readings[i][0] - readings[start][0] > smooth and start < i - 1:
                start += 1
            (t0, a0, b0, c0), (t1, a1, b1, c1) = readings[start], readings[i]
            dt = t1 - t0
            out["t"].append(t1)
            out["training"].append((a1 - a0) / dt)
            out["sampling"].append((b1 - b0) / dt)
            out["operations"].append((c1 - c0) / dt)
        return out

    def recent(self, window: float = WINDOW) -> dict[str, float | None]:
        """Rates over about the last `window` seconds (None until two readings exist)."""
        with self._lock:
            readings = list(self._readings)
        if len(readings) < 2:
            return {"training": None, "sampling": None, "operations": None}
        last = readings[-1]
        first = next((r for r in readings if last[0] - r[0] <= window), readings[-2])
        if first is last:
            first = readings[-2]
        dt = last[0] - first[0]
        return {"training": (last[1] - first[1]) / dt, "sampling": (last[2] - first[2]) / dt,
                "operations": (last[3] - first[3]) / dt}


def server_view(st: ServiceState, throughput: Throughput) -> dict:
    """Everything the server view shows, as plain data (server-wide counts: any key may see them, as
    /metrics shows them)."""
    throughput.watch()
    live = st.store.live_runs()
    models = []
    for name in st.models:
        info = st.model_info(name)
        runs = [r for r in live if r.base_model in (name, *[k for k, v in st.model_aliases.items() if v == name])]
        models.append({"name": name, "model_type": info.model_type, "device": info.device,
                       "dtype": info.compute_dtype, "weight_bytes": info.weight_bytes,
                       "context": info.max_context, "vocab": info.vocab_size,
                       "modules": len(info.adaptable_modules), "live_runs": len(runs),
                       "adapter_bytes": sum(st.quotas.run_bytes(r.base_model, r.lora) for r in runs)})
    counts = st.store.status_counts()
    config = st.scheduler.backend.config
    return {
        "models": models,
        "queue": {**queries.queue_depth(st.store), "sampling_in_flight": st.scheduler.backend.sampling_in_flight},
        "runs": {status: counts["runs"].get(status, 0) for status in ("active", "finishing", "cancelling")},
        "live_runs": len(live),
        "sessions": counts["sessions"].get("active", 0),
        "rates": throughput.recent(),
        "limits": {"max_batch_tokens": st.limits.max_batch_tokens, "max_sequences": config.max_sequences,
                   "max_cached_tokens": config.max_cached_tokens, "max_lora_rank": config.max_lora_rank},
    }
