"""Per-key quotas: what a key holds against its limits; beyond a limit, 429 with Retry-After.

Usage is read from the store when a request would add to it (sessions, runs and queued operations are
rows; closed, finished, cancelled and expired ones hold nothing), except tokens per minute, a sliding
60 s window kept in memory. A refused request changes nothing. The count and the row it admits are one
atomic step: the store runs each check (given a `conn`) inside the transaction that inserts the row, under the
owner's quota lock (Store.quota_tx), so concurrent requests, from one API process or several on one database,
never pass a limit together.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from contextlib import contextmanager

from whitney.errors import InvalidInput, WhitneyError
from whitney.protocol.backend import Backend
from whitney.protocol.training import LoraConfig
from whitney.service.store.database import Store
from whitney.service.store.key_limits import KeyLimits
from whitney.service.store.keys import KeyRing
from whitney.service.store.refusals import RefusalBudget

WINDOW = 60.0  # seconds of the tokens-per-minute window
HELD_RETRY = 10  # Retry-After (s) when usage drops only as the client ends something (sessions, runs)
QUEUE_RETRY = 1  # Retry-After (s) when operations ahead are running
# Heavy checks of one key's requests at once in this process, each on a request thread (a custom loss's graph
# dry-run, images decoded and processed): more would let one key hold the threadpool and the CPUs every other key's
# requests need. A text request with a built-in loss is linear in its (already bounded) tokens and takes no slot: a
# client may pipeline them.
VALIDATIONS_PER_KEY = 2


class QuotaExceeded(WhitneyError):
    """A key is at one of its limits: 429, and Retry-After says when to try again."""

    code = "quota_exceeded"

    def __init__(self, message: str, *, field: str, limit: int, usage: int, retry_after: int):
        super().__init__(message, field=field)
        self.limit, self.usage, self.retry_after = limit, usage, retry_after
        self.headers = {"Retry-After": str(retry_after)}

    def to_dict(self) -> dict:
        return {**super().to_dict(), "limit": self.limit, "usage": self.usage}


class Quotas:
    def __init__(self, store: Store, keys: KeyRing, defaults: KeyLimits, backend: Backend):
        self.store, self.keys, self.defaults, self.backend = store, keys, defaults, backend
        self._tokens: dict[str, deque[tuple[float, int]]] = {}  # owner -> (time, tokens) of the last minute
        self._lock = threading.RLock()  # _spend reads the window while holding it
        self._validating: dict[str, int] = {}  # owner -> its requests being validated now
        # Refused requests, spent and waited on by http/refusals.py's middleware (on the event loop), read by usage().
        self.refusals = RefusalBudget(lambda owner: self.limits(owner).max_refusals_per_minute)

    def limits(self, owner: str) -> KeyLimits:
        return self.defaults.override(self.keys.own_limits(owner))

    def usage(self, owner: str) -> dict:
        """What the owner holds now, in the units of its limits."""
        held = self.store.usage(owner)
        return {"sessions": held["sessions"], "runs": len(held["runs"]),
                "adapter_bytes": sum(self.run_bytes(b, lora) for b, lora in held["runs"]),
                "queued_operations": held["operations"], "tokens_per_minute": self._window(owner, time.time())[1],
                "refusals_per_minute": self.refusals.spent(owner, time.monotonic())}

    # ---- checks, each before the request adds to what it counts ---------------------------------

    def check_session(self, owner: str, conn=None) -> None:
        """Store.create_session's `admit`: `conn` is its quota_tx's."""
        limit = self.limits(owner).max_sessions
        if limit:
            held = self.store.held_sessions(owner, conn)
            if held + 1 > limit:
                raise QuotaExceeded(f"this key may hold {limit} active sessions and holds {held}; close one (or "
                                    "let it expire) first", field="max_sessions", limit=limit, usage=held,
                                    retry_after=HELD_RETRY)

    def check_run(self, owner: str, base_model: str, lora: dict, conn=None) -> None:
        """Store.create_run's `admit`: `conn` is its quota_tx's."""
        limits = self.limits(owner)
        cost = self._adapter_bytes(base_model, lora)  # also an InvalidInput for a bad config, up front
        if not (limits.max_runs or limits.max_adapter_bytes):
            return
        runs = self.store.held_runs(owner, conn)
        if limits.max_runs and len(runs) + 1 > limits.max_runs:
            raise QuotaExceeded(f"this key may hold {limits.max_runs} live runs and holds {len(runs)}; finish or "
                                "cancel one first", field="max_runs", limit=limits.max_runs, usage=len(runs),
                                retry_after=HELD_RETRY)
        held = sum(self.run_bytes(b, cfg) for b, cfg in runs)
        if limits.max_adapter_bytes and held + cost > limits.max_adapter_bytes:
            raise QuotaExceeded(f"this run's adapter needs {cost} bytes (weights, AdamW moments, gradients); this "
                                f"key's live runs hold {held} of its {limits.max_adapter_bytes}; finish or cancel "
                                "one first", field="max_adapter_bytes", limit=limits.max_adapter_bytes, usage=held,
                                retry_after=HELD_RETRY)

    def admit_operation(self, owner: str, run_id: str | None, seq_id: int | None, tokens: int, conn=None) -> None:
        """Check the queue and token limits for a new operation, and count its tokens (run_id None: a
        sample or compute_logprobs request, in no run's order). Store.submit_operation's `admit`: `conn` is its
        quota_tx's.

        The store calls it for a new (run, seq_id) only, never for a retry. An operation that a later,
        already queued seq_id of its run waits for passes the queue limit, or that run could never move again.
        """
        limits = self.limits(owner)
        if limits.max_queued_operations:
            held = self.store.pending_before(owner, run_id, seq_id, conn)
            if held is not None and held + 1 > limits.max_queued_operations:
                raise QuotaExceeded(f"this key may have {limits.max_queued_operations} operations queued or "
                                    f"running and has {held}; wait for some to finish",
                                    field="max_queued_operations", limit=limits.max_queued_operations,
                                    usage=held, retry_after=QUEUE_RETRY)
        if tokens:
            self._spend(owner, tokens, limits.max_tokens_per_minute)

    @contextmanager
    def validating(self, owner: str, tokens: int, heavy: bool):
        """Around a request's check on a request thread (Backend.validate, Backend.image_tokens), which counts
        against the key's share: its `tokens` count against max_tokens_per_minute now, before the work, whether it
        then passes or not (the operation it becomes does not count them again: enqueue's `counted`); and when the
        check is `heavy` (a custom loss's graph runs, images are decoded), at most VALIDATIONS_PER_KEY of a key's at
        once (beyond: 429, field concurrent_validations)."""
        slots = self._validating if heavy else {}  # a light check takes no slot
        with self._lock:
            held = slots.get(owner, 0)
            if held >= VALIDATIONS_PER_KEY:
                raise QuotaExceeded(f"this key may have {VALIDATIONS_PER_KEY} requests with a custom loss or images "
                                    f"checked at once and has {held}; wait for one to be answered",
                                    field="concurrent_validations", limit=VALIDATIONS_PER_KEY, usage=held,
                                    retry_after=QUEUE_RETRY)
            slots[owner] = held + 1
        try:
            if tokens:
                self._spend(owner, tokens, self.limits(owner).max_tokens_per_minute)
            yield
        finally:
            with self._lock:
                slots[owner] -= 1
                if not slots[owner]:
                    del slots[owner]

    # ---- tokens per minute ------------------------------------------------------------------------

    def _spend(self, owner: str, tokens: int, limit: int) -> None:
        if limit and tokens > limit:
            raise InvalidInput(f"an operation of {tokens} tokens can never fit this key's limit of {limit} tokens "
                               "per minute; split it", field="max_tokens_per_minute")
        now = time.time()
        with self._lock:
            window, used = self._window(owner, now)
            if limit and used + tokens > limit:
                freed, wait = 0, WINDOW
                for t, n in window:  # oldest first: when will enough have left the window?
                    freed += n
                    if used - freed + tokens <= limit:
                        wait = t + WINDOW - now
                        break
                raise QuotaExceeded(f"this key may submit {limit} forward/forward_backward/compute_logprobs tokens "
                                    f"per minute and submitted {used} in the last {WINDOW:.0f} s; this operation "
                                    f"has {tokens}",
                                    field="max_tokens_per_minute", limit=limit, usage=used,
                                    retry_after=max(1, math.ceil(wait)))
            window.append((now, tokens))

    def _window(self, owner: str, now: float) -> tuple[deque, int]:
        with self._lock:
            window = self._tokens.setdefault(owner, deque())
            while window and window[0][0] <= now - WINDOW:
                window.popleft()
            return window, sum(n for _, n in window)

    def _adapter_bytes(self, base_model: str, lora: dict) -> int:
        """The most a run of this LoRA config holds: its LoRA numbers, each a float32 weight, two AdamW
        moments and a gradient (sampler versions, frozen copies, are not counted). Validates the config
        against the model (InvalidInput), as creating the run would."""
        return self.backend.adapter_bytes(base_model, LoraConfig.from_dict(lora))

    def run_bytes(self, base_model: str, lora: dict) -> int:
        try:
            return self._adapter_bytes(base_model, lora)
        except (KeyError, WhitneyError):  # a model no longer served: its runs hold nothing here
            return 0
