"""A queued operation's job as bytes in the database (tables.PayloadRow), so that whichever process schedules runs
it: the typed job a route built (scheduling/jobs.py), or a sample's or a scoring's request. Stored in the
transaction that queues the operation and deleted in the one that ends it, each with its notification
(`store`, `forget`: the Store's hooks in a highly available service).

Pickled, and read back by an unpickler that builds only the plain types and the service's own job and protocol
dataclasses listed here (anything else in a row is refused, not run).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from sqlalchemy import delete, insert

from whitney.protocol.backend import Failure, Weights
from whitney.protocol.sampling import SamplingParams
from whitney.protocol.training import AdamParams, Datum, ImageInput, TensorInput
from whitney.service.cluster.notify import ENDED, SUBMITTED, send
from whitney.service.scheduling.jobs import ForwardJob, Job, LoadJob, OptimJob, Refused, SaveJob
from whitney.service.store.tables import PayloadRow


@dataclass(frozen=True)
class SampleJob:
    """A sample: its prompt (token ids, or chunks with images), parameters and weights."""

    prompt: list
    params: SamplingParams
    weights: Weights


@dataclass(frozen=True)
class ScoreJob:
    """A compute_logprobs: its sequences and weights."""

    sequences: list[list[int]]
    weights: Weights


Payload = Job | SampleJob | ScoreJob
_ALLOWED = {(c.__module__, c.__qualname__) for c in (
    ForwardJob, OptimJob, SaveJob, LoadJob, Refused, SampleJob, ScoreJob, Failure, Weights, SamplingParams, AdamParams,
    Datum, ImageInput, TensorInput)}
_PLAIN = {("builtins", n) for n in ("list", "dict", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int",
                                    "float", "bool", "complex")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module, name) in _PLAIN or (module == "copyreg" and name == "_reconstructor"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a stored payload names {module}.{name}, which is not a job's type")


def package_read(payload: Payload) -> str | None:
    """The path of the model package the operation reads while it runs (counted as its reader: packages.reading)."""
    if isinstance(payload, LoadJob):
        return payload.path
    if isinstance(payload, (SampleJob, ScoreJob)):
        return payload.weights.checkpoint_path
    return None


def store(conn, op_id: str, payload: bytes | None) -> None:
    """Store.queued: the job stored with its operation, in its transaction, and the leader told (an operation
    without a job, done when made, tells no one)."""
    if payload is not None:
        conn.execute(insert(PayloadRow), {"op_id": op_id, "job": payload})
        send(conn, SUBMITTED, op_id)


def forget(conn, op_ids: list[str]) -> None:
    """Store.ended: the ended operations' jobs deleted, in the transaction that ends them, and every member told."""
    conn.execute(delete(PayloadRow).where(PayloadRow.op_id.in_(op_ids)))
    for op_id in op_ids:
        send(conn, ENDED, op_id)


def encode(payload: Payload) -> bytes:
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Payload:
    return _Unpickler(io.BytesIO(data)).load()
