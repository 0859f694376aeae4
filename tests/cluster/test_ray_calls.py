"""The Ray backend's calls (whitney/backends/ray/calls.py) against the backend the workers run them on, without Ray:
each call's `on` uses only `InProcessBackend` methods that exist, with arguments their signatures take, so a
misspelt or misshapen call fails here rather than in a worker."""

from __future__ import annotations

import inspect
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
