"""What the Tinker routers share: error mapping, ids and tinker:// paths, samplers, body models.

Ids: a Tinker model id `{session_id}:train:{n}` is the native run id itself, so no mapping table is
needed; a Tinker request id is the native operation id. Tinker seq_ids count from 1 per model, the
native ones from 0: native = tinker - 1.

Paths: `tinker://{model_id}/weights/{name}` is the newest saved state of that name (kind "state"),
`tinker://{model_id}/sampler_weights/{name}` the newest sampler version of that name (kind "sampler"),
`tinker://{model_id}/external_weights/{name}` the newest PEFT export of that name (kind "lora"). A path
reads the caller's own package, else one of the key it presents as a weights access token, else a public one.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict

from whitney.errors import InvalidInput, NotFound, WhitneyError
from whitney.protocol.backend import PackageKind
from whitney.service.api.native import schemas
from whitney.service.http.deps import ServiceState
from whitney.service.store import packages
from whitney.service.store.lifecycle import OperationStatus
from whitney.service.store.records import PackageRecord

NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # the native package-name rule
SEGMENT_KIND = {"weights": PackageKind.STATE, "sampler_weights": PackageKind.SAMPLER,
                "external_weights": PackageKind.LORA}
KIND_SEGMENT = {v: k for k, v in SEGMENT_KIND.items()}
CHECKPOINT_TYPE = {PackageKind.STATE: "training", PackageKind.SAMPLER: "sampler", PackageKind.LORA: "external"}


class TinkerBody(BaseModel):
    """A Tinker request body: newer SDKs add fields, so unknown ones are accepted (and ignored). Known ones are
    strict, as on the native API: `true` is not the integer 1, `"0"` is not 0 (an integer is still a float)."""

    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())


@dataclass
class Sampler:
    """A Tinker sampling session: a base model, a tinker:// path, or a save_weights_for_sampler op."""

    owner: str
    base_model: str
    model_path: str | None = None
    op_id: str | None = None  # an ephemeral save_weights_for_sampler: its result names the version


@dataclass
class TinkerState:
    """In-process Tinker bookkeeping (samplers live as long as the process, like the runs they sample)."""

    samplers: dict[str, Sampler] = field(default_factory=dict)
    sampler_of_op: dict[str, str] = field(default_factory=dict)  # save_weights_for_sampler op -> sampler id
    copies: dict[tuple[str, str], str] = field(default_factory=dict)  # (owner, X-Idempotency-Key) -> copy's path
    lock: threading.Lock = field(default_factory=threading.Lock)


async def tinker_state(request: Request) -> TinkerState:  # async: no thread hop (deps.py)
    return request.app.state.tinker


Tinker = Annotated[TinkerState, Depends(tinker_state)]


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def native_seq(seq_id: int | None) -> int:
    if not isinstance(seq_id, int) or seq_id < 1 or seq_id >= 2**63:
        raise InvalidInput(f"seq_id must be an integer from 1, got {seq_id!r}", field="seq_id")
    return seq_id - 1


def tinker_path(package: PackageRecord) -> str:
    return path_of(package.run_id, package.kind, package.name)


def path_of(run_id: str, kind: str, name: str) -> str:
    """The tinker:// path of a package's newest version (a stored result's package: its "run_id", "kind", "name")."""
    return f"tinker://{run_id}/{KIND_SEGMENT[kind]}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """tinker://{model_id}/{weights|sampler_weights|external_weights}/{name} -> (run id, package kind, name)."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in SEGMENT_KIND or not parts[0] or not parts[2]:
        raise InvalidInput(f"{path!r} is not a tinker://<model_id>/<weights|sampler_weights|external_weights>/<name> "
                           "path",
                           field="path")
    return parts[0], SEGMENT_KIND[parts[1]], parts[2]


def packages_named(st: ServiceState, who: str, run_id: str, kind: str, name: str) -> list[PackageRecord]:
    """Every live version of one checkpoint name of the caller's own run, oldest first (what writes act on)."""
    st.store.get_run(run_id, who)
    return [p for p in st.store.list_packages(who, run_id, kind) if p.name == name]


def resolve_path(st: ServiceState, who: str, path: str, also: str | None = None) -> PackageRecord:
    """The package a tinker:// path names (its newest version): the caller's, else one of `also` (the owner
    of a weights access token the caller presented), else a public one."""
    run_id, kind, name = parse_path(path)
    for owner in (who, also):
        found = [p for p in st.store.list_packages(owner, run_id, kind) if p.name == name] if owner is not None \
            else []
        if found:
            return max(found, key=lambda p: p.version)
    found = [p for p in packages.public_packages(st.store)
             if (p.run_id, p.kind, p.name) == (run_id, kind, name)]
    if not found:
        raise NotFound(f"no checkpoint {path!r}", field="path")
    return max(found, key=lambda p: p.version)


def access_owner(st: ServiceState, token: str | None) -> str | None:
    """The owner of the second key a caller presents (`weights_access_token`): it may read that key's packages."""
    return st.keys.owner(token) if token else None


def sampler_ref(st: ServiceState, sampler: Sampler) -> schemas.WeightsRef:
    """The native weights reference a sampler samples from."""
    if sampler.op_id is not None:
        op = st.store.get_operation(sampler.op_id)
        if op.status != OperationStatus.SUCCEEDED:
            raise InvalidInput(f"the weights of this sampler were not saved (save_weights_for_sampler "
                               f"is {op.status})", field="sampling_session_id")
        return schemas.WeightsRef(run_id=op.run_id, version=op.result["version"])
    if sampler.model_path is not None:
        return schemas.WeightsRef(checkpoint_id=resolve_path(st, sampler.owner, sampler.model_path).id)
    return schemas.WeightsRef(base_model=sampler.base_model)


def served(st: ServiceState, base_model: str | None) -> str:
    if not st.serves(base_model):
        raise InvalidInput(f"base model {base_model!r} is not served here; served: {st.models}", field="base_model")
    return base_model


def iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def checkpoint(package: PackageRecord) -> dict[str, Any]:
    """A package as Tinker's Checkpoint (its user_metadata values as strings, as Tinker's type has them)."""
    metadata = package.user_metadata
    return {"checkpoint_id": f"{KIND_SEGMENT[package.kind]}/{package.name}",
            "checkpoint_type": CHECKPOINT_TYPE[package.kind], "time": iso(package.created_at),
            "tinker_path": tinker_path(package), "size_bytes": packages.size_bytes(package),
            "public": bool(package.public), "expires_at": iso(package.expires_at),
            "user_metadata": None if metadata is None else {
                k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}}


def error_text(exc: WhitneyError) -> str:
    return exc.to_dict().get("message", str(exc))
