"""A trainer whose base is sharded over two ranks (FSDP2, gloo) behind the Ray backend: the same numbers as
the in-process engine, its sharded checkpoints resume on an unsharded worker, and a rank that dies takes its
group down and back up."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.cluster.test_ray_backend import (CONFIG, LORA, assert_results_equal, both, create_run_once_back, data,
                                            optim_step)
from whitney.backends.ray.proxy import Placement, RayBackend
from whitney.backends.in_process import InProcessBackend
from whitney.engine import AdamParams, ForwardRequest, LoraConfig, Weights
from whitney.protocol.backend import Failure, PackageKind


@pytest.fixture(scope="module")
def sharded(ray_cluster, tiny_qwen3):
    ray_backend = RayBackend(CONFIG, [Placement(tiny_qwen3, "qwen", resources={"node_a": 1}, shards=2, samplers=1)])
    local = InProcessBackend.start(CONFIG, [])
    local.load_model(tiny_qwen3, alias="qwen")
    yield ray_backend, local
    ray_backend.close()


def test_sharded_trainer_equals_in_process(sharded, tmp_path):
    ray_backend, local = sharded
    assert len(ray_backend.supervisor.pids("qwen")) == 3, "two ranks and a replica"
    both(sharded, "create_run", "a", "qwen", LORA)
    both(sharded, "create_run", "b", "qwen", LoraConfig(rank=8, seed=2, train_unembed=False))
    for step in range(3):
        requests = [ForwardRequest("a", data(step)), ForwardRequest("b", data(step + 10))]
        for r, l in zip(*both(sharded, "run_batch", requests, True), strict=True):
            assert_results_equal(r, l)
        for run_id in ("a", "b"):
            m_remote, m_local = (optim_step(b, run_id, AdamParams(learning_rate=1e-2)) for b in sharded)
            assert m_remote == pytest.approx(m_local, rel=1e-5)
    # A sampler version is an ordinary file the (unsharded) replica loads: same log-probs.
    versions = [b.save("a", PackageKind.SAMPLER, str(tmp_path / f"v{i}")) for i, b in enumerate(sharded)]
    assert versions == [1, 1]
    sequence = data(5)[0].token_ids
    remote, local_lp = both(sharded, "compute_logprobs", [sequence], Weights(run_id="a", version=1))
    torch.testing.assert_close(torch.tensor(remote[0][1:]), torch.tensor(local_lp[0][1:]), atol=1e-5, rtol=0)

    # save_state on two ranks is sharded; it resumes on an unsharded engine exactly.
    ray_backend.save("a", PackageKind.STATE, str(tmp_path / "sharded"), True)
    assert (tmp_path / "sharded" / "__1_0.distcp").exists()
    local.create_run("resumed", "qwen", LORA, str(tmp_path / "sharded"), True)
    (r,), (l,) = (b.run_batch([ForwardRequest(run, data(7))], False) for b, run in zip(sharded, ("a", "resumed")))
    assert_results_equal(r, l)
    m_remote, m_local = optim_step(ray_backend, "a", AdamParams()), optim_step(local, "resumed", AdamParams())
    assert m_remote == m_local  # no gradient: both step from the same moments


def test_a_dead_rank_takes_its_group_down_and_back(sharded):
    ray_backend, _ = sharded
    ray_backend.create_run("k", "qwen", LORA)
    rank1 = ray_backend.supervisor.pids("qwen")[1]
    os.kill(rank1, signal.SIGKILL)
    (failure,) = ray_backend.run_batch([ForwardRequest("k", data(0))], True)
    assert isinstance(failure, Failure) and failure.code == "worker_lost", failure
    assert "k" in ray_backend.take_lost_runs()
    create_run_once_back(ray_backend, "k2", "qwen")  # the ranks restart and form their group again
    assert rank1 not in ray_backend.supervisor.pids("qwen")
    (result,) = ray_backend.run_batch([ForwardRequest("k2", data(0))], True)
    assert not isinstance(result, Failure), result


def test_the_ranks_of_a_trainer_spread_over_nodes_when_one_cannot_hold_them(ray_cluster, tiny_qwen3):
    """Two more nodes, each with room for one rank (a `rank_slot`): the trainer's placement group puts its ranks on
    both, they meet at rank 0's node and train as one process does; a killed rank takes the group down and it
    forms again in the same bundles."""
    import ray

    added = [ray_cluster.add_node(num_cpus=2, resources={"rank_slot": 1}) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    spread = RayBackend(CONFIG, [Placement(tiny_qwen3, "spread", resources={"rank_slot": 1}, shards=2)])
    try:
        def nodes() -> list[str]:
            return [ray.get(r.describe.remote())[2] for r in spread.supervisor.trainers["spread"].ranks]

        placed = nodes()
        assert sorted(placed) == sorted(n.node_id for n in added), "one rank on each added node"
        table = ray.util.placement_group_table(spread.supervisor.placement_group("spread"))
        assert table["strategy"] == "PACK" and [table["bundles_to_node_id"][i] for i in (0, 1)] == placed
        local = InProcessBackend.start(CONFIG, [])
        local.load_model(tiny_qwen3, alias="spread")
        pair = (spread, local)
        both(pair, "create_run", "s", "spread", LORA)
        for step in range(2):
            for r, l in zip(*both(pair, "run_batch", [ForwardRequest("s", data(step))], True), strict=True):
                assert_results_equal(r, l)
            m_remote, m_local = (optim_step(b, "s", AdamParams(learning_rate=1e-2)) for b in pair)
            assert m_remote == pytest.approx(m_local, rel=1e-5)
        os.kill(spread.supervisor.pids("spread")[1], signal.SIGKILL)
        (failure,) = spread.run_batch([ForwardRequest("s", data(0))], True)
        assert isinstance(failure, Failure) and failure.code == "worker_lost", failure
        create_run_once_back(spread, "s2", "spread")
        assert nodes() == placed, "each rank back in its own bundle"
        (result,) = spread.run_batch([ForwardRequest("s2", data(1))], True)
        assert not isinstance(result, Failure), result
    finally:
        spread.close()
        for node in added:
            ray_cluster.remove_node(node)
