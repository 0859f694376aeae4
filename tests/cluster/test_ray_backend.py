"""The Ray backend against the in-process one, without HTTP: the same calls give the same numbers (1e-6).

Workers are real Ray actors on a local two-node cluster; the in-process backend is the reference.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from whitney.backends.ray.proxy import Placement, RayBackend
from whitney.backends.in_process import InProcessBackend
from whitney.engine import AdamParams, Datum, ForwardRequest, LoraConfig, Weights
from whitney.errors import InvalidInput, NotFound, Unavailable
from whitney.protocol.backend import Failure, PackageKind, ServedBackend
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SamplingParams

CONFIG = EngineConfig(device="cpu", compute_dtype="float32")
LORA = LoraConfig(rank=4, alpha=8.0, seed=5)


def data(seed: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 12):
        tokens = torch.randint(3, 5000, (n + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * n}))
    return out


def rl_data(seed: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 5000, (10,), generator=g).tolist()
    return [Datum(tokens[:-1], {"target_tokens": tokens[1:], "logprobs": [-2.0] * 9,
                                "advantages": torch.randn(9, generator=g).tolist()})]


@pytest.fixture(scope="module")
def backends(ray_cluster, tiny_llama):
    ray_backend = RayBackend(CONFIG, [Placement(tiny_llama, "tiny", resources={"node_b": 1}, samplers=1)])
    local = InProcessBackend.start(CONFIG, [])
    local.load_model(tiny_llama, alias="tiny")
    yield ray_backend, local
    ray_backend.close()


def both(backends, method: str, *args):
    return [getattr(b, method)(*args) for b in backends]


def optim_step(backend, run_id: str, params: AdamParams) -> dict[str, float]:
    """One run's optimizer step (the protocol's optim_steps with one step): its metrics."""
    (metrics,) = backend.optim_steps([(run_id, params)])
    assert not isinstance(metrics, Failure), metrics
    return metrics


def create_run_once_back(backend, run_id: str, model: str, timeout: float = 120) -> None:
    """Create a run on a model's trainer as soon as it is back: Unavailable (503) while its worker, or the ranks
    of a sharded one, restart."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            backend.create_run(run_id, model, LORA)
            return
        except Unavailable:
            assert time.monotonic() < deadline, f"the trainer of {model} never came back"
            time.sleep(0.5)


def assert_results_equal(a, b) -> None:
    assert not isinstance(a, Failure) and not isinstance(b, Failure), (a, b)
    assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=1e-6)
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-6, abs=1e-6), key
    for oa, ob in zip(a.outputs, b.outputs, strict=True):
        torch.testing.assert_close(torch.tensor(oa.logprobs), torch.tensor(ob.logprobs), atol=1e-6, rtol=0)


def test_both_are_served_backends(backends):
    assert all(isinstance(b, ServedBackend) for b in backends)


def test_training_equals_in_process(backends, tmp_path):
    """forward_backward (cross_entropy and ppo, two runs in one batch), optim_step, save_state: equal."""
    both(backends, "create_run", "a", "tiny", LORA)
    both(backends, "create_run", "b", "tiny", LoraConfig(rank=8, seed=9, train_mlp=False))
    for step in range(3):
        requests = [ForwardRequest("a", data(step)), ForwardRequest("b", rl_data(step), "ppo")]
        remote, local = both(backends, "run_batch", requests, True)
        for r, l in zip(remote, local, strict=True):
            assert_results_equal(r, l)
        for run_id in ("a", "b"):
            m_remote, m_local = (optim_step(b, run_id, AdamParams(learning_rate=1e-2)) for b in backends)
            assert m_remote == pytest.approx(m_local, rel=1e-6)  # grad norms: the gradients agree
    for i, backend in enumerate(backends):
        backend.save("a", PackageKind.STATE, str(tmp_path / f"a{i}"), True)
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        remote, local = (load_file(tmp_path / f"a{i}" / name) for i in range(2))
        assert remote.keys() == local.keys()
        for key in remote:
            torch.testing.assert_close(remote[key], local[key], atol=1e-6, rtol=0, msg=key)
    (forward_remote,), (forward_local,) = both(backends, "run_batch", [ForwardRequest("a", data(9))], False)
    assert_results_equal(forward_remote, forward_local)


def test_sampler_replica_serves_frozen_versions(backends, tmp_path):
    """Version N is written by the trainer and loaded by the replica; sampling and scoring equal in-process."""
    both(backends, "create_run", "s", "tiny", LORA)
    both(backends, "run_batch", [ForwardRequest("s", data(1))], True)
    for backend in backends:
        optim_step(backend, "s", AdamParams(learning_rate=5e-2))
    versions = [b.save("s", PackageKind.SAMPLER, str(tmp_path / f"v1-{i}")) for i, b in enumerate(backends)]
    assert versions == [1, 1]
    both(backends, "run_batch", [ForwardRequest("s", data(2))], True)  # the trainer moves on
    for backend in backends:
        optim_step(backend, "s", AdamParams(learning_rate=5e-2))
    weights = Weights(run_id="s", version=1)
    sequence = data(3)[0].token_ids
    remote, local = both(backends, "compute_logprobs", [sequence], weights)
    torch.testing.assert_close(torch.tensor(remote[0][1:]), torch.tensor(local[0][1:]), atol=1e-6, rtol=0)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=4, num_samples=2)
    outcomes = []
    for backend in backends:
        backend.submit_sample("q", sequence[:5], params, weights)
        ended = []
        while not ended:
            ended = backend.sample_step()
        outcomes.append(ended)
    (rid_r, remote), (rid_l, local) = outcomes[0][0], outcomes[1][0]
    assert rid_r == rid_l == "q"
    for sr, sl in zip(remote.sequences, local.sequences, strict=True):
        assert sr.tokens == sl.tokens
        torch.testing.assert_close(torch.tensor(sr.logprobs), torch.tensor(sl.logprobs), atol=1e-6, rtol=0)


def test_validation_happens_here_with_the_engines_messages(backends):
    ray_backend, local = backends
    both(backends, "create_run", "v", "tiny", LORA)
    bad = ForwardRequest("v", [Datum([1, 2, 3], {"target_tokens": [1, 2, 10**7]})])
    errors = []
    for backend in backends:
        with pytest.raises(InvalidInput) as e:
            backend.validate(bad, True)
        errors.append(e.value.to_dict())
    assert errors[0] == errors[1]
    with pytest.raises(NotFound):
        ray_backend.validate(ForwardRequest("nope", data(0)), True)
    good = ForwardRequest("v", data(0))
    assert ray_backend.validate(good, True) == local.validate(good, True)
    assert ray_backend.adapter_bytes("tiny", LORA) == local.adapter_bytes("tiny", LORA)
    with pytest.raises(InvalidInput, match="unknown module .nope."):
        ray_backend.adapter_bytes("tiny", LoraConfig(target_modules=["nope"]))
    (failure,) = ray_backend.run_batch([bad], True)  # refused in the worker: the same error, as data
    assert isinstance(failure, Failure) and failure.code == "invalid_input" and failure.field == "target_tokens"


def test_two_models_on_two_nodes(ray_cluster, tiny_llama, tiny_qwen3):
    backend = RayBackend(CONFIG, [Placement(tiny_llama, "llama", resources={"node_a": 1}),
                                  Placement(tiny_qwen3, "qwen", resources={"node_b": 1})])
    try:
        nodes = backend.supervisor.nodes()
        assert nodes["llama"][0] != nodes["qwen"][0], "each model's trainer on its own node"
        assert set(backend.models) == {"llama", "qwen"} and backend.models["qwen"].model_type == "qwen3"
        backend.create_run("l", "llama", LORA)
        backend.create_run("q", "qwen", LORA)
        out = backend.run_batch([ForwardRequest("l", data(0)), ForwardRequest("q", data(0))], True)
        assert all(not isinstance(r, Failure) for r in out) and out[0].loss != out[1].loss
    finally:
        backend.close()


def test_a_model_that_cannot_load_is_refused_with_its_reason(ray_cluster, tmp_path):
    with pytest.raises(Exception) as e:
        RayBackend(CONFIG, [Placement(str(tmp_path / "missing"), "missing")])
    assert "missing" in str(e.value)


def test_a_trainer_that_dies_while_idle_is_noticed_by_the_heartbeat(ray_cluster, tiny_qwen3):
    import os
    import signal

    backend = RayBackend(CONFIG, [Placement(tiny_qwen3, "qwen", resources={"node_b": 1})])
    try:
        backend.create_run("idle", "qwen", LORA)
        assert backend.take_lost_runs() == []
        os.kill(backend.supervisor.pids("qwen")[0], signal.SIGKILL)  # no call in flight
        deadline, lost = time.monotonic() + 30, []
        while not lost:
            assert time.monotonic() < deadline, "the heartbeat never noticed"
            lost = backend.take_lost_runs()
            time.sleep(0.2)
        assert lost == ["idle"]
        with pytest.raises(NotFound):  # gone: the scheduler has interrupted it by now
            backend.validate(ForwardRequest("idle", data(0)), True)
    finally:
        backend.close()


def test_a_sample_on_a_trainer_that_died_fails_with_it(ray_cluster, tiny_llama):
    """With no replicas the trainer samples. It dies while a sample is in flight, a training call notices first
    and the worker is back before the sampling thread steps again (it was scoring elsewhere, say): the sample
    ends with worker_lost; it does not wait forever on the restarted process, which never heard of it."""
    import os
    import signal

    backend = RayBackend(CONFIG, [Placement(tiny_llama, "tiny", resources={"node_a": 1})])
    try:
        backend.create_run("r", "tiny", LORA)
        backend.submit_sample("q", data(0)[0].token_ids, SamplingParams(max_tokens=64, temperature=0.0),
                              Weights(base_model="tiny"))
        os.kill(backend.supervisor.pids("tiny")[0], signal.SIGKILL)
        (failure,) = backend.run_batch([ForwardRequest("r", data(0))], True)
        assert isinstance(failure, Failure) and failure.code == "worker_lost", failure
        create_run_once_back(backend, "r2", "tiny")
        deadline, ended = time.monotonic() + 30, []
        while not ended:
            assert time.monotonic() < deadline, "the sample waits on a process that died"
            ended = [(r, o) for r, o in backend.sample_step() if not hasattr(o, "extend")]
        assert [(r, o.code) for r, o in ended] == [("q", "worker_lost")], ended
        assert backend.sampling_in_flight == 0
    finally:
        backend.close()


def _threads(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda worker: __import__("torch").get_num_threads()))


def test_every_worker_process_takes_the_thread_setting(ray_cluster, tiny_llama):
    """--threads reaches every rank of a sharded trainer and every sampler replica; "auto" follows the load
    with the worker's Ray CPUs as its ceiling; without a setting a worker uses as many threads as its CPUs. Every
    worker process shares two malloc arenas."""
    from dataclasses import replace

    backend = RayBackend(replace(CONFIG, threads=1), [Placement(tiny_llama, "tiny", num_cpus=2, shards=2,
                                                                samplers=1, resources={"node_a": 1})])
    try:
        actors = [actor for worker in backend.supervisor.workers() for actor in worker.ranks]
        assert len(actors) == 3  # two ranks, one sampler replica
        assert [_threads(a) for a in actors] == [1] * 3
        assert backend.models["tiny"].compute_threads == 1
        # glibc's arenas capped from each process's start, before Ray's own threads make theirs (whitney/heap.py)
        environ = [a.__ray_call__.remote(lambda w: __import__("os").environ.get("MALLOC_ARENA_MAX")) for a in actors]
        arenas = set(__import__("ray").get(environ))
        assert arenas == {"2"}, arenas
    finally:
        backend.close()
    for setting in (None, "auto"):
        backend = RayBackend(replace(CONFIG, threads=setting),
                             [Placement(tiny_llama, "tiny", num_cpus=2, samplers=1, resources={"node_b": 1})])
        try:
            workers = [a for w in backend.supervisor.workers() for a in w.ranks]
            assert backend.models["tiny"].compute_threads == 2, setting  # the ceiling, as loaded
            assert all(1 <= _threads(a) <= 2 for a in workers), setting  # "auto": fewer while the CPUs are busy
            adaptive = [__import__("ray").get(a.__ray_call__.remote(lambda w: w.threads.adaptive)) for a in workers]
            assert adaptive == [setting == "auto"] * 2
        finally:
            backend.close()


def test_a_heavy_check_runs_beside_the_call_in_turn_at_the_lowest_priority(ray_cluster, tiny_llama):
    """Issue 31: an image check (ImageTokens, Validate with images) ran in the worker's turn, so training waited
    behind the decoding. A heavy call goes to the worker's CHECKS threads: it is answered while a call in turn
    still holds the worker, and runs at a lowered priority (whitney/priority.py)."""
    import os

    import ray

    from whitney.backends.ray.calls import CHECKS, ImageTokens
    from whitney.priority import LOWERED_NICE
    from whitney.protocol.training import ImageInput

    chunk = ImageInput(b"\x89PNG\r\n\x1a\n", "png")
    backend = RayBackend(CONFIG, [Placement(tiny_llama, "tiny", resources={"node_a": 1})])
    try:
        actor = backend.supervisor.trainers["tiny"].ranks[0]
        busy = actor.__ray_call__.remote(lambda worker: __import__("time").sleep(5))  # the worker's turn, held
        ray.get(actor.__ray_call__.options(concurrency_group=CHECKS).remote(lambda worker: None))  # it has started
        with pytest.raises(InvalidInput, match="takes no images"):  # the worker's own answer: a text model
            backend.image_tokens("tiny", [chunk])
        assert ray.wait([busy], timeout=0)[1] == [busy]  # answered while the call in turn still ran
        nice = ray.get(actor.__ray_call__.options(concurrency_group=CHECKS).remote(
            lambda worker: (worker.run(ImageTokens("tiny", [chunk])),
                            os.getpriority(os.PRIO_PROCESS, __import__("threading").get_native_id()))[1]))
        assert nice == LOWERED_NICE
        ray.get(busy)
    finally:
        backend.close()
