"""Typed rows: what the store's functions return, frozen dataclasses built from the SQLAlchemy rows (tables.py)
or Core result rows, never the rows themselves. Fields are the table's columns, in its order; statuses and
operation kinds are their enums (lifecycle.py). Routes build their JSON from a record's fields (the response
schemas read them as attributes; a package's client view is `PackageRecord.shown()`), so the wire shows what it
showed when these were dicts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from whitney.service.store.lifecycle import OperationKind, OperationStatus, RunStatus, SessionStatus

R = TypeVar("R")


def record(cls: type[R], row: Any) -> R:
    """A record of `cls` from a row: an ORM row, a Core row or anything else with the columns as attributes."""
    return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class SessionRecord:
    id: str
    owner: str
    status: SessionStatus
    created_at: float
    last_heartbeat: float
    user_metadata: dict
    tags: list | None
    project_id: str | None
    display_name: str | None

    def __post_init__(self):
        object.__setattr__(self, "status", SessionStatus(self.status))


@dataclass(frozen=True)
class RunRecord:
    id: str
    session_id: str
    owner: str
    base_model: str
    lora: dict
    status: RunStatus
    created_at: float
    resume_from: str | None
    resume_with_optimizer: bool
    user_metadata: dict
    error: str | None

    def __post_init__(self):
        object.__setattr__(self, "status", RunStatus(self.status))


@dataclass(frozen=True)
class OperationRecord:
    id: str
    owner: str
    run_id: str | None  # training operations: their run and seq_id; sampling ones have neither
    seq_id: int | None
    kind: OperationKind
    body_digest: str
    status: OperationStatus
    result: dict | None
    error: dict | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    config: dict | None

    def __post_init__(self):
        object.__setattr__(self, "kind", OperationKind(self.kind))
        object.__setattr__(self, "status", OperationStatus(self.status))


@dataclass(frozen=True)
class PackageRecord:
    id: str
    run_id: str
    owner: str
    kind: str  # a PackageKind's value (compares equal to the PackageKind)
    name: str
    version: int
    path: str
    base_model: str
    has_optimizer: bool
    created_at: float
    deleted: bool
    expires_at: float | None
    readers: int
    public: bool
    user_metadata: dict | None

    def shown(self) -> dict:
        """The package as clients see it: no owner digest, no server path."""
        return {k: v for k, v in asdict(self).items() if k not in ("owner", "path", "deleted", "readers")}


@dataclass(frozen=True)
class KeyRecord:
    id: str
    digest: str  # the key's sha256; the key itself is never stored
    name: str | None
    created_at: float
    revoked_at: float | None
    max_sessions: int | None  # the key's own limits: None is the server's default, 0 unlimited
    max_runs: int | None
    max_adapter_bytes: int | None
    max_queued_operations: int | None
    max_tokens_per_minute: int | None
    max_refusals_per_minute: int | None


@dataclass(frozen=True)
class CustomLossRecord:
    id: str
    owner: str
    session_id: str | None
    name: str
    definition: dict  # {name, inputs, graph}
    body_digest: str
    created_at: float
