"""retrieve_future: every Tinker future is a native operation, long-polled like GET /v1/operations/{id}?wait=.

Pending is HTTP 408 with a try_again body (the SDK polls again at once, without a warning); a failure
is {error, category} with category "user" for the caller's mistakes. forward/forward_backward and
sample results are protobuf (the 0.38 SDK refuses JSON for them); the rest are JSON.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from whitney.service.api.tinker import proto, training
from whitney.service.api.tinker.common import Tinker, TinkerBody
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.store.lifecycle import OPERATION_TERMINAL, FailureCategory, OperationKind, OperationStatus

router = new_router()
MAX_WAIT = 25.0  # the SDK's read timeout for one poll is 45 s
PROTOBUF = "application/x-protobuf"


class FutureRef(TinkerBody):
    request_id: str
    allow_metadata_only: bool = False  # results are always sent whole


@router.post("/retrieve_future", responses={
    200: {"description": "the result: protobuf for forward, forward_backward and sample, JSON otherwise (a "
                         "failed operation too: {error, category})",
          "content": {"application/json": {}, PROTOBUF: {"schema": {"type": "string", "format": "binary"}}}},
    408: {"description": "not done yet: poll again", "content": {"application/json": {"schema": {
        "type": "object", "required": ["type", "request_id"], "properties": {
            "type": {"type": "string", "enum": ["try_again"]}, "request_id": {"type": "string"},
            "queue_state": {"type": "string"}}}}}}})
async def retrieve_future(body: FutureRef, st: State, who: Owner, ts: Tinker):
    op = await run_in_threadpool(st.store.get_operation, body.request_id, who)  # store reads: off the event loop
    if op.status not in OPERATION_TERMINAL:
        await st.scheduler.wait(op.id, MAX_WAIT)
        op = await run_in_threadpool(st.store.get_operation, op.id, who)
    if op.status not in OPERATION_TERMINAL:
        return JSONResponse(status_code=408, content={"type": "try_again", "request_id": op.id,
                                                      "queue_state": "active"})
    if op.status != OperationStatus.SUCCEEDED:
        error = op.error or {}
        return {"error": error.get("message", op.status), "category": error.get("category", FailureCategory.USER)}
    # Encoding a result (up to the limits' tokens) and reading the packages it names: on the thread pool too.
    if op.kind in (OperationKind.FORWARD, OperationKind.FORWARD_BACKWARD):
        return Response(await run_in_threadpool(proto.encode_forward_backward_output, op.result),
                        media_type=PROTOBUF)
    if op.kind == OperationKind.SAMPLE:
        return Response(await run_in_threadpool(proto.encode_sample_response, op.result), media_type=PROTOBUF)
    out = await run_in_threadpool(training.result, op, st)
    sampler_id = ts.sampler_of_op.get(op.id)
    if sampler_id is not None:
        out = {**out, "path": None, "sampling_session_id": sampler_id}
    return out


@router.post("/cancel_future")
def cancel_future(body: FutureRef, st: State, who: Owner) -> dict:
    """A sample (the SDK cancels one whose future it abandons: `sample_cancel_enabled`) stops before its next
    decode step, its cache freed, and ends cancelled; one that ended first is left as it is. Training operations
    run in their run's seq_id order whatever the client does: accepted, unchanged."""
    op = st.store.get_operation(body.request_id, who)
    if op.kind == OperationKind.SAMPLE and op.status not in OPERATION_TERMINAL:
        st.scheduler.cancel_sample(op.id, "cancelled by the client (cancel_future)")
    return {}
