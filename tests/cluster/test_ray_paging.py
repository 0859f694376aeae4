"""Paging on the Ray backend: the trainer pages its idle runs out and back in (engine/paging.py), with the
in-process engine's numbers; the control plane counts runs over the trainers."""

from __future__ import annotations

from tests.cluster.test_ray_backend import assert_results_equal, data
from tests.service.test_flow import until
from whitney.backends.ray.proxy import Placement, RayBackend
from whitney.backends.in_process import InProcessBackend
from whitney.engine import ForwardRequest, LoraConfig
from whitney.protocol.config import EngineConfig

LORA = LoraConfig(rank=4, alpha=8.0, seed=5)


def test_ray_trainer_pages_idle_runs_out_and_back_in(ray_cluster, tiny_llama, tmp_path):
    config = EngineConfig(device="cpu", compute_dtype="float32", page_idle_seconds=0,
                          paging_dir=str(tmp_path / "paged"))
    ray_backend = RayBackend(config, [Placement(tiny_llama, "tiny", resources={"node_a": 1})])
    local = InProcessBackend.start(EngineConfig(device="cpu", compute_dtype="float32"), [])
    local.load_model(tiny_llama, alias="tiny")
    try:
        for backend in (ray_backend, local):
            backend.create_run("r", "tiny", LORA)
        assert ray_backend.page_out_idle() == 1
        # the trainer's writer thread writes the files after page_out_idle returns; in memory until written
        counts = until(lambda: (c := ray_backend.residency()).page_outs.count == 1 and c, 30, "the page file written")
        assert (counts.in_memory, counts.paged_out) == (0, 1)
        assert list((tmp_path / "paged").glob("engine-*/run-*")), "the page file is where the config says"
        assert ray_backend.page_out_idle() == 0, "asked at most once a second"
        (paged,), (kept,) = [b.run_batch([ForwardRequest("r", data(1))], backward=True) for b in (ray_backend, local)]
        assert_results_equal(paged, kept)  # as test_ray_backend compares them (exactness: tests/engine/test_paging.py)
        counts = ray_backend.residency()
        assert (counts.in_memory, counts.paged_out, counts.page_ins.count) == (1, 0, 1)
    finally:
        ray_backend.close()
