"""create_app(config): the FastAPI application over one store, one scheduler and one engine."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from whitney.engine import DEFAULT_MODEL, Engine
from whitney.errors import Conflict, InvalidInput, NotFound, WhitneyError
from whitney.service import schemas, tinker
from whitney.service.deps import ServiceState, Unauthorized
from whitney.service.routes import capabilities, checkpoints, operations, sampling, sessions
from whitney.service.scheduler import Scheduler
from whitney.service.store import Store

log = logging.getLogger("whitney.service")
STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, Conflict: 409}
# What the error handlers below answer, so the OpenAPI document shows the real error body (not FastAPI's default).
ERRORS = {status: {"model": schemas.Error, "description": text} for status, text in (
    (400, "invalid input (code invalid_input)"), (401, "missing or unknown API key (code unauthorized)"),
    (404, "no such session, run, operation, checkpoint or sampler version (code not_found)"),
    (409, "valid alone, but clashes with the state (code conflict)"),
    (413, "body over max_request_bytes (code too_large)"), (422, "not the request schema (code invalid_request)"))}


@dataclass
class ServiceConfig:
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    data_dir: Path = Path("~/.local/share/whitney").expanduser()
    db_url: str | None = None  # default: sqlite:///<data_dir>/whitney.db
    api_keys: list[str] = field(default_factory=list)
    max_request_bytes: int = 64 * 2**20
    max_batch_tokens: int = 16384
    session_timeout: float = 600.0
    max_lora_rank: int = 128
    max_sequences: int = 256  # sampling: concurrent sequences per base model (more wait in a queue)
    max_cached_tokens: int = 262_144  # sampling: KV-cache tokens per base model
    compute_dtype: str = "float32"  # base weights and activations: "float32" or "bfloat16"


def create_app(config: ServiceConfig, engine: Engine | None = None, worker_thread: bool = True) -> FastAPI:
    """Build the app. The base models are loaded here, before the first request.

    worker_thread=False leaves the scheduler's worker loop to the caller (`scheduler.run()` on the main
    thread, as `whitney serve` does); the app then serves from another thread (`serve_in_thread`).
    """
    data_dir = Path(config.data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db_url or f"sqlite:///{data_dir / 'whitney.db'}")
    store.recover_after_restart()
    engine = engine or Engine(max_lora_rank=config.max_lora_rank, max_sequences=config.max_sequences,
                              max_cached_tokens=config.max_cached_tokens,
                              compute_dtype=config.compute_dtype)
    for name in config.models:
        engine.load_model(name)
    scheduler = Scheduler(engine, store, data_dir, config.max_batch_tokens, config.session_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if worker_thread:
            scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="Whitney", version="0.1.0", lifespan=lifespan,
                  description="Fine-tuning through training primitives: many LoRA runs on one base model.")
    app.state.whitney = ServiceState(store, scheduler, list(config.models), list(config.api_keys), data_dir,
                                     config.max_request_bytes)
    for module in (capabilities, sessions, operations, sampling, checkpoints):
        app.include_router(module.router, responses=ERRORS)
    # The Tinker SDK's protocol, over the same state (store, scheduler, engine).
    app.mount("/api/v1", tinker.create_tinker_app(app.state.whitney))

    app.add_middleware(BodyLimit, limit=config.max_request_bytes)

    @app.exception_handler(WhitneyError)
    async def domain_error(request: Request, exc: WhitneyError):
        return JSONResponse(status_code=STATUS.get(type(exc), 400), content=exc.to_dict())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # Starlette's own errors (no such path, wrong method, an unparsable body) in the same shape as ours.
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content={"code": code, "message": str(exc.detail)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        # An unparsable body's loc ends in a character offset, which names no field.
        loc = [] if first.get("type") == "json_invalid" else [str(p) for p in first.get("loc", ()) if p != "body"]
        datum = int(loc[loc.index("data") + 1]) if "data" in loc and len(loc) > loc.index("data") + 1 \
            and loc[loc.index("data") + 1].isdigit() else None
        body = {"code": "invalid_request", "field": ".".join(loc) or "body",
                "message": f"{'.'.join(loc) or 'body'}: {first.get('msg')}", "errors": _plain(exc.errors())}
        if datum is not None:
            body["datum_index"] = datum
        return JSONResponse(status_code=422, content=body)

    return app


class BodyLimit:
    """413 for a body over the limit: a declared content-length is checked up front, and a body sent without
    one (chunked) is read up to the limit before the app sees it, so neither way gets past the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await self._too_large(scope, receive, send, f"request body of {int(length)} bytes")
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._too_large(scope, receive, send, f"request body of more than {size - 1} bytes")
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, what: str) -> None:
        response = JSONResponse(status_code=413, content={
            "code": "too_large", "field": "body", "message": f"{what} exceeds the limit of {self.limit}"})
        await response(scope, receive, send)


def _plain(errors: list[dict]) -> list[dict]:
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors[:20]]


@dataclass
class ThreadedServer:
    """A uvicorn server running an app in a background thread (whitney serve, the demo, tests)."""

    url: str
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> ThreadedServer:
    """Serve `app` from a daemon thread; port 0 takes a free one. Returns once it accepts connections."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ThreadedServer(f"http://{host}:{bound}", server, thread)
