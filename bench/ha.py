"""A highly available service (issue 34; `whitney serve --ha`, service/cluster): failover time and operations lost
when the leader is killed, and the throughput of two API processes against one.

  failover    two members (in-process engines, the tiny Llama, lease 2 s) on a throwaway PostgreSQL; a client
              keeps base-model samples (4 tokens) going through the follower. The leader is killed (SIGKILL); the
              failover time is from the kill to the completion of the waiting client's next operation, submitted
              right after the kill. The killed member is started again (a follower) and the next kill takes the new
              leader; p50 over the kills. Operations lost: acknowledged (202) and never ended (target 0); the ones
              the dead leader was running end once, failed with worker_lost, and are counted apart.
  throughput  32 clients, each its own run, looping forward_backward (2 datums) + optim_step with long-polls, for
              a fixed time: through one member, then spread over two (the scheduler is one either way). Target:
              two processes at least 0.9x of one.

The tiny model keeps the engine's share small, so what is measured is the control plane's.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

LEASE = 2.0


def _sample(http: httpx.Client, seed: int) -> str:
    response = http.post("/v1/samples", json={"prompt": [1, 523, 1077], "max_tokens": 4, "seed": seed})
    response.raise_for_status()
    return response.json()["id"]


def _final(http: httpx.Client, op_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            op = http.get(f"/v1/operations/{op_id}", params={"wait": 10}).json()
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if op["status"] not in ("queued", "running"):
            return op
    return {"status": "never ended", "id": op_id}


def failover(model: str, db_url: str, root: Path, kills: int) -> dict:
    from tests.ha import Member, until

    members = [Member(model, db_url, root / "data", root / f"f{i}.log") for i in range(2)]
    acked: list[str] = []
    stop = threading.Event()
    times, failed = [], 0
    try:
        until(lambda: sum(m.role() == "leader" for m in members) == 1, 30, "a leader")
        for kill in range(kills):
            leader = next(m for m in members if m.role() == "leader")
            follower = next(m for m in members if m is not leader)

            def keep_sampling(http=follower.http):  # the background client: acknowledged operations counted
                seed = 0
                while not stop.is_set():
                    try:
                        acked.append(_sample(http, seed))
                    except httpx.HTTPError:
                        pass
                    seed += 1
                    time.sleep(0.05)

            stop.clear()
            background = threading.Thread(target=keep_sampling, daemon=True)
            background.start()
            assert _final(follower.http, _sample(follower.http, 10**6))["status"] == "succeeded"
            leader.proc.kill()
            killed = time.monotonic()
            waiting = _sample(follower.http, 10**6 + kill)  # the waiting client's next operation
            ended = _final(follower.http, waiting)
            times.append(time.monotonic() - killed)
            print(f"  failover {kill}: {times[-1]:.2f} s ({ended['status']})", flush=True)
            stop.set()
            background.join()
            leader.stop()
            members[members.index(leader)] = Member(model, db_url, root / "data", root / f"f{kill}-again.log")
            until(lambda: sum(m.role() == "leader" for m in members) == 1, 30, "a leader")
        outcomes = [_final(members[0].http, op_id)["status"] for op_id in acked]
        failed = outcomes.count("failed")
        lost = sum(s not in ("succeeded", "failed", "cancelled") for s in outcomes)
    finally:
        for m in members:
            m.stop()
    return {"lease_seconds": LEASE, "kills": kills, "failover_s": times, "p50_s": statistics.median(times),
            "max_s": max(times), "acknowledged": len(acked), "lost": lost, "failed_worker_lost": failed}


def throughput(model: str, db_url: str, root: Path, processes: int, clients: int, seconds: float) -> dict:
    from tests.ha import Member, until

    members = [Member(model, db_url, root / "data", root / f"t{processes}-{i}.log") for i in range(processes)]
    done, errors = [0] * clients, [0] * clients
    try:
        until(lambda: sum(m.role() == "leader" for m in members) == 1, 30, "a leader")
        start = threading.Barrier(clients + 1)
        deadline = [0.0]

        def client(i: int) -> None:
            http = httpx.Client(base_url=members[i % processes].url, timeout=120)
            session = http.post("/v1/sessions", json={}).json()["id"]
            run = http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 8}}).json()["id"]
            data = [{"input": {"token_ids": [1, 523, 1077, 2889 + i]}, "loss_inputs": {"target_tokens": {
                "dtype": "int64", "shape": [4], "values": [523, 1077, 2889 + i, 2]}}}] * 2
            start.wait()
            seq = 0
            while time.monotonic() < deadline[0]:
                for path, body in (("forward_backward", {"seq_id": seq, "data": data,
                                                         "loss_function": "cross_entropy"}),
                                   ("optim_step", {"seq_id": seq + 1, "adam_params": {"learning_rate": 1e-3}})):
                    op = http.post(f"/v1/runs/{run}/{path}", json=body).json()
                    if _final(http, op["id"])["status"] == "succeeded" and time.monotonic() < deadline[0]:
                        done[i] += 1
                    else:
                        errors[i] += time.monotonic() < deadline[0]
                seq += 2
            http.close()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        deadline[0] = time.monotonic() + 1e9
        start.wait()
        deadline[0] = time.monotonic() + seconds
        for t in threads:
            t.join()
    finally:
        for m in members:
            m.stop()
    ops = sum(done)
    print(f"  throughput, {processes} API process(es), {clients} clients: {ops / seconds:.1f} ops/s", flush=True)
    return {"processes": processes, "clients": clients, "seconds": seconds, "operations": ops,
            "ops_per_s": ops / seconds, "errors": sum(errors)}


def run(quick: bool = False, dtype: str = "float32") -> dict:
    from tests.models import make_tiny_model
    from tests.postgres import PostgresServer

    kills, clients, seconds = (2, 8, 8.0) if quick else (7, 32, 40.0)
    with tempfile.TemporaryDirectory() as tmp, PostgresServer() as pg:
        root = Path(tmp)
        model = str(make_tiny_model(root / "tiny-llama", "llama"))
        fo = failover(model, pg.new_database(), root, kills)
        one = throughput(model, pg.new_database(), root, 1, clients, seconds)
        two = throughput(model, pg.new_database(), root, 2, clients, seconds)
    ratio = two["ops_per_s"] / one["ops_per_s"] if one["ops_per_s"] else None
    return {
        "benchmark": "ha",
        "dtype": "float32",
        "settings": {"lease_seconds": LEASE, "kills": kills, "clients": clients, "seconds": seconds,
                     "model": "tiny llama (2 layers, hidden 64)", "backend": "inprocess"},
        "failover": fo,
        "throughput": {"1": one, "2": two},
        "checks": [
            {"name": f"ha: operations lost over {kills} leader kills", "ratio": fo["lost"], "target": 0, "op": "<="},
            {"name": f"(info) ha: failover p50, s (leader killed -> the waiting client's next operation done; lease "
                     f"{LEASE:g} s)", "ratio": fo["p50_s"], "target": None, "op": None},
            {"name": f"ha: throughput of 2 API processes / 1 ({clients} clients, forward_backward + optim_step)",
             "ratio": ratio, "target": 0.9, "op": ">="},
        ],
    }
