"""Elastic replicas of Whitney's own sampler on Ray (`--backend ray --samplers auto`): none while a run only trains,
one started by the first sample (the trainer serves samples until it is up: the same sampler, the same numbers),
stopped once idle, its node's resources held only while it lives."""

from __future__ import annotations

from tests.service.test_flow import until
from tests.vllm.test_replicas import PROMPT, sample, train
from whitney import Client
from whitney.protocol.backend import SamplerReplicas

from .conftest import ray_config, start_server


def test_an_elastic_replica_starts_on_the_first_sample_and_stops_when_idle(ray_cluster, tmp_path, tiny_llama):
    import ray

    config = ray_config(ray_cluster, [tiny_llama], tmp_path / "data", nodes={tiny_llama: "node_b"},
                        samplers=SamplerReplicas(0, 1, idle_seconds=3.0))
    server = start_server(config)
    try:
        http, client = server.http(), Client(server.url)
        supervisor = server.app.state.whitney.scheduler.backend.supervisor
        model = next(iter(supervisor.samplers))
        run = client.create_session().create_run(rank=8, alpha=16.0, seed=2)
        train(run, 2)
        v = run.save_weights_for_sampler().result()["version"]
        free = ray.available_resources()["node_b"]
        assert supervisor.samplers[model] == [], "training alone started a replica"
        first = sample(http, run_id=run.id, version=v, prompt=PROMPT, max_tokens=10, temperature=0.0, stop=[])
        replica = until(lambda: supervisor.samplers[model] and supervisor.usable(supervisor.samplers[model][0])
                        and supervisor.samplers[model][0], 300, "the replica to serve")
        assert ray.available_resources()["node_b"] == free - 1, "the replica's actor holds node_b's resource"
        chosen = replica.idle_since
        second = sample(http, run_id=run.id, version=v, prompt=PROMPT, max_tokens=10, temperature=0.0, stop=[])
        assert replica.idle_since > chosen, "the sample did not go to the replica"
        ours, theirs = second["sequences"][0], first["sequences"][0]  # the replica's, the trainer's: one sampler
        assert ours["tokens"] == theirs["tokens"]
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True)) < 1e-5
        until(lambda: supervisor.samplers[model] == [], 60, "the idle replica to stop")
        until(lambda: ray.available_resources()["node_b"] == free, 30, "its resources given back")
    finally:
        server.stop()
