"""Custom losses created by a key: stored definitions, found by id, and put in place of a handle.

A definition is the engine's plain data, `{name, inputs, graph}` (whitney/engine/losses/custom.py checks it
at creation; the engine checks it again in every request, so a remote engine trusts nothing it is sent).
It is durable like a run: a handle keeps working across restarts, for the key that created it only.
Both APIs name a stored loss the same way: loss function "custom" with loss_config {"loss_id": id}.
"""

from __future__ import annotations

import time
from typing import Callable

from sqlalchemy import select

from whitney.errors import InvalidInput, NotFound
from whitney.service.store.database import Store, digest
from whitney.service.store.records import CustomLossRecord, record
from whitney.service.store.tables import CustomLossRow, new_id

CUSTOM = "custom"  # the loss function name that takes {"loss_id": ...}


def public(loss: CustomLossRecord, with_graph: bool = False) -> dict:
    out = {"id": loss.id, "name": loss.name, "inputs": loss.definition["inputs"],
           "session_id": loss.session_id, "created_at": loss.created_at}
    return {**out, "graph": loss.definition["graph"]} if with_graph else out


def create(store: Store, who: str, definition: dict, check: Callable[[dict], None], *, loss_id: str | None = None,
           session_id: str | None = None) -> CustomLossRecord:
    """Check a definition (`check`: the backend's `check_custom_loss`, InvalidInput naming the node that breaks a
    rule) and store it. With `loss_id`, a resend of the same definition returns the stored row and a different
    one under that id is InvalidInput."""
    check(definition)
    body = digest(definition)
    with store.tx() as db:
        if loss_id is not None:
            row = db.get(CustomLossRow, loss_id)
            if row is not None:
                if row.owner != who or row.body_digest != body:
                    raise InvalidInput(f"custom loss {loss_id!r} exists with another definition", field="loss_id")
                return record(CustomLossRecord, row)
        row = CustomLossRow(id=loss_id or new_id("loss"), owner=who, session_id=session_id,
                            name=definition["name"], definition=definition, body_digest=body,
                            created_at=time.time())
        db.add(row)
        db.flush()
        return record(CustomLossRecord, row)


def get(store: Store, who: str, loss_id: str) -> CustomLossRecord:
    """The caller's stored loss (another key's is NotFound, as if it did not exist)."""
    with store.tx() as db:
        row = db.get(CustomLossRow, loss_id) if isinstance(loss_id, str) else None
        if row is None or row.owner != who:
            raise NotFound(f"custom loss {loss_id!r} does not exist", field="loss_config.loss_id")
        return record(CustomLossRecord, row)


def list_for(store: Store, who: str) -> list[CustomLossRecord]:
    with store.tx() as db:
        q = select(CustomLossRow).where(CustomLossRow.owner == who).order_by(CustomLossRow.created_at)
        return [record(CustomLossRecord, r) for r in db.scalars(q)]


def resolve(store: Store, who: str, loss_fn: str, loss_config: dict) -> dict:
    """The loss_config the engine gets: for "custom", {"loss_id": id} becomes the stored definition."""
    if loss_fn != CUSTOM:
        return loss_config
    if not isinstance(loss_config, dict) or set(loss_config) != {"loss_id"}:
        raise InvalidInput("loss function custom takes loss_config {\"loss_id\": id}, the id create_custom_loss "
                           f"returned; got keys {sorted(loss_config) if isinstance(loss_config, dict) else []}",
                           field="loss_config")
    return get(store, who, loss_config["loss_id"]).definition
