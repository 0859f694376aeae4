"""What an operation, a run and a session may be, and how each status may move: listed here once.

The enums are `StrEnum`s: every member equals its string, so the database, the JSON on the wire and the
digests of retried requests are what they were with plain strings. The store applies the tables
(`Store.set_run_status`, `Store.set_operation`, `Store.end_session`) as one conditional UPDATE each: a
move not listed is refused (False) and changes nothing. That is how a lost race reads (a run cancelled
while its finish was draining is not then marked finished), so a refusal is an answer, not an error.
"""

from __future__ import annotations

from enum import StrEnum


class OperationKind(StrEnum):
    # In a run's seq_id order (TRAINING_KINDS):
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    LOAD_STATE_WITH_OPTIMIZER = "load_state_with_optimizer"
    SAVE_WEIGHTS = "save_weights"
    EXPORT_LORA = "export_lora"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    # In no run's order, on named frozen weights (SAMPLING_KINDS):
    SAMPLE = "sample"
    COMPUTE_LOGPROBS = "compute_logprobs"
    # Tinker only, done when created so that retrieve_future answers it: create_model. (A Tinker model
    # created by load_weights records a done load_state / load_state_with_optimizer, in no run's order.)
    CREATE_MODEL = "create_model"
    CREATE_CUSTOM_LOSS = "create_custom_loss"  # Tinker only, done when created (service/custom_losses.py)


_K = OperationKind
TRAINING_KINDS = (_K.FORWARD, _K.FORWARD_BACKWARD, _K.OPTIM_STEP, _K.SAVE_STATE, _K.LOAD_STATE,
                  _K.LOAD_STATE_WITH_OPTIMIZER, _K.SAVE_WEIGHTS, _K.EXPORT_LORA, _K.SAVE_WEIGHTS_FOR_SAMPLER)
SAMPLING_KINDS = (_K.SAMPLE, _K.COMPUTE_LOGPROBS)


class FailureCategory(StrEnum):
    """Whose an operation's error is (a stored error's "category", `Failure.category`)."""

    USER = "user"  # the caller's mistake (a 4xx kind)
    SERVER = "server"  # the server's own: a bug, a lost worker, a restart


class OperationStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


_S = OperationStatus
OPERATION_MOVES: dict[OperationStatus, tuple[OperationStatus, ...]] = {
    # Straight to an end: a job refused before it starts, a sample the backend refuses at submission,
    # a Tinker create_model (done when created), queued operations of a cancelled or drained run.
    _S.QUEUED: (_S.RUNNING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED),
    # cancelled: a forward_backward part-way through its micro-batches when its run is cancelled.
    _S.RUNNING: (_S.SUCCEEDED, _S.FAILED, _S.CANCELLED),
    _S.SUCCEEDED: (),
    _S.FAILED: (),
    _S.CANCELLED: (),
}
OPERATION_TERMINAL = tuple(s for s in OperationStatus if not OPERATION_MOVES[s])
OPERATION_PENDING = tuple(s for s in OperationStatus if OPERATION_MOVES[s])  # queued, running: count against quotas


class RunStatus(StrEnum):
    ACTIVE = "active"  # takes operations
    FINISHING = "finishing"  # runs what it has queued, then finished
    FINISHED = "finished"
    CANCELLING = "cancelling"  # its queued operations are being cancelled and its adapter freed
    CANCELLED = "cancelled"
    FAILED = "failed"  # its backend state was lost (kept for backends that can lose a run; none sets it yet)
    INTERRUPTED = "interrupted"  # the server restarted under it (Store.recover_after_restart)


_R = RunStatus
RUN_MOVES: dict[RunStatus, tuple[RunStatus, ...]] = {
    # finished: Scheduler.finish_run on a run the store never saw finishing; cancelled: a session that
    # expires cancels its runs at once (Scheduler._expire_sessions), without cancelling first.
    _R.ACTIVE: (_R.FINISHING, _R.FINISHED, _R.CANCELLING, _R.CANCELLED, _R.FAILED, _R.INTERRUPTED),
    _R.FINISHING: (_R.FINISHED, _R.CANCELLING, _R.CANCELLED, _R.FAILED, _R.INTERRUPTED),
    _R.CANCELLING: (_R.CANCELLED, _R.INTERRUPTED),
    _R.FINISHED: (),
    _R.CANCELLED: (),
    _R.FAILED: (),
    _R.INTERRUPTED: (),
}
RUN_TERMINAL = tuple(s for s in RunStatus if not RUN_MOVES[s])
RUN_LIVE = tuple(s for s in RunStatus if RUN_MOVES[s])  # holds a quota's place; a restart interrupts it
# Its adapter is loaded and no cancellation has begun: it can still be cancelled, and it samples from memory.
RUN_OPEN = tuple(s for s in RunStatus if _R.CANCELLING in RUN_MOVES[s])


class SessionStatus(StrEnum):
    ACTIVE = "active"
    CLOSED = "closed"
    EXPIRED = "expired"  # no heartbeat within the session timeout


SESSION_MOVES: dict[SessionStatus, tuple[SessionStatus, ...]] = {
    SessionStatus.ACTIVE: (SessionStatus.CLOSED, SessionStatus.EXPIRED),
    SessionStatus.CLOSED: (),
    SessionStatus.EXPIRED: (),
}


def sources(moves: dict, to: str) -> tuple:
    """The statuses from which a table lets a row move to `to` (empty: nothing may)."""
    return tuple(s for s, targets in moves.items() if to in targets)
