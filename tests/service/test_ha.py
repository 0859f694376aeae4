"""A highly available service (service/cluster): the lease and its fence on PostgreSQL, then real `whitney serve --ha`
processes on one throwaway PostgreSQL database, clients training through each of them, the leader killed with
SIGKILL mid-forward_backward, and a leader stalled with SIGSTOP past its lease, then resumed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.service.test_flow import ADAM, LORA, expect, fb_body, sft_batch
from tests.tinker.helpers import arrays, tinker_data
from whitney.service.cluster import lease
from whitney.service.store.database import Store

LEASE = 2.0  # seconds: a dead leader is replaced within about this (plus a campaign interval)


# ---- the lease and the fence ------------------------------------------------------------------------------------


def test_lease_passes_on_only_after_it_expires_and_a_former_holder_is_fenced(postgres):
    url = postgres.new_database()
    Store(url)  # its tables
    engine = create_engine(url)
    first = lease.acquire(engine, "a", 0.6, "http://a")
    assert first == 1 and lease.acquire(engine, "b", 0.6) is None  # held
    assert lease.renew(engine, "a", first, 0.6)
    assert lease.holder_of(engine).holder == "a" and lease.holder_of(engine).url == "http://a"
    time.sleep(0.7)  # a stalled holder: its lease expires
    second = lease.acquire(engine, "b", 5.0, "http://b")
    assert second == 2 and not lease.renew(engine, "a", first, 5.0)  # taken: a may not renew it
    lease.release(engine, "b", second)
    assert lease.holder_of(engine) is None and lease.acquire(engine, "a", 5.0) == 3  # free at once

    stale, current = Store(url), Store(url)  # a's store fenced with its old token, and the leader's
    fenced = []
    lease.install_fence(stale.engine, lease.Fence("a", first), lambda: fenced.append(True))
    lease.install_fence(current.engine, lease.Fence("a", 3), lambda: fenced.append(False))
    with pytest.raises(lease.Fenced):
        stale.create_session("owner")
    assert fenced == [True] and stale.list_sessions("owner") == []  # nothing written, and it stepped down
    session = current.create_session("owner")  # the holder writes (every transaction checked, and passed)
    assert [s.id for s in stale.list_sessions("owner")] == [session.id]  # reads are never fenced


# ---- real processes -----------------------------------------------------------------------------------------------


class Member:
    """A `whitney serve --ha` process and an HTTP client of it."""

    def __init__(self, model: str, db_url: str, data_dir: Path, log: Path):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "whitney.cli", "serve", "--model", model, "--port", "0", "--data-dir",
             str(data_dir), "--db-url", db_url, "--ha", "--lease-seconds", str(LEASE), "--threads", "1"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while (found := re.search(r"Whitney is serving .* at (http://127\.0\.0\.1:\d+)", log.read_text())) is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        self.url = found.group(1)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def role(self) -> str | None:
        try:
            return self.http.get("/healthz", timeout=2).json()["role"]
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.http.close()


@pytest.fixture
def members(postgres, tiny_llama, tmp_path):
    """Start `whitney serve --ha` processes on one new database and one data directory (the first one to ask leads)."""
    db_url, started = postgres.new_database(), []

    def start(n: int) -> list[Member]:
        for _ in range(n):
            started.append(Member(tiny_llama, db_url, tmp_path / "data", tmp_path / f"member{len(started)}.log"))
        until(lambda: sum(m.role() == "leader" for m in started) == 1, 30, "one leader")
        return started

    start.db_url = db_url
    yield start
    for m in started:
        m.stop()


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def settle(http: httpx.Client, op_id: str) -> dict:
    """An operation's final state, long-polled through `http`."""
    deadline = time.monotonic() + 120
    while (op := expect(http.get(f"/v1/operations/{op_id}", params={"wait": 10}), 200))["status"] in ("queued",
                                                                                                        "running"):
        assert time.monotonic() < deadline, op
    return op


def big_batch() -> list[dict]:
    """Datums of a forward_backward that runs for seconds on the tiny model with one thread (several passes)."""
    return sft_batch([([1] + [(7 * i + j) % 40000 + 3 for j in range(200)], [5, 6, 2]) for i in range(48)])


def test_a_killed_leader_is_replaced_and_nothing_acknowledged_is_lost(members):
    a, b = members(2)
    leader, follower = (a, b) if a.role() == "leader" else (b, a)
    # A client training through both processes, alternately: every request answered by whichever it reaches.
    session = expect(follower.http.post("/v1/sessions", json={}), 201)
    run = expect(follower.http.post(f"/v1/sessions/{session['id']}/runs", json={"lora": LORA}), 201)["id"]
    acknowledged, seq = [], 0
    for step in range(3):
        for http, body, kind in ((leader.http, fb_body(seq), "forward_backward"),
                                 (follower.http, {"seq_id": seq + 1, "adam_params": ADAM}, "optim_step")):
            acknowledged.append(expect(http.post(f"/v1/runs/{run}/{kind}", json=body), 202)["id"])
        seq += 2
    saved = expect(follower.http.post(f"/v1/runs/{run}/save_state", json={"seq_id": seq, "name": "ckpt"}), 202)
    acknowledged.append(saved["id"])
    done = [settle(follower.http, op_id) for op_id in acknowledged]
    assert [op["status"] for op in done] == ["succeeded"] * 7
    assert [op["result"]["metrics"]["step"] for op in done if op["kind"] == "optim_step"] == [1, 2, 3]
    checkpoint = done[-1]["result"]["package"]["id"]

    # Mid-forward_backward, with base-model samples queued behind it, the leader is killed.
    long = expect(follower.http.post(f"/v1/runs/{run}/forward_backward", json=fb_body(seq + 1, big_batch())), 202)
    until(lambda: follower.http.get(f"/v1/operations/{long['id']}").json()["status"] == "running", 60, "it runs")
    samples = [expect(follower.http.post("/v1/samples", json={"prompt": [1, 523, 1077], "max_tokens": 4, "seed": i}),
                      202)["id"] for i in range(3)]
    leader.proc.kill()
    killed = time.monotonic()
    until(lambda: follower.role() == "leader", LEASE + 5, "the follower to lead")
    took = time.monotonic() - killed
    assert took <= LEASE + 3, took

    # The running operation ended once, as lost; its run is interrupted; the samples queued behind it ran.
    lost = settle(follower.http, long["id"])
    assert lost["status"] == "failed" and lost["error"]["code"] == "worker_lost", lost
    assert expect(follower.http.get(f"/v1/runs/{run}"), 200)["status"] == "interrupted"
    assert all(settle(follower.http, op_id)["status"] == "succeeded" for op_id in samples)
    # Every acknowledged operation is intact, in seq_id order, each run once.
    ops = expect(follower.http.get(f"/v1/runs/{run}/operations"), 200)
    assert [op["seq_id"] for op in ops] == list(range(len(ops)))
    assert [op["status"] for op in ops[:7]] == ["succeeded"] * 7 and [op["result"] for op in ops[:7]] == [
        op["result"] for op in done]
    starts = [op["started_at"] for op in ops[:7]]
    assert starts == sorted(starts)
    # The checkpoint resumes on the new leader where the acknowledged steps left it: step 4 is the next one.
    resumed = expect(follower.http.post(f"/v1/sessions/{session['id']}/runs", json={
        "resume_from": {"checkpoint_id": checkpoint, "with_optimizer": True}}), 201)["id"]
    op = expect(follower.http.post(f"/v1/runs/{resumed}/forward_backward", json=fb_body(0)), 202)
    assert settle(follower.http, op["id"])["status"] == "succeeded"
    op = expect(follower.http.post(f"/v1/runs/{resumed}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)
    assert settle(follower.http, op["id"])["result"]["metrics"]["step"] == 4


def test_the_tinker_sdk_trains_through_a_follower_and_a_stalled_leader_writes_nothing(members, tiny_llama):
    import tinker
    from tinker import types

    a, b = members(2)
    leader, follower = (a, b) if a.role() == "leader" else (b, a)
    # The SDK, unmodified, pointed at the follower: run creation is a leader call, futures are long-polled there.
    client = tinker.ServiceClient(base_url=follower.url, api_key="tml-ha")
    trainer = client.create_lora_training_client(base_model=tiny_llama, rank=4, seed=1).result()
    first = trainer.forward_backward(tinker_data(arrays("cross_entropy")), "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    again = trainer.forward_backward(tinker_data(arrays("cross_entropy")), "cross_entropy").result()
    assert again.metrics["loss:sum"] < first.metrics["loss:sum"]
    sampler = trainer.save_weights_and_get_sampling_client("ha").result()
    sample = sampler.sample(types.ModelInput.from_ints([1, 17, 250]), 1, types.SamplingParams(max_tokens=3, seed=0))
    assert len(sample.result().sequences[0].tokens) == 3

    session = expect(follower.http.post("/v1/sessions", json={}), 201)
    run = expect(follower.http.post(f"/v1/sessions/{session['id']}/runs", json={"lora": LORA}), 201)["id"]
    long = expect(follower.http.post(f"/v1/runs/{run}/forward_backward", json=fb_body(0, big_batch())), 202)
    until(lambda: follower.http.get(f"/v1/operations/{long['id']}").json()["status"] == "running", 60, "it runs")
    leader.proc.send_signal(signal.SIGSTOP)  # stalled mid-forward_backward, its lease running out
    until(lambda: follower.role() == "leader", LEASE + 5, "the follower to lead")
    lost = settle(follower.http, long["id"])
    assert lost["status"] == "failed" and lost["error"]["code"] == "worker_lost"
    engine = create_engine(members.db_url)
    with engine.connect() as conn:
        before = conn.execute(text("SELECT id, status, result, error, finished_at FROM operations ORDER BY id")).all()
    leader.proc.send_signal(signal.SIGCONT)  # it finishes its computation and would store it: fenced, it steps down
    assert leader.proc.wait(timeout=60) == 3
    with engine.connect() as conn:
        after = conn.execute(text("SELECT id, status, result, error, finished_at FROM operations ORDER BY id")).all()
        runs = conn.execute(text("SELECT status FROM runs WHERE id = :id"), {"id": run}).scalar_one()
    assert after == before and runs == "interrupted"
    assert "stepping down" in leader.log.read_text()
    assert follower.role() == "leader"  # and the new leader goes on
    op = expect(follower.http.post("/v1/samples", json={"prompt": [1, 523], "max_tokens": 2, "seed": 0}), 202)
    assert settle(follower.http, op["id"])["status"] == "succeeded"
