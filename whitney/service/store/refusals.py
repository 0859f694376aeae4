"""Each key's budget of refused requests (`max_refusals_per_minute`): token buckets, in this process's memory.
The middleware that spends and waits on them is whitney/service/http/refusals.py, which says why."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass
class Bucket:
    """One key's refusals: `tokens` it may still have without waiting (negative: owed), as of `at`."""

    tokens: float
    at: float  # time.monotonic()
    waiting: int = 0  # the key's requests waiting now

    def refill(self, limit: int, now: float) -> "Bucket":
        self.tokens, self.at = min(float(limit), self.tokens + (now - self.at) * limit / 60.0), now
        return self

    def delay(self, limit: int) -> float:
        """Seconds until the key has a token again (0: now)."""
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) * 60.0 / limit


class RefusalBudget:
    """Per-key token buckets of refusals. `limit_of(owner)`: the key's refusals per minute (0: no budget)."""

    def __init__(self, limit_of: Callable[[str], int], max_keys: int = 100_000):
        self.limit_of, self.max_keys = limit_of, max_keys
        self._buckets: dict[str, Bucket] = {}

    def bucket(self, owner: str, limit: int, now: float) -> Bucket:
        """The owner's bucket, refilled at `limit` per minute up to `limit` (memory: at most `max_keys` buckets;
        when full, those that owe nothing go, as they would start again)."""
        bucket = self._buckets.get(owner)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets = {k: b for k, b in self._buckets.items() if b.waiting or self._owes(k, b, now)}
            bucket = self._buckets[owner] = Bucket(float(limit), now)
        return bucket.refill(limit, now)

    def _owes(self, owner: str, bucket: Bucket, now: float) -> bool:
        limit = self.limit_of(owner)
        return bucket.refill(limit, now).tokens < limit

    def spent(self, owner: str, now: float) -> int:
        """The owner's refusals counted against its limit now (what the bucket lacks to be full; GET /v1/quota).
        Reads the bucket without changing it: the route runs on a worker thread, the middleware on the loop."""
        limit, bucket = self.limit_of(owner), self._buckets.get(owner)
        if not limit or bucket is None:
            return 0
        return max(0, math.ceil(limit - min(float(limit), bucket.tokens + (now - bucket.at) * limit / 60.0)))
