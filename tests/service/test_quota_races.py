"""Quotas under concurrent requests (issue 31, item 7): a quota's count and the row it admits are one atomic step.

Through a real server, many requests at once (threads) never pass a limit together: sessions, runs (their number
and their adapters' memory), queued operations. And for several API processes on one database: two Stores (two
engines, two connection pools, as two processes have) racing on one SQLite file and on one PostgreSQL database;
what a key holds never exceeds its limit.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.service.test_keys import KEY, LORA, fb, new_run, quota_error, session
from whitney.service.store.database import Store
from whitney.service.store.key_limits import KeyLimits
from whitney.service.store.keys import KeyRing
from whitney.service.store.lifecycle import OperationKind
from whitney.service.store.quotas import QuotaExceeded, Quotas

THREADS = 24


def at_once(n: int, call) -> list:
    """`call(i)` for i in range(n) on n threads released together; each one's result (or exception)."""
    start = threading.Barrier(n)

    def one(i: int):
        start.wait()
        try:
            return call(i)
        except Exception as e:  # noqa: BLE001 (the caller looks at what came back)
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def each_client(server, key: str, n: int, call) -> list:
    """`call(i, client)` for i in range(n), each on a client of its own with `key`, released together."""
    clients = [server.http(key) for _ in range(n)]
    try:
        return at_once(n, lambda i: call(i, clients[i]))
    finally:
        for c in clients:
            c.close()


def posts(server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    return each_client(server, KEY, len(bodies), lambda i, client: client.post(path, json=bodies[i]))


# ---- through a real server ---------------------------------------------------------------------------------

def test_concurrent_session_creations_never_pass_the_limit(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_sessions=3))
    answers = posts(server, "/v1/sessions", [{}] * THREADS)
    assert sorted(r.status_code for r in answers) == [201] * 3 + [429] * (THREADS - 3), \
        [r.status_code for r in answers]
    for r in answers:
        if r.status_code == 429:
            quota_error(r, "max_sessions", 3)
    with server.http(KEY) as http:
        assert len(http.get("/v1/sessions").json()) == 3


def test_concurrent_run_creations_never_pass_the_run_limit(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_runs=3))
    with server.http(KEY) as http:
        sid = session(http)
    answers = posts(server, f"/v1/sessions/{sid}/runs", [{"lora": LORA}] * THREADS)
    assert sorted(r.status_code for r in answers) == [201] * 3 + [429] * (THREADS - 3), \
        [(r.status_code, r.text[:80]) for r in answers]
    with server.http(KEY) as http:
        assert len(http.get(f"/v1/sessions/{sid}/runs").json()) == 3
        assert http.get("/v1/quota").json()["usage"]["runs"] == 3
    assert len(server.engine.runs) == 3, "a refused run allocated an adapter"


def test_concurrent_run_creations_never_pass_the_adapter_memory_limit(make_server, capsys):
    from tests.service.test_keys import create_key

    server = make_server(require_keys=True)
    probe = create_key(capsys, server)
    with server.http(probe) as http:
        new_run(http, session(http))
        cost = http.get("/v1/quota").json()["usage"]["adapter_bytes"]  # one rank-4 run
    key = create_key(capsys, server, "--max-adapter-bytes", str(int(2.5 * cost)))
    with server.http(key) as http:
        sid = session(http)
    answers = each_client(server, key, THREADS, lambda i, client: client.post(f"/v1/sessions/{sid}/runs",
                                                                              json={"lora": LORA}))
    assert sorted(r.status_code for r in answers) == [201] * 2 + [429] * (THREADS - 2), \
        [(r.status_code, r.text[:80]) for r in answers]
    with server.http(key) as http:
        assert http.get("/v1/quota").json()["usage"]["adapter_bytes"] == 2 * cost


def test_concurrent_operations_never_pass_the_queue_limit(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_queued_operations=4))
    n = THREADS // 2
    with server.http(KEY) as http:
        sid = session(http)
        runs = [new_run(http, sid) for _ in range(n)]
    # seq_id 1 of each run waits for its seq_id 0, never sent: each admitted one stays queued. (One run's seq_ids
    # would not do: one that a later, queued seq_id waits for is admitted over the limit, or the run could never move.)
    answers = each_client(server, KEY, n, lambda i, client: fb(client, runs[i], 1))
    assert sorted(r.status_code for r in answers) == [202] * 4 + [429] * (n - 4), \
        [(r.status_code, r.text[:80]) for r in answers]
    with server.http(KEY) as http:
        assert http.get("/v1/quota").json()["usage"]["queued_operations"] == 4


def test_a_run_the_engine_refuses_holds_no_place(make_server, monkeypatch):
    """A run is recorded (its quota place held) before the engine makes its adapter; a refusal removes it again."""
    from whitney.errors import InvalidInput

    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_runs=1))
    backend = server.app.state.whitney.scheduler.backend
    real = backend.create_run

    def refuse(*args, **kwargs):
        raise InvalidInput("this engine refuses the run", field="lora")

    with server.http(KEY) as http:
        sid = session(http)
        monkeypatch.setattr(backend, "create_run", refuse)
        r = http.post(f"/v1/sessions/{sid}/runs", json={"lora": LORA})
        assert r.status_code == 400 and r.json()["field"] == "lora", r.text
        assert http.get(f"/v1/sessions/{sid}/runs").json() == []
        assert http.get("/v1/quota").json()["usage"]["runs"] == 0
        monkeypatch.setattr(backend, "create_run", real)
        new_run(http, sid)  # the one place is free
        quota_error(http.post(f"/v1/sessions/{sid}/runs", json={"lora": LORA}), "max_runs", 1)


# ---- two API processes on one database ----------------------------------------------------------------------

class Sized:
    """A backend as the quotas see it: every run's adapter takes 100 bytes."""

    def adapter_bytes(self, base_model, lora) -> int:
        return 100


def two_processes(db_url: str, **limits) -> list[tuple[Store, Quotas]]:
    """Two Stores on one database (two engines, two pools: two API processes), each with its own quotas."""
    out = []
    for _ in range(2):
        store = Store(db_url)
        out.append((store, Quotas(store, KeyRing(store, []), KeyLimits(**limits), Sized())))
    return out


def widened(check):
    """`check(..., conn)` then a pause before the insert: what another request may do in between, had the
    check and the insert not been one step."""
    def admit(*args):
        check(*args)
        time.sleep(0.005)
    return admit


def refused_or_made(results: list) -> int:
    errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, QuotaExceeded)]
    assert not errors, errors[:3]
    return sum(not isinstance(r, Exception) for r in results)


def test_two_processes_never_pass_the_session_limit(db_url):
    both = two_processes(db_url, max_sessions=3)

    def create(i: int):
        store, quotas = both[i % 2]
        return store.create_session("me", admit=widened(lambda conn: quotas.check_session("me", conn)))

    assert refused_or_made(at_once(THREADS, create)) == 3
    assert both[0][0].usage("me")["sessions"] == both[1][0].held_sessions("me") == 3


def test_two_processes_never_pass_the_run_and_memory_limits(db_url):
    for limits, most in (({"max_runs": 3, "max_adapter_bytes": 0}, 3), ({"max_runs": 0, "max_adapter_bytes": 250}, 2)):
        both = two_processes(db_url, max_sessions=0, **limits)
        owner = f"me-{most}"
        sid = both[0][0].create_session(owner).id

        def create(i: int):
            store, quotas = both[i % 2]
            return store.create_run(sid, owner, "tiny", {"rank": 4}, None, False, None,
                                    admit=widened(lambda conn: quotas.check_run(owner, "tiny", {"rank": 4}, conn)))

        assert refused_or_made(at_once(THREADS, create)) == most
        assert len(both[1][0].held_runs(owner)) == most


def test_two_processes_never_pass_the_queue_limit_for_samples(db_url):
    both = two_processes(db_url, max_queued_operations=5)

    def submit(i: int):
        store, quotas = both[i % 2]
        return store.submit_operation("me", None, None, OperationKind.SAMPLE, "", admit=widened(
            lambda conn: quotas.admit_operation("me", None, None, 0, conn)))

    assert refused_or_made(at_once(THREADS, submit)) == 5
    assert both[0][0].pending_operations("me") == 5
