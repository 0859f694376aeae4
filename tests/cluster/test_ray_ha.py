"""A highly available service on a Ray cluster (service/cluster, backends/ray): two `whitney serve --ha --backend ray`
processes share the trainer (a named, detached Ray actor that outlives them). The leader is killed while the
trainer runs one run's long forward_backward with another run's operations queued behind it: the new leader adopts
the trainer, the lost operation's run is interrupted, and the other run goes on with its state where it was, its
queued operations run in seq_id order, none twice (its optimizer's step count says so).
"""

from __future__ import annotations

import pytest
import ray

from tests.service.test_flow import ADAM, LORA, expect, fb_body
from tests.ha import LEASE, big_batch, settle, until


@pytest.fixture
def shared_workers(ray_cluster):
    """The cluster; afterwards, the service's named workers it left (they outlive its members) stopped."""
    yield ray_cluster
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"].startswith("whitney-"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


def test_a_new_leader_adopts_the_ray_trainer_and_runs_what_was_queued(shared_workers, ha_members):
    ray_cluster = shared_workers
    a, b = ha_members(2, "--backend", "ray", "--ray-address", ray_cluster.address, "--samplers", "0")
    leader, follower = (a, b) if a.role() == "leader" else (b, a)
    http = follower.http
    session = expect(http.post("/v1/sessions", json={}), 201)["id"]
    kept, lost = (expect(http.post(f"/v1/sessions/{session}/runs", json={"lora": LORA}), 201)["id"] for _ in range(2))
    first = [expect(http.post(f"/v1/runs/{kept}/forward_backward", json=fb_body(0)), 202)["id"],
             expect(http.post(f"/v1/runs/{kept}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)["id"]]
    assert settle(http, first[1])["result"]["metrics"]["step"] == 1

    long = expect(http.post(f"/v1/runs/{lost}/forward_backward", json=fb_body(0, big_batch())), 202)["id"]
    until(lambda: http.get(f"/v1/operations/{long}").json()["status"] == "running", 60, "it runs")
    queued = [expect(http.post(f"/v1/runs/{kept}/forward_backward", json=fb_body(2)), 202)["id"],
              expect(http.post(f"/v1/runs/{kept}/optim_step", json={"seq_id": 3, "adam_params": ADAM}), 202)["id"]]
    assert all(http.get(f"/v1/operations/{op}").json()["status"] == "queued" for op in queued)
    leader.proc.kill()
    until(lambda: follower.role() == "leader", LEASE + 5, "the follower to lead")

    assert settle(http, long)["error"]["code"] == "worker_lost"
    assert expect(http.get(f"/v1/runs/{lost}"), 200)["status"] == "interrupted"
    done = [settle(http, op) for op in queued]
    assert [op["status"] for op in done] == ["succeeded", "succeeded"], done
    assert done[1]["result"]["metrics"]["step"] == 2  # the trainer kept the run: its step 1, then this one
    assert expect(http.get(f"/v1/runs/{kept}"), 200)["status"] == "active"
    ops = expect(http.get(f"/v1/runs/{kept}/operations"), 200)
    assert [op["seq_id"] for op in ops] == [0, 1, 2, 3] and [op["started_at"] for op in ops] == sorted(
        op["started_at"] for op in ops)
    op = expect(http.post(f"/v1/runs/{kept}/optim_step", json={"seq_id": 4, "adam_params": ADAM}), 202)["id"]
    assert settle(http, op)["result"]["metrics"]["step"] == 3
