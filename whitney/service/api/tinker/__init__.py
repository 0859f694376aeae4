"""The Tinker wire protocol under /api/v1, so the official `tinker` SDK runs unmodified against Whitney.

Every operation maps onto the native store, scheduler and engine (no second implementation): a
Tinker model is a native run whose id is the Tinker model id, a Tinker future a native operation.
It is a sub-application mounted on the native app, sharing its ServiceState, with its own OpenAPI
document (/api/v1/openapi.json) so the native one stays exactly the native API.
One router per resource: session (setup and life), account (identity, projects, search, traces, audit),
training, custom_loss (create_custom_loss), sampling, futures, lifecycle (checkpoint TTLs, publishing, copies,
export URLs), runs (REST reads).
"""

from __future__ import annotations

from fastapi import FastAPI

from whitney.errors import InvalidInput, NotFound, TooLarge
from whitney.service.api.native import schemas
from whitney.service.api.tinker import account, custom_loss, futures, lifecycle, runs, sampling, session, training
from whitney.service.api.tinker.common import TinkerState
from whitney.service.http import handlers
from whitney.service.http.deps import ServiceState, Unauthorized, new_app
from whitney.service.store.quotas import QuotaExceeded

# The SDK retries 408, 409, 429 and 5xx, so a clash with the state (a native 409) is a 400 here.
STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, TooLarge: 413, QuotaExceeded: 429}
# What the handlers below (and the native app's body limit, which wraps this app) answer, so the OpenAPI
# document shows the real error body. A refusal of a call that holds a seq_id is a failed future instead
# (see training.py). 408 (retrieve_future: not done yet) and 410 (session_heartbeat: the session has ended)
# are declared on their routes.
ERRORS = {status: {"model": schemas.Error, "description": text} for status, text in (
    (400, "invalid input, or a clash with the state (code invalid_input, conflict)"),
    (401, "missing or unknown API key (code unauthorized)"),
    (404, "no such session, model, sampler, future or checkpoint (code not_found)"),
    (413, "over a stated limit: body bytes, datums or tokens per request, metadata bytes (code too_large)"),
    (422, "not the request schema (code invalid_request)"),
    (429, "over a per-key quota; Retry-After says when to try again (code quota_exceeded)"))}


def create_tinker_app(state: ServiceState) -> FastAPI:
    app = new_app(title="Whitney: Tinker protocol", version="0.38",
                  description="The subset of Tinker's /api/v1 that the tinker SDK 0.38 uses.")
    app.state.whitney = state
    app.state.tinker = TinkerState()
    # lifecycle before runs: its .../checkpoints/{id:path}/publish must not be read as a checkpoint id of runs'
    for module in (session, account, training, custom_loss, sampling, futures, lifecycle, runs):
        app.include_router(module.router, responses=ERRORS)
    schemas.exact_integer_bounds(app)

    handlers.install(app, STATUS)
    return app


__all__ = ["create_tinker_app"]
