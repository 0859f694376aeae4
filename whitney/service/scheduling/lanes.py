"""A worker thread's lane: the calls other threads hand it (`Lane.call`), and its loop (`Lane.serve`), which
runs them and then each of its steps, again and again, and sleeps until woken when none did anything: an
event, not a sleep loop, wakes it."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from enum import StrEnum
from typing import Any, Callable

log = logging.getLogger(__name__)


class Worker(StrEnum):
    """The scheduler's worker threads, by what they run (each one's thread name)."""

    TRAINING = "whitney-worker"  # training, and sampling and scoring unless the backend runs them apart
    SAMPLING = "whitney-sampler"  # sampling and scoring of a backend with `separate_sampling`


class Lane:
    """One worker thread's queue of calls to run on it, and the event that wakes it. `lock`: the scheduler's."""

    def __init__(self, name: Worker, lock: threading.RLock):
        self.name = name
        self.wake = threading.Event()
        self._lock = lock
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on this lane's thread; the future carries its result (or its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, future))
        self.wake.set()
        return future

    def run_calls(self) -> bool:
        """Run the calls handed in so far; whether there were any."""
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)
        return bool(calls)

    def serve(self, steps: list[Callable[[], bool | None]], stopped: Callable[[], bool]) -> None:
        """Run the calls and then each step, until `stopped()`; sleep until woken when none did anything."""
        while not stopped():
            self.wake.clear()
            try:
                did = self.run_calls()
                for step in steps:
                    did |= bool(step())
            except Exception:  # a bug: log it and keep serving the other runs
                log.exception("%s iteration failed", self.name)
                did = False
            if not did:
                self.wake.wait(timeout=1.0)
