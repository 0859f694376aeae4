"""Request dependencies: the app's state, the caller's identity, and the runs it owns."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request

from whitney.errors import WhitneyError
from whitney.service.scheduler import Scheduler
from whitney.service.store import Store


class Unauthorized(WhitneyError):
    code = "unauthorized"


@dataclass
class ServiceState:
    """Everything the routes share, built once by create_app."""

    store: Store
    scheduler: Scheduler
    models: list[str]  # base-model names served, the first is the default
    api_keys: list[str]  # empty: no authentication
    data_dir: Path
    max_request_bytes: int


def state(request: Request) -> ServiceState:
    return request.app.state.whitney


def owner_of_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def owner(request: Request, authorization: Annotated[str | None, Header()] = None,
          x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The caller's identity: a digest of its API key ('' when the server has no keys).

    Native clients send `Authorization: Bearer <key>`; Tinker's SDK sends `X-API-Key`.
    """
    st = state(request)
    key = None
    if authorization and authorization.lower().startswith("bearer "):
        key = authorization[7:].strip()
    elif x_api_key:
        key = x_api_key
    if not st.api_keys:
        return ""
    if key is None or key not in st.api_keys:
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)", field="authorization")
    return owner_of_key(key)


State = Annotated[ServiceState, Depends(state)]
Owner = Annotated[str, Depends(owner)]
