"""Each base model's vLLM replicas: started, watched, scaled and stopped; the run versions they serve as LoRA
adapters; the samples in flight on them. Torch-free: it speaks HTTP to vLLM servers (server.py).

    ReplicaPool.submit -> a ready replica (least busy), or the model's queue while one starts
                  step -> each sample's progress and end, from the streams the pool's event loop reads
                publish -> a run's new version loaded by every ready replica before it returns

- A run's version is a PEFT adapter directory (its name `run.vN`). vLLM keeps `max_loras` adapters on its device
  and as many more in host memory, least recently used first out, and reloads one from its directory when a
  sample names it again: a sample never sees which.
- Elastic (`SamplerReplicas.elastic`): a sample that finds no replica starts one (samples wait in the model's
  queue meanwhile); one more starts while every replica has `SamplerReplicas.BUSY` samples in flight, up to
  `maximum`; a replica idle for `idle_seconds` stops, down to `minimum`. A training-only server never starts one.
- Faults: a replica whose process exits fails its samples with `worker_lost`, except a sample with a seed, which
  is idempotent and runs again on another replica (or the replacement, which starts at once), at most RETRIES times.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import httpx

from whitney.backends.vllm.requests import Answer, completion_body, flat
from whitney.backends.vllm.server import ServerSpec, VllmServer, wait_ready
from whitney.errors import InvalidInput, NotFound, Unavailable
from whitney.protocol.backend import Failure, SamplerReplicas, WorkerLost
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams

STEP_WAIT = 0.05  # step() waits at most this long for an answer when none is there
RETRIES = 2  # times a seeded sample runs again after its replica died
START_TIMEOUT = 900.0  # seconds a replica may take to serve (vLLM's first start compiles its kernels)
READY_POLL = 1.0  # seconds between readiness checks of a starting replica


class Server(Protocol):
    """A vLLM server as the pool holds it: a child process (server.py) or one on a Ray node (ray_host.py)."""

    url: str
    headers: dict[str, str]
    pid: int
    started_at: float
    log_path: Path
    returncode: int | None

    def alive(self) -> bool: ...
    def ready(self) -> bool: ...
    def log_tail(self, lines: int = 20) -> str: ...
    def stop(self) -> None: ...


Launch = Callable[[str, ServerSpec, Path], Server]  # (served model, its spec, its log) -> a started server


def local(model: str, spec: ServerSpec, log_path: Path) -> Server:
    """A replica as a child process of this one."""
    return VllmServer(spec, log_path)


@dataclass(eq=False)
class Replica:
    server: Server
    adapters: set[str] = field(default_factory=set)  # adapter names loaded on it
    flights: set[str] = field(default_factory=set)  # request ids in flight on it
    ready: bool = False  # it has served (answered /health)
    broken: bool = False  # a sample's connection to it broke: no samples until it answers again (the watchdog)
    idle_since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Flight:
    """A sample in flight (or queued for a replica). `attempt` tells a retried sample's stale events apart."""

    request_id: str
    model: str
    prompt: list[int]
    params: SamplingParams
    adapter: str  # a version's, or the model's zero adapter for its base (vllm/__init__.base_adapter)
    stream: bool
    replica: Replica | None = None
    task: object | None = None  # concurrent.futures.Future of its stream's coroutine
    attempt: int = 0


@dataclass(eq=False)
class Model:
    spec: ServerSpec
    eos_token_ids: tuple[int, ...]
    replicas: list[Replica] = field(default_factory=list)
    waiting: deque[Flight] = field(default_factory=deque)
    started: int = 0  # replicas started so far (names their logs)


class ReplicaPool:
    """The vLLM replicas of every served model (thread-safe: the sampling lane steps, the training lane
    publishes)."""

    def __init__(self, models: dict[str, tuple[ServerSpec, tuple[int, ...]]], settings: SamplerReplicas,
                 launch: Launch | None = None, log_dir: Path | None = None):
        self.settings = settings
        self.launch = launch or local
        self.models = {name: Model(spec, eos) for name, (spec, eos) in models.items()}
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="whitney-vllm-"))
        self._lock = threading.RLock()
        self._flights: dict[str, Flight] = {}
        self._adapters: dict[str, str] = {}  # adapter name -> its PEFT directory
        self._out: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, attempt, outcome) from the loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="whitney-vllm", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._on_loop(self._make_client())
        self.completed = 0  # samples vLLM answered in full
        self._closed = threading.Event()
        try:
            for name, model in self.models.items():
                for _ in range(settings.minimum):
                    self._start(name, model)
            for model in self.models.values():
                for replica in model.replicas:
                    wait_ready(replica.server, START_TIMEOUT)
                    replica.ready = True
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="whitney-vllm-watch", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Every READY_POLL seconds, whether or not samples are in flight: starting replicas asked whether they
        serve (outside the lock), dead ones replaced, idle ones stopped."""
        while not self._closed.wait(READY_POLL):
            with self._lock:
                replicas = [(name, r) for name, m in self.models.items() for r in m.replicas]
            now = time.monotonic()  # each probe may be a call to a Ray actor: never under the lock
            serving = [r for _, r in replicas if (not r.ready or r.broken) and r.server.ready()]
            gone = [(name, r) for name, r in replicas
                    if not r.server.alive() or (not r.ready and now - r.server.started_at > START_TIMEOUT)]
            with self._lock:
                for replica in serving:
                    replica.ready, replica.broken = True, False
                for name, replica in gone:
                    self._replace(name, replica)
                self._maintain()

    def _replace(self, name: str, replica: Replica) -> None:
        """A replica that died, or never came up: stopped and forgotten; its samples run again (seeded) or fail;
        if it was the model's only one starting, the samples waiting for it fail. `_maintain` starts another as
        the load asks."""
        model = self.models[name]
        if replica not in model.replicas:
            return  # stopped meanwhile (idle)
        model.replicas.remove(replica)
        replica.server.stop()
        for request_id in list(replica.flights):
            flight = self._flights[request_id]
            failure = self._lost(flight, f"exit code {replica.server.returncode}")
            if failure is not None:
                self._fail(flight, failure)
        if not replica.ready and not any(not r.ready for r in model.replicas):
            why = Failure.of(Unavailable(f"the vLLM replica of {name} did not start; the end of its log "
                                         f"({replica.server.log_path}):\n{replica.server.log_tail(8)}",
                                         field="base_model"))
            while model.waiting:
                self._fail(model.waiting.popleft(), why)

    # ---- the event loop's side ---------------------------------------------------------------

    @staticmethod
    async def _make_client() -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def _on_loop(self, coroutine, timeout: float | None = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _load(self, replica: Replica, name: str) -> None:
        """The adapter registered on the replica (once; vLLM reloads it from its directory after an eviction)."""
        if name in replica.adapters:
            return
        path = self._adapters.get(name)
        if path is None:
            raise NotFound(f"the adapter {name} was deleted with its run", field="version")
        response = await self._client.post(f"{replica.server.url}/v1/load_lora_adapter",
                                           json={"lora_name": name, "lora_path": path},
                                           headers=replica.server.headers)
        if response.status_code != 200 and "already been loaded" not in response.text:
            raise InvalidInput(f"vLLM refused the adapter {name}: {response.text[:500]}", field="version")
        replica.adapters.add(name)

    async def _unload(self, replica: Replica, name: str) -> None:
        replica.adapters.discard(name)
        await self._client.post(f"{replica.server.url}/v1/unload_lora_adapter", headers=replica.server.headers,
                                json={"lora_name": name})

    async def _sample(self, flight: Flight, replica: Replica, attempt: int) -> None:
        """Stream the sample from the replica; its progress (streaming samples) and its end go to the queue.
        Cancelling the task closes the connection, which aborts the request in vLLM."""
        answer = Answer.of(flight.params)
        try:
            await self._load(replica, flight.adapter)
            eos = self.models[flight.model].eos_token_ids
            body = completion_body(flight.prompt, flight.params, flight.adapter, eos)
            async with self._client.stream("POST", f"{replica.server.url}/v1/completions", json=body,
                                           headers=replica.server.headers) as response:
                if response.status_code >= 500:  # its engine failed (it exits and is replaced)
                    text = (await response.aread()).decode(errors="replace")
                    self._out.put((flight.request_id, attempt, _Lost(f"vLLM answered {response.status_code}: "
                                                                      f"{text[:300]}")))
                    return
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise _refusal(response.status_code, text)
                async for chunk in _chunks(response):
                    if "error" in chunk:  # mid-stream: its engine failed (5xx), or the request was refused
                        code = int(chunk["error"].get("code") or 500)
                        if code >= 500:
                            self._out.put((flight.request_id, attempt, _Lost(json.dumps(chunk["error"])[:300])))
                            return
                        raise _refusal(code, json.dumps(chunk["error"]))
                    answer.add(chunk)
                    if flight.stream:
                        progress = answer.progress()
                        if progress is not None:
                            self._out.put((flight.request_id, attempt, progress))
            self._out.put((flight.request_id, attempt, answer.result()))
        except asyncio.CancelledError:
            raise
        except httpx.TransportError as e:
            self._out.put((flight.request_id, attempt, _Lost(f"{type(e).__name__}: {e}")))
        except Exception as e:  # noqa: BLE001 - the sample's own failure, as data
            self._out.put((flight.request_id, attempt, Failure.of(e)))

    # ---- the calling threads' side -----------------------------------------------------------

    def publish(self, model: str, run_id: str, version: int, path: str) -> bool:
        """Version `version` of the run, written as a PEFT adapter at `path`: loaded by every ready replica of
        the model before this returns (a replica that starts later loads it on first use). False when vLLM
        refuses it: the version is then not served here (Whitney's sampler serves it)."""
        name = adapter_name(run_id, version)
        with self._lock:
            self._adapters[name] = path
            ready = [r for r in self.models[model].replicas if r.ready and not r.broken]
        for replica in ready:
            try:
                self._on_loop(self._load(replica, name))
            except (httpx.TransportError, TimeoutError):
                pass  # a replica that died is replaced, and its replacement loads it on first use
            except InvalidInput:
                with self._lock:
                    del self._adapters[name]
                return False
        return True

    def register(self, path: str) -> str:
        """An adapter directory (an ended run's version, a model's zero adapter): its name, loaded on first use."""
        name = "adapter-" + hashlib.sha256(path.encode()).hexdigest()[:16]
        with self._lock:
            self._adapters.setdefault(name, path)
        return name

    def has(self, run_id: str, version: int | None) -> bool:
        with self._lock:
            return version is not None and adapter_name(run_id, version) in self._adapters

    def forget(self, run_id: str) -> None:
        """A deleted run's versions: unloaded from every replica."""
        prefix = f"{run_id}.v"
        with self._lock:
            names = [n for n in self._adapters if n.startswith(prefix) and n[len(prefix):].isdigit()]
            for name in names:
                del self._adapters[name]
            holding = [(r, n) for m in self.models.values() for r in m.replicas if r.ready for n in names
                       if n in r.adapters]
        for replica, name in holding:
            try:
                self._on_loop(self._unload(replica, name))
            except (httpx.HTTPError, TimeoutError):
                pass

    def submit(self, request_id: str, model: str, prompt: list[int], params: SamplingParams, adapter: str,
               stream: bool) -> None:
        flight = Flight(request_id, model, flat(prompt), params, adapter, stream)
        with self._lock:
            self._flights[request_id] = flight
            self.models[model].waiting.append(flight)
            self._maintain()

    def cancel(self, request_id: str) -> None:
        """Stop a sample: out of its model's queue, or its stream closed (vLLM aborts it); never reported."""
        with self._lock:
            flight = self._flights.pop(request_id, None)
            if flight is None:
                return
            model = self.models[flight.model]
            if flight in model.waiting:
                model.waiting.remove(flight)
            self._leave(flight)
        if flight.task is not None:
            flight.task.cancel()

    def step(self, wait: float = STEP_WAIT) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        """The samples' progress and ends since the last step (waiting up to `wait` seconds for one when there
        is none). A sample whose replica died runs again (seeded) or ends `worker_lost` here; the watchdog
        (`_watch`) starts, replaces and stops replicas."""
        with self._lock:
            if not self._flights:
                return []
        events = []
        try:
            events.append(self._out.get(timeout=wait) if wait > 0 else self._out.get_nowait())
            while True:
                events.append(self._out.get_nowait())
        except queue.Empty:
            pass
        ended: list[tuple[str, SampleResult | Failure | SampleProgress]] = []
        with self._lock:
            for request_id, attempt, outcome in events:
                flight = self._flights.get(request_id)
                if flight is None or flight.attempt != attempt:
                    continue  # cancelled, or an earlier attempt of a retried sample
                if isinstance(outcome, _Lost):
                    outcome = self._lost(flight, outcome.reason)
                    if outcome is None:
                        self._maintain()  # queued again: to a replica that serves, if one does
                        continue
                if not isinstance(outcome, SampleProgress):
                    del self._flights[request_id]
                    self._leave(flight)
                    self.completed += isinstance(outcome, SampleResult)
                ended.append((request_id, outcome))
        return ended

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    def live(self, model: str) -> int:
        """The model's replicas that serve now."""
        with self._lock:
            return sum(r.ready for r in self.models[model].replicas)

    def pids(self, model: str) -> list[int]:
        with self._lock:
            return [r.server.pid for r in self.models[model].replicas]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            replicas = [r for m in self.models.values() for r in m.replicas]
            for m in self.models.values():
                m.replicas.clear()
        for replica in replicas:
            replica.server.stop()
        if self._loop.is_running():
            try:
                self._on_loop(self._client.aclose(), timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # ---- under the lock ---------------------------------------------------------------------

    def _start(self, name: str, model: Model) -> Replica:
        model.started += 1
        log = self.log_dir / f"{name.replace('/', '_')}-{model.started}.log"
        replica = Replica(self.launch(name, model.spec, log))
        model.replicas.append(replica)
        return replica

    def _leave(self, flight: Flight) -> None:
        if flight.replica is not None:
            flight.replica.flights.discard(flight.request_id)
            if not flight.replica.flights:
                flight.replica.idle_since = time.monotonic()
            flight.replica = None

    def _lost(self, flight: Flight, reason: str) -> Failure | None:
        """A sample whose replica died: queued again when its seed makes it idempotent and it has retries left,
        else its failure. The replica takes no more samples until the watchdog finds it serving again (or
        replaces it)."""
        replica = flight.replica
        if replica is not None:
            replica.broken = True
        self._leave(flight)
        flight.attempt += 1
        if flight.params.seed is not None and flight.attempt <= RETRIES:
            self.models[flight.model].waiting.appendleft(flight)
            return None
        pid = replica.server.pid if replica is not None else "?"
        return Failure.of(WorkerLost(f"the vLLM replica (pid {pid}) serving the sample died ({reason}); it restarts"))

    def _fail(self, flight: Flight, failure: Failure) -> None:
        """End a sample with `failure` at the next step (which reports and forgets it)."""
        self._out.put((flight.request_id, flight.attempt, failure))

    def _maintain(self) -> None:
        """Start and stop replicas as the load asks and dispatch queued samples (no probe of a server: the
        watchdog's, so a submit asks no replica anything)."""
        now = time.monotonic()
        for name, model in self.models.items():
            starting = any(not r.ready for r in model.replicas)
            ready = [r for r in model.replicas if r.ready and not r.broken]
            if len(model.replicas) < self.settings.maximum and not starting and (
                    len(model.replicas) < self.settings.minimum or (model.waiting and not ready)
                    or (ready and all(len(r.flights) >= SamplerReplicas.BUSY for r in ready))):
                self._start(name, model)
            while model.waiting and ready:
                flight = model.waiting.popleft()
                replica = min(ready, key=lambda r: len(r.flights))
                flight.replica = replica
                replica.flights.add(flight.request_id)
                flight.task = asyncio.run_coroutine_threadsafe(self._sample(flight, replica, flight.attempt),
                                                               self._loop)
            for replica in ready:
                if (len(model.replicas) > self.settings.minimum and not replica.flights
                        and now - replica.idle_since >= self.settings.idle_seconds):
                    model.replicas.remove(replica)
                    replica.server.stop()


@dataclass(frozen=True)
class _Lost:
    """The loop's word that a sample's connection broke (its replica may have died)."""

    reason: str


async def _chunks(response: httpx.Response):
    """The answer's chunks: each server-sent event's."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def adapter_name(run_id: str, version: int) -> str:
    return f"{run_id}.v{version}"


def _refusal(status: int, text: str) -> Exception:
    """vLLM's refusal of a request (4xx) as the caller's error: a 400 naming what vLLM said."""
    try:
        message = json.loads(text).get("error", {}).get("message") or json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    return InvalidInput(f"vLLM refused the sample ({status}): {str(message)[:500]}", field="prompt")
