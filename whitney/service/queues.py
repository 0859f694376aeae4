"""The scheduler's bookkeeping: a run's queue of operations by seq_id, an operation part-way through its
micro-batches, a compute_logprobs request scored chunk by chunk, and a worker thread's lane of calls."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Callable

from whitney.engine import ForwardResult
from whitney.engine.backend import Weights
from whitney.service.jobs import Job


@dataclass
class Progress:
    """A forward/forward_backward operation part-way through its micro-batches."""

    done: int = 0  # datums already run
    parts: list[ForwardResult] = field(default_factory=list)
    staged: bool = False  # runs in more than one micro-batch: its gradient is staged under its id


@dataclass
class RunQueue:
    next_seq: int = 0
    pending: dict[int, tuple[dict, Job]] = field(default_factory=dict)  # seq_id -> (operation, job)
    finishing: bool = False
    progress: Progress | None = None  # of the operation at next_seq, once its first micro-batch ran
    served: int = 0  # the engine call that last ran its work (fairness: the least recently served first)
    starved: bool = False  # got no datum in the last engine call it was ready for
    # When it last had a forward/forward_backward ready (engine call count, monotonic time) and its tokens:
    # for a while after, its share of each call is reserved (`plan_micro_batches`).
    active_call: int = -(10**9)
    active_at: float = -1e18
    active_tokens: int = 0


@dataclass
class Lane:
    """One worker thread's queue of calls to run on it, and the event that wakes it."""

    name: str
    calls: list[tuple[Callable, concurrent.futures.Future]] = field(default_factory=list)
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass
class Scoring:
    """A compute_logprobs request, scored a chunk of sequences per worker iteration."""

    operation: dict
    sequences: list[list[int]]
    weights: Weights
    done: int = 0
    logprobs: list = field(default_factory=list)
