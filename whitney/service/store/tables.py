"""The tables of the store (SQLAlchemy rows): sessions, runs, operations, model packages, API keys, the samples
and metrics a training loop logs for its runs, custom losses. `Store.__init__` creates them all (create_all) and
migrates an older database (migrations.py).

Rows stay inside the store: its functions return typed records instead (records.py).
"""

from __future__ import annotations

import uuid

from sqlalchemy import (JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, LargeBinary, String, Text,
                        UniqueConstraint, false)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[str] = mapped_column(String(16))  # SessionStatus
    created_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    # Added after the first release (migrations.migrate adds them to an older database); found by GET /v1/sessions.
    tags: Mapped[list | None] = mapped_column(JSON, nullable=True)
    project_id: Mapped[str | None] = mapped_column(String(256), nullable=True, index=True)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)


class RunRow(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # RunStatus, moved only as lifecycle.RUN_MOVES says
    created_at: Mapped[float] = mapped_column(Float)
    # Bound at creation: the checkpoint the run resumes from. Then load_state as seq 0 is refused.
    resume_from: Mapped[str | None] = mapped_column(String(64), nullable=True)
    resume_with_optimizer: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class OperationRow(Base):
    __tablename__ = "operations"
    # A retry of (run, seq_id) must find the first submission, never create a second one (its index also
    # finds a run's later seq_ids). Every submission counts its owner's queued and running operations: by
    # (owner, status), a count of those few rows, not a scan of the owner's whole history (migrations.migrate
    # adds it to an older database).
    __table_args__ = (UniqueConstraint("run_id", "seq_id", name="one_operation_per_seq_id"),
                      Index("ix_operations_owner_status", "owner", "status"))
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    # Training operations belong to a run and carry its seq_id; sampling ones have neither order nor run.
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id"), index=True, nullable=True)
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(32))  # OperationKind
    body_digest: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)  # OperationStatus (lifecycle.OPERATION_MOVES)
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    error: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # What the request asked for that the console's configuration panel shows (a forward's loss_fn and loss_config,
    # an optim_step's adam_params; NULL for other kinds, and for operations made before this column existed:
    # migrations.migrate adds it to an older database).
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class PackageRow(Base):
    __tablename__ = "model_packages"
    # Versions of one name count up per run and kind; the constraint makes a racing duplicate fail loudly.
    __table_args__ = (UniqueConstraint("run_id", "kind", "name", "version", name="one_package_version"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # state | weights | merged | lora | sampler
    name: Mapped[str] = mapped_column(String(256))
    version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(String(512))
    has_optimizer: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    # Lifecycle (packages.py; migrated onto older databases): the reaper deletes a package past expires_at only
    # while no one reads it (readers: loads in progress), public ones are readable by every key.
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    readers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class KeyRow(Base):
    __tablename__ = "api_keys"
    # Only the key's sha256 is kept (unique: the lookup of every request); the key is shown once, at creation.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The key's own limits: NULL is the server's default, 0 unlimited (whitney.service.store.keys.LIMITS).
    max_sessions: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_runs: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_queued_operations: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_refusals_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class RunSampleRow(Base):
    """A prompt and the completion a training loop sampled for it, logged at a step (run_samples.py)."""

    __tablename__ = "run_samples"
    # A step's samples are replaced as a whole (a resent request stores them once); this also finds a run's steps.
    # The key's total is summed over (owner, bytes) alone, an index-only scan (its quota, run_samples.py).
    __table_args__ = (UniqueConstraint("run_id", "step", "idx", name="one_sample_per_step_index"),
                      Index("ix_run_samples_owner_bytes", "owner", "bytes"))
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    owner: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(BigInteger)
    idx: Mapped[int] = mapped_column(Integer)  # the sample's place in its request
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float(precision=53), nullable=True)
    sample_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    bytes: Mapped[int] = mapped_column(Integer)  # UTF-8 bytes of prompt, completion and metadata (the key's quota)
    logged_at: Mapped[float] = mapped_column(Float)


class RunMetricRow(Base):
    """A metric a training loop logged for its run at a step (run_metrics.py)."""

    __tablename__ = "run_metrics"
    # One value per metric and step: a resent request replaces the point instead of adding a second one.
    __table_args__ = (UniqueConstraint("run_id", "name", "step", name="one_value_per_metric_step"),)
    # Rising with every write (a replaced point gets a new id): the console polls for ids after the last it has.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float] = mapped_column(Float(precision=53))  # double precision on PostgreSQL too
    logged_at: Mapped[float] = mapped_column(Float)


class CustomLossRow(Base):
    """A custom loss definition a key created (custom_losses.py)."""

    __tablename__ = "custom_losses"
    # Tinker's ids are "{session_id}:loss:{seq}", so a resent create_custom_loss finds its first row.
    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    name: Mapped[str] = mapped_column(String(128))
    definition: Mapped[dict] = mapped_column(JSON)  # {name, inputs, graph}
    body_digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


# ---- several API processes over one database (service/cluster) ----


class LeaseRow(Base):
    """A lease one process holds at a time, renewed before it expires (service/cluster/lease.py): the scheduling
    leader's. `token` rises with every new holder: the fencing token every write of the holder is checked against.
    Times are the database's clock (seconds since the epoch), never a process's."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float(precision=53))
    url: Mapped[str | None] = mapped_column(Text, nullable=True)  # where the holder serves HTTP (shown by /healthz)


class PayloadRow(Base):
    """What a queued operation asks the backend to do (its typed job, service/cluster/payloads.py), stored with it so
    that whichever process schedules runs it; deleted once the operation ends."""

    __tablename__ = "operation_payloads"
    op_id: Mapped[str] = mapped_column(ForeignKey("operations.id"), primary_key=True)
    job: Mapped[bytes] = mapped_column(LargeBinary)


class LeaderCallRow(Base):
    """A call an API process asks the scheduling leader to make (create a run's adapter, finish or cancel a run,
    cancel a sample: service/cluster/calls.py), and its answer."""

    __tablename__ = "leader_calls"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    args: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued | running | done | failed
    answer: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # an error: {class, message, field}
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
