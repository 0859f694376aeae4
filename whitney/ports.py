"""A free TCP port on this machine (torch-free: the engine's ranks, vLLM replicas, Ray ranks and the benchmarks
ask for one)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" : every interface); a process may take it before the caller binds it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
