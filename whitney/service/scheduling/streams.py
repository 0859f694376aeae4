"""A streaming sample's progress reports, on their way from the sampling thread to the HTTP request that
streams them (the OpenAI routes' `stream: true`)."""

from __future__ import annotations

import asyncio
import threading

from whitney.protocol.sampling import SampleProgress


class SampleStream:
    """A streaming sample's progress reports, from the sampling thread (`put`, `end`) to the event loop of
    the HTTP request that streams them (`get`). Thread-safe; nothing is dropped or reordered."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: list[SampleProgress] = []
        self._ended = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, report: SampleProgress) -> None:
        with self._lock:
            self._reports.append(report)
            self._wake()

    def end(self) -> None:
        """The operation is terminal (its result or error is in the store): no report follows."""
        with self._lock:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            loop, future = self._waiter
            self._waiter = None
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
            except RuntimeError:  # the request's loop has closed: nobody is listening
                pass

    async def get(self, timeout: float) -> tuple[list[SampleProgress], bool]:
        """The reports since the last call (waiting up to `timeout` seconds for one), and whether the
        operation has ended (then every report has been handed out)."""
        future = None
        with self._lock:
            if not self._reports and not self._ended:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiter = (loop, future)
        if future is not None:
            try:
                await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                pass
        with self._lock:
            self._waiter = None
            reports, self._reports = self._reports, []
            return reports, self._ended
