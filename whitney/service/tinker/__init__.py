"""The Tinker wire protocol under /api/v1, so the official `tinker` SDK runs unmodified against Whitney.

Every operation maps onto the native store, scheduler and engine (no second implementation): a
Tinker model is a native run whose id is the Tinker model id, a Tinker future a native operation.
It is a sub-application mounted on the native app, sharing its ServiceState, with its own OpenAPI
document (/api/v1/openapi.json) so the native one stays exactly the native API.
One router per resource: session (setup and life), training, sampling, futures, runs (REST reads).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from whitney.errors import InvalidInput, NotFound, WhitneyError
from whitney.service.deps import ServiceState, Unauthorized
from whitney.service.tinker import futures, runs, sampling, session, training
from whitney.service.tinker.common import TinkerState

# The SDK retries 408, 409, 429 and 5xx, so a clash with the state (a native 409) is a 400 here.
STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404}


def create_tinker_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="Whitney: Tinker protocol", version="0.38",
                  description="The subset of Tinker's /api/v1 that the tinker SDK 0.38 uses.")
    app.state.whitney = state
    app.state.tinker = TinkerState()
    for module in (session, training, sampling, futures, runs):
        app.include_router(module.router)

    @app.exception_handler(WhitneyError)
    async def domain_error(request: Request, exc: WhitneyError):
        return JSONResponse(status_code=STATUS.get(type(exc), 400), content=exc.to_dict())

    return app


__all__ = ["create_tinker_app"]
