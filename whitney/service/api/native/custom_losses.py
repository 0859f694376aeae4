"""Custom losses of the caller's key: create (the engine's allow-list checks the graph), read, list.

A stored loss is used by forward / forward_backward with loss_function "custom" and loss_config
{"loss_id": id} (the same handle the Tinker protocol's create_custom_loss returns).
"""

from __future__ import annotations


from whitney.service.api.native import schemas
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.store import custom_losses

router = new_router(prefix="/v1", tags=["custom_losses"])


@router.post("/custom_losses", response_model=schemas.CustomLoss, status_code=201)
def create_custom_loss(body: schemas.CustomLossCreate, st: State, who: Owner):
    """Check the graph (a breach of the allow-list is a 400 naming the node) and store it for this key."""
    row = custom_losses.create(st.store, who, body.model_dump(), st.scheduler.backend.check_custom_loss)
    return custom_losses.public(row)


@router.get("/custom_losses", response_model=list[schemas.CustomLoss])
def list_custom_losses(st: State, who: Owner):
    return [custom_losses.public(r) for r in custom_losses.list_for(st.store, who)]


@router.get("/custom_losses/{loss_id}", response_model=schemas.CustomLoss)
def get_custom_loss(loss_id: str, st: State, who: Owner):
    return custom_losses.public(custom_losses.get(st.store, who, loss_id), with_graph=True)
