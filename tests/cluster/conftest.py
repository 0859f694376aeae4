"""A local Ray cluster of two simulated nodes (`ray.cluster_utils.Cluster`), and servers on `--backend ray`.

Skipped as a whole when Ray is not installed (`make test` installs it: the `ray` extra).
"""

from __future__ import annotations

import pytest

from tests.service.conftest import start_server
from tests.tinker.conftest import service_client, tinker_env  # noqa: F401 (the Tinker SDK fixtures, reused)
from whitney.protocol.backend import SamplerReplicas
from whitney.service.app import ServiceConfig

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    """Two nodes labelled node_a and node_b (each worker asks for one CPU; the CPUs are logical)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "resources": {"node_a": 100}})
    cluster.add_node(num_cpus=8, resources={"node_b": 100})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def ray_config(ray_cluster, models: list[str], data_dir, **overrides) -> ServiceConfig:
    """A server config on the cluster: each model's workers on the node named by `nodes` (default node_a)."""
    nodes = overrides.pop("nodes", {})
    samplers = overrides.pop("samplers", 1)  # Whitney's own replicas per model, or SamplerReplicas
    config = ServiceConfig(models=models, data_dir=data_dir, backend="ray", ray_address=ray_cluster.address,
                           samplers=SamplerReplicas(samplers, samplers) if isinstance(samplers, int) else samplers,
                           worker_resources={m: {"cpus": 1, nodes.get(m, "node_a"): 1} for m in models})
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="session")
def tinker_server(ray_cluster, tmp_path_factory, tiny_llama):
    """The Tinker SDK tests' server, on the Ray backend with one sampler replica."""
    server = start_server(ray_config(ray_cluster, [tiny_llama], tmp_path_factory.mktemp("ray-tinker") / "data"))
    yield server
    server.stop()
