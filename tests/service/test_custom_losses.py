"""The custom_losses table on a real SQLite store: checked at creation, scoped to the creating key,
idempotent under a given id (a resent create_custom_loss), and put in place of a handle by `resolve`."""

from __future__ import annotations

import pytest

from tests.engine.test_custom_loss import HOSTILE, clipped_is, definition
from whitney.engine.losses.custom import compile_loss
from whitney.errors import InvalidInput, NotFound
from whitney.service.store import custom_losses
from whitney.service.store.database import Store

RANKS = {"logprobs": 1, "old_logprobs": 1, "advantages": 1}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'w.db'}")


def test_a_loss_belongs_to_its_key_and_resolves_to_its_definition(store):
    spec = definition(clipped_is, RANKS)
    row = custom_losses.create(store, "alice", spec, compile_loss)
    assert custom_losses.resolve(store, "alice", "custom", {"loss_id": row.id}) == spec
    assert custom_losses.resolve(store, "alice", "ppo", {"clip_low": 0.1}) == {"clip_low": 0.1}  # not custom
    with pytest.raises(NotFound):
        custom_losses.resolve(store, "bob", "custom", {"loss_id": row.id})
    assert [r.id for r in custom_losses.list_for(store, "alice")] == [row.id]
    assert custom_losses.list_for(store, "bob") == []
    for bad in ({}, {"loss_id": row.id, "clip": 1.0}, spec):
        with pytest.raises(InvalidInput) as e:
            custom_losses.resolve(store, "alice", "custom", bad)
        assert e.value.field == "loss_config"


def test_a_resend_under_the_same_id_is_the_same_loss_and_a_different_body_is_refused(store):
    spec = definition(clipped_is, RANKS)
    first = custom_losses.create(store, "alice", spec, compile_loss, loss_id="ses-1:loss:0", session_id="ses-1")
    again = custom_losses.create(store, "alice", spec, compile_loss, loss_id="ses-1:loss:0", session_id="ses-1")
    assert again == first
    other = {**spec, "name": "renamed"}
    with pytest.raises(InvalidInput):
        custom_losses.create(store, "alice", other, compile_loss, loss_id="ses-1:loss:0")
    with pytest.raises(InvalidInput):  # another key cannot take (or learn about) the id either
        custom_losses.create(store, "bob", spec, compile_loss, loss_id="ses-1:loss:0")


def test_a_hostile_graph_is_never_stored(store):
    refused = [spec for stage, spec in HOSTILE.values() if stage == "create"]
    for spec in refused:
        with pytest.raises(InvalidInput):
            custom_losses.create(store, "alice", spec, compile_loss)
    assert custom_losses.list_for(store, "alice") == []
