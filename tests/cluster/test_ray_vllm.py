"""vLLM sampler replicas on the Ray backend (`--backend ray --samplers auto --sampler-engine vllm`): each replica a
vLLM server in an actor placed with the model's worker resources, which Ray holds only while the replica lives."""

from __future__ import annotations

from tests.service.test_flow import until
from tests.vllm.test_replicas import PROMPT, pool_of, sample, train
from whitney import Client
from whitney.backends.vllm.ray_host import RayHosted
from whitney.protocol.backend import SamplerEngine, SamplerReplicas
from whitney.protocol.config import EngineConfig

from .conftest import ray_config, start_server


def test_an_elastic_vllm_replica_holds_its_node_resources_only_while_it_lives(ray_cluster, tmp_path,
                                                                               vllm_python, vllm_tiny):
    import ray

    config = ray_config(ray_cluster, [vllm_tiny], tmp_path / "data", nodes={vllm_tiny: "node_b"},
                        samplers=SamplerReplicas(0, 1, SamplerEngine.VLLM, vllm_python, idle_seconds=3.0),
                        engine=EngineConfig(compute_dtype="float32", max_lora_rank=16))
    server = start_server(config)
    try:
        http, client = server.http(), Client(server.url)
        pool = pool_of(server)
        model = next(iter(pool.models))
        free = ray.available_resources()["node_b"]
        run = client.create_session().create_run(rank=8, alpha=16.0, seed=2)
        train(run, 2)
        v = run.save_weights_for_sampler().result()["version"]
        assert pool.pids(model) == []
        ours = sample(http, run_id=run.id, version=v, prompt=PROMPT, max_tokens=10, temperature=0.0, stop=[],
                      timeout=600)  # a replica starts first
        assert pool.completed == 1 and pool.live(model) == 1
        assert isinstance(pool.models[model].replicas[0].server, RayHosted)
        assert ray.available_resources()["node_b"] == free - 1, "the replica's actor holds node_b's resource"
        exact = sample(http, run_id=run.id, version=v, prompt=PROMPT, max_tokens=10, temperature=0.0, stop=[],
                       target_prompt_logprobs=[[0]] * (len(PROMPT) - 1))  # Whitney's sampler, on the trainer
        assert ours["sequences"][0]["tokens"] == exact["sequences"][0]["tokens"]
        until(lambda: pool.pids(model) == [], 60, "the idle replica to stop")
        until(lambda: ray.available_resources()["node_b"] == free, 30, "its resources given back")
    finally:
        server.stop()
