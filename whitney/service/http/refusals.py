"""Each key pays for the requests the server refuses: a flood of invalid requests waits, it does not crowd others.

A refusal is cheap for the client that sends it and not free for the server: the body is read, parsed and checked
(a 12 MB protobuf body to its declared shape, a JPEG's header, a custom loss's graph) on the CPUs and, in one
process, under the interpreter lock that the engine's thread needs between its kernels. One tenant sending
invalid requests back to back slowed 31 others' training several times over (bench/hostile.py), while none of
those requests was accepted to be counted by a quota.

So each key has a budget of refusals: `max_refusals_per_minute` (KeyLimits), a token bucket that holds that many
and refills at that rate. A request refused for what it holds (REFUSED: 400, 413, 415, 422) takes one token, and
one more per MiB of body it sent. A request of a key whose bucket is empty waits (on the event loop's timer, no
thread, no CPU) until a token is back, then runs as any other; one that would wait more than MAX_WAIT seconds, or
finds MAX_WAITING of its key's requests waiting already, is answered at once: 429 `too_many_refusals` with
Retry-After, before its body is read. A key that sends valid requests never waits; limit 0 turns it off.
Requests without a key (the open routes, whose bodies BodyLimit keeps under OPEN_BODY_BYTES) are not counted,
nor those of a server without keys (one tenant: no other to protect).
"""

from __future__ import annotations

import asyncio
import math
import time

from starlette.responses import JSONResponse

from whitney.service.store.keys import OWNER_SCOPE_KEY
from whitney.service.store.refusals import RefusalBudget

REFUSED = frozenset({400, 413, 415, 422})  # refused for what the request holds (not 401/403/404/409/429)
MIB = 1 << 20
MAX_WAIT = 10.0  # seconds a request may wait for its key's budget; beyond it, 429 at once
MAX_WAITING = 16  # a key's requests waiting at once; beyond it, 429 at once


def too_many(limit: int, wait: float) -> JSONResponse:
    retry = max(1, math.ceil(wait))
    return JSONResponse(status_code=429, headers={"Retry-After": str(retry)}, content={
        "code": "too_many_refusals", "field": "max_refusals_per_minute", "limit": limit,
        "message": f"this key's requests were refused (4xx) more than its {limit} per minute allow, so its "
                   f"requests wait for that budget; this one would wait {wait:.1f} s (at most {MAX_WAIT:.0f} s, "
                   f"{MAX_WAITING} requests at once). Fix the refused requests, then retry after {retry} s"})


class Refusals:
    """ASGI middleware (inside KeyGate, which names the owner; outside BodyLimit, so a request answered 429
    here has read no body): a key's requests wait while its refusal budget is spent (RefusalBudget)."""

    def __init__(self, app, budget: RefusalBudget):
        self.app, self.budget = app, budget

    async def __call__(self, scope, receive, send):
        owner = scope.get(OWNER_SCOPE_KEY) if scope["type"] == "http" else None
        limit = self.budget.limit_of(owner) if owner else 0  # '' : a server without keys, one tenant
        if not limit:
            return await self.app(scope, receive, send)
        bucket = self.budget.bucket(owner, limit, time.monotonic())
        wait = bucket.delay(limit)
        if wait > 0:
            if wait > MAX_WAIT or bucket.waiting >= MAX_WAITING:
                return await too_many(limit, wait)(scope, receive, send)
            bucket.waiting += 1
            try:
                await asyncio.sleep(wait)
            finally:
                bucket.waiting -= 1
        status, received = 0, 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted, watched)
        finally:
            if status in REFUSED:
                self.budget.bucket(owner, limit, time.monotonic()).tokens -= 1 + received // MIB
