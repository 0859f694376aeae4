"""Tinker's create_custom_loss: a loss the SDK traced with torch.fx, stored for the session's key.

The SDK uploads it only when client/config says `custom_loss_server_side` (session.py does), then runs
`forward_backward_custom(data, handle)` as forward_backward with loss_fn "custom" and loss_fn_config
{"loss_id": id}, which training.py resolves to the stored definition (service/custom_losses.py). A graph
that breaks a rule of the engine's allow-list is a 400 naming the node, answered at once: the call holds
no seq_id of a model.
"""

from __future__ import annotations

from typing import Any


from whitney.service.api.tinker.common import TinkerBody
from whitney.service.api.tinker.training import finished_op, future
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.store import custom_losses
from whitney.service.store.lifecycle import OperationKind

router = new_router()


class CreateCustomLoss(TinkerBody):
    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[Any]  # [{name, rank}], logprobs first: checked by the engine with the graph
    graph: dict[str, Any]  # {format, nodes}


@router.post("/create_custom_loss")
def create_custom_loss(body: CreateCustomLoss, st: State, who: Owner) -> dict:
    """Check the graph against the allow-list and store it; the future's result is {loss_id}."""
    st.store.get_session(body.session_id, who)
    definition = {"name": body.name, "inputs": body.inputs, "graph": body.graph}
    row = custom_losses.create(st.store, who, definition, st.scheduler.backend.check_custom_loss,
                               session_id=body.session_id,
                               loss_id=f"{body.session_id}:loss:{body.custom_loss_seq_id}")
    op = finished_op(st, who, OperationKind.CREATE_CUSTOM_LOSS, {"loss_id": row.id, "type": "create_custom_loss"})
    return future(op)
