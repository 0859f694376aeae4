"""A highly available service (service/cluster): the lease and its fence on PostgreSQL, then real `whitney serve --ha`
processes on one throwaway PostgreSQL database, clients training through each of them, the leader killed with
SIGKILL mid-forward_backward, and a leader stalled with SIGSTOP past its lease, then resumed.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.ha import LEASE, big_batch, settle, until
from tests.service.test_flow import ADAM, LORA, expect, fb_body
from tests.tinker.helpers import arrays, tinker_data
from whitney.service.cluster import lease
from whitney.service.store.database import Store

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


def test_a_leader_stalled_inside_a_transaction_does_not_keep_the_lease(postgres):
    """Stopped between a write and its commit, a leader holds the lease's row FOR SHARE (its fence check): PostgreSQL
    ends its session after the lease's length, so another process takes the lease, and the stalled one cannot
    commit."""
    from sqlalchemy.exc import DBAPIError

    url = postgres.new_database()
    Store(url)
    stalled = create_engine(url)
    other = create_engine(url, connect_args={"options": "-c lock_timeout=5000"})  # a failure here fails, not hangs
    lease.end_stalled_transactions(stalled, 1.0)
    assert lease.acquire(stalled, "a", 0.5) == 1
    conn = stalled.connect()
    conn.execute(text("SELECT token FROM leases WHERE name = 'scheduler' FOR SHARE"))  # then it stalls
    time.sleep(0.6)  # its lease expires meanwhile
    started = time.monotonic()
    assert lease.acquire(other, "b", 5.0) == 2  # it waited for the stalled session to be ended, not forever
    assert time.monotonic() - started < 5
    with pytest.raises(DBAPIError):
        conn.execute(text("UPDATE leases SET holder = 'a'"))
    conn.close()


def test_a_leader_call_no_leader_takes_is_withdrawn_and_one_taken_is_answered(postgres, monkeypatch):
    from whitney.errors import Unavailable
    from whitney.service.cluster import calls

    store = Store(postgres.new_database())
    monkeypatch.setattr(calls, "WAIT_SECONDS", 0.3)
    caller = calls.CallerSide(store)
    with pytest.raises(Unavailable, match="no scheduling leader"):
        caller.call("finish_run", run_id="r").result(timeout=10)
    leader = calls.LeaderSide(store, {"finish_run": lambda run_id: f"finished {run_id}"})
    leader.take()  # the withdrawn call is not made
    answered = caller.call("finish_run", run_id="r2")
    leader.take()
    caller.recheck()  # as after a (re)connection of the listener, which otherwise delivers its notification
    assert answered.result(timeout=10) == "finished r2"
    with store.engine.connect() as conn:
        assert sorted(conn.execute(text("SELECT status FROM leader_calls")).scalars()) == ["done", "failed"]


def test_a_stored_job_reads_back_as_it_was_and_nothing_else_is_built():
    import os
    import pickle

    from whitney.protocol.backend import Weights
    from whitney.protocol.sampling import SamplingParams
    from whitney.protocol.training import AdamParams, Datum, ImageInput, TensorInput
    from whitney.service.cluster.payloads import SampleJob, ScoreJob, decode, encode, package_read
    from whitney.service.scheduling.jobs import ForwardJob, LoadJob, OptimJob, SaveJob

    jobs = [ForwardJob([Datum([[1, 2], ImageInput(b"\x89PNG", "png", 4), [3]],
                              {"target_tokens": TensorInput("int64", [3], [2, 3, 4])})], "ppo", {"clip": 0.2}, [7]),
            OptimJob(AdamParams(learning_rate=3e-4)), SaveJob("x", include_optimizer=False), LoadJob("/p", "pkg-1"),
            SampleJob([1, 2], SamplingParams(max_tokens=3, stop=((1, 2),)), Weights(checkpoint_path="/c")),
            ScoreJob([[1, 2, 3]], Weights(base_model="m"))]
    assert [decode(encode(job)) for job in jobs] == jobs
    assert [package_read(job) for job in jobs] == [None, None, None, "/p", "/c", None]

    class Boom:
        def __reduce__(self):
            return os.system, ("true",)

    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        decode(pickle.dumps(Boom()))


def test_the_ha_flags_are_refused_where_they_cannot_work():
    from whitney.cli import backend_config, build_parser
    from whitney.errors import InvalidInput

    def config(*flags: str) -> dict:
        return backend_config(build_parser().parse_args(["serve", *flags]))

    pg = "postgresql+psycopg://u@h/db"
    assert config("--ha", "--db-url", pg)["ha_lease_seconds"] == 5.0
    assert config("--ha", "--db-url", pg, "--lease-seconds", "2")["ha_lease_seconds"] == 2.0
    assert config()["ha_lease_seconds"] is None
    for flags, words in ((("--ha",), "PostgreSQL --db-url"), (("--ha", "--db-url", "sqlite:///x.db"), "PostgreSQL"),
                         (("--lease-seconds", "3"), "needs --ha"),
                         (("--ha", "--db-url", pg, "--lease-seconds", "0.1"), "from 0.5"),
                         (("--ha", "--db-url", pg, "--samplers", "1", "--sampler-engine", "vllm"), "vllm")):
        with pytest.raises(InvalidInput, match=words):
            config(*flags)


# ---- real processes -----------------------------------------------------------------------------------------------


def test_a_killed_leader_is_replaced_and_nothing_acknowledged_is_lost(ha_members):
    a, b = ha_members(2)
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


def test_the_tinker_sdk_trains_through_a_follower_and_a_stalled_leader_writes_nothing(ha_members, tiny_llama):
    import openai
    import tinker
    from tinker import types

    a, b = ha_members(2)
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
    client.close("success").result()  # its session ends (else its heartbeats outlive the test)
    # OpenAI streaming through either process: the leader streams as it samples, a follower's stream sends the
    # completion once it is done; the same text either way, and the same as without streaming.
    name, texts = Path(tiny_llama).name, []
    for member in (follower, leader, follower):
        openai_client = openai.OpenAI(base_url=f"{member.url}/v1", api_key="x", max_retries=0, timeout=120)
        request = dict(model=name, prompt="Once upon", seed=4, max_tokens=12, temperature=1.0)
        texts.append("".join(c.choices[0].text for c in openai_client.completions.create(**request, stream=True)))
        texts.append(openai_client.completions.create(**request).choices[0].text)
    assert texts[0] and texts == [texts[0]] * 6, texts

    session = expect(follower.http.post("/v1/sessions", json={}), 201)
    run = expect(follower.http.post(f"/v1/sessions/{session['id']}/runs", json={"lora": LORA}), 201)["id"]
    long = expect(follower.http.post(f"/v1/runs/{run}/forward_backward", json=fb_body(0, big_batch())), 202)
    until(lambda: follower.http.get(f"/v1/operations/{long['id']}").json()["status"] == "running", 60, "it runs")
    leader.proc.send_signal(signal.SIGSTOP)  # stalled mid-forward_backward, its lease running out
    until(lambda: follower.role() == "leader", LEASE + 5, "the follower to lead")
    lost = settle(follower.http, long["id"])
    assert lost["status"] == "failed" and lost["error"]["code"] == "worker_lost"
    engine = create_engine(ha_members.db_url)
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
