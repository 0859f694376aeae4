"""The Ray backend's calls (whitney/backends/ray/calls.py) against the backend the workers run them on, without Ray:
each call's `on` uses only `InProcessBackend` methods that exist, with arguments their signatures take, so a
misspelt or misshapen call fails here rather than in a worker."""

from __future__ import annotations

import inspect
import threading
from dataclasses import fields

from whitney.backends.in_process import InProcessBackend
from whitney.backends.ray import calls


class Recorder:
    """Stands in for the worker's backend: records each attribute read, and each method called with its arguments."""

    def __init__(self):
        self.read: list[str] = []
        self.called: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        self.read.append(name)

        def method(*args, **kwargs):
            self.called.append((name, args, kwargs))
            return []

        return method


def test_every_call_uses_the_backend_as_it_is():
    kinds = calls.Call.__subclasses__()
    assert len(kinds) >= 15, kinds
    for kind in kinds:
        backend = Recorder()
        kind(*(0.0 if f.type == "float" else f"<{f.name}>" for f in fields(kind))).on(backend)
        assert backend.called, f"{kind.__name__} calls nothing"
        for name in backend.read:
            assert hasattr(InProcessBackend, name), f"{kind.__name__} reads InProcessBackend.{name}, which is not there"
        for name, args, kwargs in backend.called:
            method = getattr(InProcessBackend, name, None)
            assert callable(method), f"{kind.__name__} calls InProcessBackend.{name}, which does not exist"
            inspect.signature(method).bind(None, *args, **kwargs)  # TypeError: not the arguments it takes


class Rank:
    """Stands in for a worker's Ray actor handle: records each call sent to it (`rank.run.remote(call)`)."""

    def __init__(self):
        self.sent: list[calls.Call] = []
        self.run = self

    def remote(self, call: calls.Call) -> None:
        self.sent.append(call)


class Workers:
    """Stands in for the supervisor: the workers the sampling module sees, all usable."""

    def __init__(self, workers: list):
        self.lock = threading.RLock()
        self._workers = workers

    def workers(self) -> list:
        return self._workers

    def usable(self, worker) -> bool:
        return True


def test_a_cancel_goes_to_the_worker_holding_the_sample():
    """Issue 31: the proxy's cancel_sample reaches the one worker the request went to (every rank of it), at once,
    and the request is no longer in flight there; an unknown one sends nothing."""
    from whitney.backends.ray.proxy import RayBackend
    from whitney.backends.ray.sampling import Sampling
    from whitney.backends.ray.workers import Role, Worker

    trainer = Worker([Rank(), Rank()], "m", Role.TRAINER)
    replica = Worker([Rank()], "m", Role.SAMPLER, inflight={"op-a": 0, "op-b": 0})
    backend = RayBackend.__new__(RayBackend)  # no cluster: only its sampling, over the stand-ins
    backend._sampling = Sampling(Workers([trainer, replica]))
    backend.cancel_sample("op-a")
    assert replica.ranks[0].sent == [calls.CancelSample("op-a")] and replica.inflight == {"op-b": 0}
    assert not any(rank.sent for rank in trainer.ranks)
    backend.cancel_sample("op-a")  # no longer in flight anywhere: nothing is sent
    backend.cancel_sample("op-unknown")
    assert replica.ranks[0].sent == [calls.CancelSample("op-a")]
    trainer.inflight["op-c"] = 0  # a sharded trainer: every rank drops it
    backend.cancel_sample("op-c")
    assert [rank.sent for rank in trainer.ranks] == [[calls.CancelSample("op-c")]] * 2


def test_cancel_sample_drops_the_request_in_the_worker(tiny_llama):
    """What the worker runs for CancelSample: its InProcessBackend drops the request from its sampler."""
    from whitney.engine import Engine
    from whitney.protocol.backend import Weights
    from whitney.protocol.sampling import SamplingParams

    backend, weights = InProcessBackend(Engine()), Weights(base_model=tiny_llama)
    backend.submit_sample("op-a", [1, 2, 3], SamplingParams(max_tokens=50, num_samples=2, stop=()), weights)
    backend.submit_sample("op-b", [1, 2], SamplingParams(max_tokens=3, stop=()), weights)
    backend.sample_step()
    sampler = backend.engine.samplers[tiny_llama]
    assert len(sampler.rows) == 3
    calls.CancelSample("op-a").on(backend)
    assert [row.request.params.max_tokens for row in sampler.rows] == [3] and sampler.cache.rows == 1
    ended = []
    while backend.sampling_in_flight:
        ended += backend.sample_step()
    assert [request_id for request_id, _ in ended] == ["op-b"]
