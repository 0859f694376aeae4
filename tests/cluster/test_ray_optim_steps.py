"""`RayBackend.optim_steps` against the in-process backend's: the same steps give the same numbers, and a step
of an unknown run fails alone. Workers are real Ray actors on the local two-node cluster."""

from __future__ import annotations

import pytest

from tests.cluster.test_ray_backend import CONFIG, data
from whitney.backends.ray.proxy import Placement, RayBackend
from whitney.backends.in_process import InProcessBackend
from whitney.engine import AdamParams, ForwardRequest, LoraConfig
from whitney.protocol.backend import Failure


def test_optim_steps_equal_in_process_and_fail_alone(ray_cluster, tiny_llama):
    ray_backend = RayBackend(CONFIG, [Placement(tiny_llama, "tiny", resources={"node_b": 1})])
    local = InProcessBackend.start(CONFIG, [])
    local.load_model(tiny_llama, alias="tiny")
    try:
        for backend in (ray_backend, local):
            backend.create_run("a", "tiny", LoraConfig(rank=4, seed=5))
            backend.create_run("b", "tiny", LoraConfig(rank=2, seed=6, train_mlp=False))
        steps = [("a", AdamParams(learning_rate=1e-2)), ("nope", AdamParams()),
                 ("b", AdamParams(learning_rate=1e-3, gradient_clip_norm=0.1))]
        for step in range(2):
            results = []
            for backend in (ray_backend, local):
                backend.run_batch([ForwardRequest("a", data(step)), ForwardRequest("b", data(step + 5))], True)
                results.append(backend.optim_steps(steps))
            remote, here = results
            for r, h in zip(remote, here, strict=True):
                if isinstance(h, Failure):
                    assert isinstance(r, Failure) and r.code == h.code == "not_found" and r.field == "run_id"
                else:
                    assert r == pytest.approx(h, rel=1e-6)  # grad norms: the gradients agree
    finally:
        ray_backend.close()
