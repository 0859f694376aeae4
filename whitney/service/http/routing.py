"""The service's routes: each parses a large JSON body off the event loop (the route class of http/deps.py's
new_router and new_app)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

OFF_LOOP_JSON_BYTES = 64 * 1024  # a JSON body larger than this is parsed on a worker thread (about 45 ms per MiB)


class OffLoopJSON(Request):
    """A request whose JSON body, when over OFF_LOOP_JSON_BYTES, is parsed on a worker thread: FastAPI parses a
    route's body with `json()` on the event loop, where a 32 MiB body (max_request_bytes) held every other request
    up for over a second."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = json.loads(body) if len(body) <= OFF_LOOP_JSON_BYTES else await run_in_threadpool(
                json.loads, body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """Every route of the service's apps (http/deps.new_router): its handler gets an OffLoopJSON request."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request):
            return await handler(OffLoopJSON(request.scope, request.receive, request._send))

        return handle
