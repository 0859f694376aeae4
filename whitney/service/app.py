"""create_app(config): the FastAPI application over one store, one scheduler and one backend."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from whitney import backends
from whitney.errors import Conflict, InvalidInput, NotFound, TooLarge, Unavailable
from whitney.protocol.backend import BackendSpec, SamplerReplicas, ServedBackend
from whitney.protocol.config import DEFAULT_MODEL, EngineConfig, shown_name
from whitney.protocol.files import remove_leftovers
from whitney.service.api import tinker
from whitney.service.api.native import (capabilities, checkpoints, custom_losses, operations, run_metrics, run_samples,
                                        sampling, schemas, sessions)
from whitney.service.api.openai import routes as openai
from whitney.service.console import create_console
from whitney.service.http import handlers
from whitney.service.http.bodies import path_methods, read_body, replaying
from whitney.service.http.deps import ServiceState, Unauthorized, new_app
from whitney.service.http.metrics import Metrics
from whitney.service.http.refusals import Refusals
from whitney.service.http.text import TextCheck
from whitney.service.scheduling.limits import Limits
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.store.database import Store
from whitney.service.store.key_limits import KeyLimits
from whitney.service.store.keys import OWNER_SCOPE_KEY, KeyGate, KeyRing
from whitney.service.store.quotas import QuotaExceeded, Quotas

log = logging.getLogger("whitney.service")
# The most a request without a key may send (the console's sign-in form is the one such route that reads a body).
OPEN_BODY_BYTES = 64 * 2**10
STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, Conflict: 409, TooLarge: 413, QuotaExceeded: 429,
          Unavailable: 503}
# What the error handlers below answer, so the OpenAPI document shows the real error body (not FastAPI's default).
ERRORS = {status: {"model": schemas.Error, "description": text} for status, text in (
    (400, "invalid input (code invalid_input)"), (401, "missing or unknown API key (code unauthorized)"),
    (404, "no such session, run, operation, checkpoint or sampler version (code not_found)"),
    (409, "valid alone, but clashes with the state (code conflict)"),
    (413, "over a stated limit: body bytes, datums or tokens per request, metadata bytes, stop "
          "sequences (code too_large)"), (422, "not the request schema (code invalid_request)"),
    (429, "over a per-key quota; Retry-After says when to try again (code quota_exceeded)"),
    (503, "a worker the request needs is restarting after a failure; retry shortly (code unavailable)"))}


@dataclass
class ServiceConfig:
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    data_dir: Path = Path("~/.local/share/whitney").expanduser()
    db_url: str | None = None  # default: sqlite:///<data_dir>/whitney.db
    api_keys: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)  # per request, and the worker's micro-batch budget
    session_timeout: float = 600.0
    expiry_interval: float = 5.0  # seconds between the reaper's passes (expired sessions and checkpoints)
    engine: EngineConfig = field(default_factory=EngineConfig)  # LoRA rank bound, dtype, sampling memory
    # API keys and per-key quotas (keys.py, quotas.py): keys are required when api_keys is given, require_keys
    # is set or the database holds a key; key_limits are the server's defaults, a key's own limits override them.
    require_keys: bool = False
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    metrics_key: str | None = None  # the operator's key for GET /metrics (http/metrics.py); never a tenant's key
    # Where the engine runs: "inprocess" (this process) or "ray" (workers on a Ray cluster; see RayBackend).
    backend: str = "inprocess"
    ray_address: str | None = None  # None: start a local Ray instance
    # Each base model's sampler replicas (Whitney's on Ray, or vLLM's beside either backend); none: the trainer samples.
    samplers: SamplerReplicas = field(default_factory=SamplerReplicas)
    # Ray resources of each model's workers, by the name it is given or served under, e.g.
    # {"tiny": {"cpus": 2, "gpus": 1, "node_a": 1}}; default one CPU each.
    worker_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    # Highly available (service/cluster): any number of processes on one PostgreSQL database answer the API, one
    # of them scheduling at a time under a lease of this many seconds (None: this process alone schedules).
    ha_lease_seconds: float | None = None


def create_app(config: ServiceConfig, backend: ServedBackend | None = None,
               worker_thread: bool = True) -> FastAPI:
    """Build the app. The base models are loaded here, before the first request (by default into an
    in-process engine; `backend` may be any other, its models already loaded).

    worker_thread=False leaves the scheduler's worker loop to the caller (`scheduler.run()` on the main
    thread, as `whitney serve` does); the app then serves from another thread (`serve_in_thread`).
    """
    data_dir = Path(config.data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    if config.metrics_key and config.metrics_key in config.api_keys:
        raise InvalidInput("the metrics key must not be one of the API keys: a tenant's key never reads /metrics",
                           field="metrics_key")
    metrics = Metrics(config.metrics_key)
    store = Store(config.db_url or f"sqlite:///{data_dir / 'whitney.db'}", observer=metrics.operation_ended)
    if config.ha_lease_seconds is None:  # else the next leader takes over what the last one left (cluster/inbox.py)
        store.recover_after_restart()
    remove_leftovers(data_dir / "packages")  # half-written checkpoints of a killed process
    # A model served from a directory goes by the directory's name, so no route shows a server path; the
    # path as given still names it. The engine holds the one loaded model under both names.
    shown = [shown_name(name) for name in config.models]
    if len(set(shown)) < len(shown):
        raise ValueError(f"two models would be served under one name: {shown}")
    if backend is None:
        backend = start_backend(config, shown)
    scheduler = Scheduler(backend, store, data_dir, config.limits.max_batch_tokens, config.session_timeout,
                          expiry_interval=config.expiry_interval)
    member = None
    if config.ha_lease_seconds is not None:
        from whitney.service.cluster.member import Member

        member = Member(store, scheduler, config.ha_lease_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if member is not None:
            member.start()
            if worker_thread:  # it schedules once it leads
                threading.Thread(target=lambda: member.elected.wait() and member.lead(start_scheduler=True),
                                 name="whitney-lead", daemon=True).start()
        elif worker_thread:
            scheduler.start()
        yield
        if member is not None:
            member.stop()
        scheduler.stop()
        backend.close()

    app = new_app(title="Whitney", version="0.1.0", lifespan=lifespan,
                  description="Fine-tuning through training primitives: many LoRA runs on one base model.")
    keys = KeyRing(store, list(config.api_keys), config.require_keys)
    app.state.whitney = ServiceState(store, scheduler if member is None else member.dispatch, shown, keys, data_dir,
                                     config.limits, Quotas(store, keys, config.key_limits, backend),
                                     {name: public for name, public in zip(config.models, shown) if name != public},
                                     metrics, member)
    metrics.watch(app.state.whitney)
    for module in (capabilities, sessions, operations, custom_losses, sampling, checkpoints, openai, run_metrics,
                   run_samples):
        app.include_router(module.router, responses=ERRORS)
    app.include_router(capabilities.health, responses=ERRORS)  # GET /healthz, the one route open without a key
    # The Tinker SDK's protocol, over the same state (store, scheduler, engine).
    app.mount("/api/v1", tinker.create_tinker_app(app.state.whitney))
    app.mount("/console", create_console(app.state.whitney, STATUS))  # the web console, over the same state
    schemas.exact_integer_bounds(app)  # /openapi.json: 2**63 as an integer, not 9.223372036854776e+18

    app.add_middleware(TextCheck)  # inside BodyLimit: it reads bodies BodyLimit has bounded
    app.add_middleware(BodyLimit, limit=config.limits.max_request_bytes)
    app.add_middleware(AllowedMethods)  # OPTIONS, and Allow on a 405
    app.add_middleware(Refusals, budget=app.state.whitney.quotas.refusals)  # inside KeyGate: it names the owner
    app.add_middleware(KeyGate, keys=keys)  # outermost: with keys on, nothing but /healthz answers without one

    handlers.install(app, STATUS)
    return app


def start_backend(config: ServiceConfig, shown: list[str]) -> ServedBackend:
    """The configured backend (whitney/backends, by name) with the models loaded (`shown`: the name each is
    served under)."""
    # Sampling prefills at most one engine call's budget of prompt tokens per step, as training does.
    engine = replace(config.engine, max_prefill_tokens=config.limits.max_batch_tokens)
    if engine.paging_dir is None:  # idle runs are paged out to the data dir (engine/paging.py)
        engine = replace(engine, paging_dir=str(Path(config.data_dir).expanduser() / "paged"))
    return backends.start(config.backend, BackendSpec(engine, tuple(zip(config.models, shown)), config.ray_address,
                                                      config.samplers, dict(config.worker_resources),
                                                      service_name(config)))


def service_name(config: ServiceConfig) -> str | None:
    """A highly available service's name, the same for all its members (they share one database): its workers go
    by it (BackendSpec.service). None for a service of one process."""
    if config.ha_lease_seconds is None:
        return None
    import hashlib

    return "whitney-" + hashlib.sha256((config.db_url or "").encode()).hexdigest()[:12]


class BodyLimit:
    """413 for a body over the limit: a declared content-length is checked up front, and a body sent without
    one (chunked) is read up to the limit before the app sees it, so neither way gets past the limit.

    A request KeyGate let through without a key (/healthz, signed downloads, the console, whose sign-in form is
    the one such route that reads a body) may send at most OPEN_BODY_BYTES: no request without a key reads more.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit if OWNER_SCOPE_KEY in scope else min(self.limit, OPEN_BODY_BYTES)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await self._too_large(scope, receive, send, f"request body of {int(length)} bytes", limit)
            return await self.app(scope, receive, send)
        body, size = await read_body(receive, limit)
        if body is None:
            if size > limit:
                return await self._too_large(scope, receive, send, f"request body of more than {size - 1} bytes",
                                             limit)
            return  # the client went away
        await self.app(scope, replaying(body, receive), send)

    async def _too_large(self, scope, receive, send, what: str, limit: int) -> None:
        response = JSONResponse(status_code=413, content={
            "code": "too_large", "field": "body", "message": f"{what} exceeds the limit of {limit}"})
        await response(scope, receive, send)


class AllowedMethods:
    """`OPTIONS` on a path answers 204 with `Allow` naming every method of the path, and a 405 carries the same
    `Allow` (Starlette's names only the first route's methods where a path has several, as GET and DELETE)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":
            methods = path_methods(scope["app"].routes, scope)
            if not methods:  # no such path: the app's 404
                return await self.app(scope, receive, send)
            return await Response(status_code=204, headers={"Allow": _allow(methods)})(scope, receive, send)
        asked = dict(scope)  # as it came: the router adds to the scope it passes on

        async def send_allow(message):  # the path's methods are matched only for a 405 (not on every request)
            if message["type"] == "http.response.start" and message["status"] == 405:
                allow = _allow(path_methods(asked["app"].routes, asked))
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", allow.encode())]}
            await send(message)

        await self.app(scope, receive, send_allow)


def _allow(methods: set[str]) -> str:
    return ", ".join(sorted(methods | {"OPTIONS"}))


STOP_GRACE = 5  # seconds a stopping server waits for the requests in flight


@dataclass
class ThreadedServer:
    """A uvicorn server running an app in a background thread (whitney serve, the demo, tests)."""

    url: str
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                    log_level: str | None = None) -> ThreadedServer:
    """Serve `app` from a daemon thread; port 0 takes a free one. Returns once it accepts connections.

    log_level None: uvicorn's warnings only (tests, the demo); else uvicorn logs through the logging already
    configured (`whitney serve`), a line per request at "info" and below.
    """
    import uvicorn

    # Stopping, requests in flight get STOP_GRACE seconds to end (uvicorn's default waits for them forever).
    if log_level is None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=STOP_GRACE)
    else:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None,
                                access_log=log_level in ("debug", "info"), timeout_graceful_shutdown=STOP_GRACE)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ThreadedServer(f"http://{host}:{bound}", server, thread)
