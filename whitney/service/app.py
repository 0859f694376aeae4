"""create_app(config): the FastAPI application over one store, one scheduler and one engine."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from whitney.engine import DEFAULT_MODEL, Engine
from whitney.errors import Conflict, InvalidInput, NotFound, WhitneyError
from whitney.service.deps import ServiceState, Unauthorized
from whitney.service.routes import capabilities, checkpoints, operations, sampling, sessions
from whitney.service.scheduler import Scheduler
from whitney.service.store import Store

log = logging.getLogger("whitney.service")
STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, Conflict: 409}


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


def create_app(config: ServiceConfig, engine: Engine | None = None) -> FastAPI:
    """Build the app. The base models are loaded here, before the first request."""
    data_dir = Path(config.data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db_url or f"sqlite:///{data_dir / 'whitney.db'}")
    store.recover_after_restart()
    engine = engine or Engine(max_lora_rank=config.max_lora_rank)
    for name in config.models:
        engine.load_model(name)
    scheduler = Scheduler(engine, store, data_dir, config.max_batch_tokens, config.session_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="Whitney", version="0.1.0", lifespan=lifespan,
                  description="Fine-tuning through training primitives: many LoRA runs on one base model.")
    app.state.whitney = ServiceState(store, scheduler, list(config.models), list(config.api_keys), data_dir,
                                     config.max_request_bytes)
    for module in (capabilities, sessions, operations, sampling, checkpoints):
        app.include_router(module.router)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return JSONResponse(status_code=413, content={"code": "too_large", "field": "body", "message":
                                f"request body of {length} bytes exceeds the limit of {config.max_request_bytes}"})
        return await call_next(request)

    @app.exception_handler(WhitneyError)
    async def domain_error(request: Request, exc: WhitneyError):
        return JSONResponse(status_code=STATUS.get(type(exc), 400), content=exc.to_dict())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        datum = int(loc[loc.index("data") + 1]) if "data" in loc and len(loc) > loc.index("data") + 1 \
            and loc[loc.index("data") + 1].isdigit() else None
        body = {"code": "invalid_request", "field": ".".join(loc) or "body",
                "message": f"{'.'.join(loc) or 'body'}: {first.get('msg')}", "errors": _plain(exc.errors())}
        if datum is not None:
            body["datum_index"] = datum
        return JSONResponse(status_code=422, content=body)

    return app


def _plain(errors: list[dict]) -> list[dict]:
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors[:20]]
