"""Request dependencies: the app's state, the caller's identity, and the runs it owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from starlette.concurrency import run_in_threadpool

from whitney.protocol.backend import ModelInfo
from whitney.protocol.training import ForwardRequest
from whitney.service.cluster.payloads import encode
from whitney.service.http.routing import OffLoopJSONRoute
from whitney.service.http.metrics import Metrics
from whitney.service.scheduling.limits import Limits
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.store.database import Store
from whitney.service.store.keys import OWNER_SCOPE_KEY, KeyRing, Unauthorized, owner_of_key, presented_key  # noqa: F401 (re-exported)
from whitney.service.store.quotas import Quotas


def new_app(**options) -> FastAPI:
    """A FastAPI app of the service (the API, the Tinker protocol, the console), without FastAPI's own
    OpenTelemetry hooks: the service's metrics are its Prometheus ones (metrics.py), and the hooks' check
    for a configured provider took 6% of a plain request's time. Its own routes parse a large JSON body off the
    event loop (routing.OffLoopJSONRoute), as new_router's do."""
    app = FastAPI(telemetry={"tracing": False, "metrics": False, "logs": False}, **options)
    app.router.route_class = OffLoopJSONRoute
    return app


def new_router(**options) -> APIRouter:
    """A router of the service's routes: each parses a large JSON body off the event loop (routing.OffLoopJSONRoute)."""
    return APIRouter(route_class=OffLoopJSONRoute, **options)


@dataclass
class ServiceState:
    """Everything the routes share, built once by create_app."""

    store: Store
    scheduler: Scheduler
    models: list[str]  # base-model names served, the first is the default (a local directory by its name)
    keys: KeyRing
    data_dir: Path
    limits: Limits  # what one request may ask for (whitney.service.scheduling.limits)
    quotas: Quotas  # what one key may hold (whitney.service.store.quotas)
    # A model served from a directory is named by the directory's name; the path as given to the server is
    # accepted too (it names the same model), but never shown.
    model_aliases: dict[str, str] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)  # GET /metrics (whitney.service.http.metrics)
    # A highly available service's member (service/cluster/member.py): its jobs are stored with their operations.
    member: object | None = None

    def payload(self, job) -> bytes | None:
        """What to store with a queued operation: its job where several processes share the database (whichever
        leads runs it), else nothing (this process's scheduler is handed the job itself)."""
        return None if self.member is None else encode(job)

    def forward_check(self, run_id: str, data: list, loss_fn: str, config: dict) -> ForwardRequest:
        """The ForwardRequest Backend.validate checks for a run's forward: the run's own; on a member of a highly
        available service, whose engine holds no run (the leader's does), the same datums on the run's base model
        (all validation reads of a run)."""
        if self.member is None:
            return ForwardRequest(run_id, data, loss_fn, config)
        return ForwardRequest(run_id, data, loss_fn, config, base_model=self.store.get_run(run_id).base_model)

    def serves(self, base_model: str | None) -> bool:
        return base_model in self.models or base_model in self.model_aliases

    def model_info(self, base_model: str) -> ModelInfo:
        """What the backend says of a served model (by its shown name or the name it was served as)."""
        return self.scheduler.backend.models[self.model_aliases.get(base_model, base_model)]


# Both dependencies are async: FastAPI runs a plain `def` dependency on its thread pool, a thread hop per
# dependency per request (of 2 ms of server time per request, measured under 32 clients).

async def state(request: Request) -> ServiceState:
    return request.app.state.whitney


async def owner(request: Request, authorization: Annotated[str | None, Header()] = None,
                x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The caller's identity: a digest of its API key ('' when the server requires no keys), as KeyGate found
    it before routing; else (a path KeyGate leaves open) checked here, on the thread pool (a store lookup).

    Native clients send `Authorization: Bearer <key>`; Tinker's SDK sends `X-API-Key`.
    """
    checked = request.scope.get(OWNER_SCOPE_KEY)
    if checked is not None:
        return checked
    return await run_in_threadpool((await state(request)).keys.owner, presented_key(authorization, x_api_key))


State = Annotated[ServiceState, Depends(state)]
Owner = Annotated[str, Depends(owner)]
