"""vLLM replicas on a Ray cluster: each a vLLM server started by a small actor (`VllmHost`) that Ray places with
the model's worker resources (`--worker-resources`: CPUs, GPUs, a node label). The actor lives exactly as long as
its replica, so the resources are asked for only then (an autoscaler may add the node for it, and remove it once
an elastic replica has stopped). The control plane talks to the server over HTTP, at the node's address, with the
server's own key; nothing but the address crosses Ray.
"""

from __future__ import annotations

import time
from pathlib import Path

from whitney.backends.vllm.server import ServerSpec, VllmServer

DESCRIBE_TIMEOUT = 10.0  # seconds an answer from a live host may take


class VllmHost:
    """Runs in the actor: the server, listening on every interface of its node, behind its key."""

    def __init__(self, spec: ServerSpec, log_path: str):
        import ray

        self.server = VllmServer(spec, Path(log_path), host="0.0.0.0")
        self.url = f"http://{ray.util.get_node_ip_address()}:{self.server.port}"

    def describe(self) -> tuple[str, str, int]:
        return self.url, self.server.api_key, self.server.pid

    def state(self) -> tuple[bool, bool, int | None]:
        """(alive, ready, exit code)."""
        return self.server.alive(), self.server.ready(), self.server.process.poll()

    def log_tail(self, lines: int) -> str:
        return self.server.log_tail(lines)

    def stop(self) -> None:
        self.server.stop()


class RayHosted:
    """A replica's server in a VllmHost actor, as the pool holds it (replicas.Server). Its answers are asked for
    without waiting on an actor that Ray has not placed yet (it counts as starting)."""

    def __init__(self, ray, actor, options: dict, spec: ServerSpec, log_path: Path):
        self.ray = ray
        self.actor = actor.options(**options).remote(spec, str(log_path))
        self.log_path = log_path
        self.started_at = time.monotonic()
        self.returncode: int | None = None
        self._described = self.actor.describe.remote()
        self.url, self.headers, self.pid = "", {}, 0
        self._dead = False

    def _placed(self) -> bool:
        if self.url:
            return True
        ready, _ = self.ray.wait([self._described], timeout=0)
        if not ready:
            return False
        try:
            self.url, key, self.pid = self.ray.get(self._described)
        except self.ray.exceptions.RayError:
            self._dead = True
            return False
        self.headers = {"Authorization": f"Bearer {key}"}
        return True

    def _state(self) -> tuple[bool, bool]:
        if self._dead:
            return False, False
        if not self._placed():
            return not self._dead, False
        try:
            alive, ready, self.returncode = self.ray.get(self.actor.state.remote(), timeout=DESCRIBE_TIMEOUT)
        except (self.ray.exceptions.RayError, TimeoutError):
            self._dead = True
            return False, False
        self._dead = not alive
        return alive, ready

    def alive(self) -> bool:
        return self._state()[0]

    def ready(self) -> bool:
        return self._state()[1]

    def log_tail(self, lines: int = 20) -> str:
        try:
            return self.ray.get(self.actor.log_tail.remote(lines), timeout=DESCRIBE_TIMEOUT)
        except (self.ray.exceptions.RayError, TimeoutError):
            return "(its host is gone)"

    def stop(self) -> None:
        """The server stopped, then its actor, whose resources Ray then frees."""
        try:
            self.ray.get(self.actor.stop.remote(), timeout=DESCRIBE_TIMEOUT)
        except (self.ray.exceptions.RayError, TimeoutError):
            pass
        self.ray.kill(self.actor, no_restart=True)
        self._dead = True


def ray_launch(placements: dict[str, dict]):
    """The pool's `launch` on Ray: each model's replicas in VllmHost actors with `placements[model]`'s actor
    options (its --worker-resources)."""
    import ray

    actor = ray.remote(VllmHost)

    def launch(model: str, spec: ServerSpec, log_path: Path) -> RayHosted:
        return RayHosted(ray, actor, placements[model], spec, log_path)

    return launch
