"""`--backend ray` through a real server: the seed's flows and examples, two models on two nodes, and a
worker killed with SIGKILL in the middle of a forward_backward.

The flow tests are tests/service/test_flow.py's own, collected here again over this module's `server`
(a Ray-backed server, one sampler replica): the same assertions hold on the cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import ray_config
from tests.service.conftest import start_server
from tests.service.test_flow import (  # noqa: F401 (collected again, over this module's server)
    expect,
    poll,
    run_status,
    sft_batch,
    succeeded,
    test_finish_runs_what_is_queued_and_cancels_after_a_gap,
    test_out_of_order_submission_waits_for_the_gap,
    test_resume_bound_or_loaded_continues_exactly,
    test_sampler_versions_are_pinned,
    test_sft_flow_over_raw_http,
    until,
)
from whitney.datums import sft_datum

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "training" / "http"


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama, tmp_path_factory):
    running = start_server(ray_config(ray_cluster, [tiny_llama], tmp_path_factory.mktemp("ray") / "data"))
    yield running
    running.stop()


def example(script: str, *args: str, url: str, timeout: float = 240) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WHITNEY_BASE_URL": url}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_examples_run_on_ray(server, tiny_llama, tmp_path):
    """The seed's supervised loop (its batch built by whitney_datums.py from the examples' shipped dataset), the
    RL and the distillation loops."""
    batch = tmp_path / "batch.json"
    example("whitney_datums.py", str(EXAMPLES / "data" / "chats.jsonl"), str(batch), "--model", tiny_llama,
            url=server.url)
    out = example("sl_loop.py", "--model", tiny_llama, "--forward-backward-json", str(batch), "--steps", "3",
                  "--out", str(tmp_path / "adapter"), url=server.url)
    assert (tmp_path / "adapter").exists() and "step 2: loss per token" in out, out
    example("rl_loop.py", "--model", tiny_llama, "--steps", "2", "--questions", "2", "--group", "2", url=server.url)
    example("distill_loop.py", "--model", tiny_llama, "--steps", "2", "--samples", "2", url=server.url)


def test_a_killed_worker_fails_its_operation_and_its_runs_resume_from_a_checkpoint(ray_cluster, tiny_llama,
                                                                                     tiny_qwen3, tmp_path):
    """SIGKILL the trainer of one model during a forward_backward: that operation fails with worker_lost within
    seconds, its run is interrupted, the other model's run trains on, and once Ray restarted the worker a new
    run resumed from the lost run's last save_state scores exactly what it saved."""
    config = ray_config(ray_cluster, [tiny_llama, tiny_qwen3], tmp_path / "data", samplers=0,
                        nodes={tiny_llama: "node_a", tiny_qwen3: "node_b"})
    srv = start_server(config)
    try:
        http = srv.http()
        backend = srv.app.state.whitney.scheduler.backend
        llama, qwen = (m.rsplit("/", 1)[-1] for m in (tiny_llama, tiny_qwen3))
        session = expect(http.post("/v1/sessions", json={}), 201)["id"]
        runs = {m: expect(http.post(f"/v1/sessions/{session}/runs", json={"base_model": m, "lora": {"rank": 4}}),
                          201)["id"] for m in (llama, qwen)}
        victim, other = runs[llama], runs[qwen]
        fb = {"seq_id": 0, "data": sft_batch(), "loss_function": "cross_entropy", "loss_config": {}}
        succeeded(http, expect(http.post(f"/v1/runs/{victim}/forward_backward", json=fb), 202)["id"])
        step = {"seq_id": 1, "adam_params": {"learning_rate": 5e-2}}
        succeeded(http, expect(http.post(f"/v1/runs/{victim}/optim_step", json=step), 202)["id"])
        saved = succeeded(http, expect(http.post(f"/v1/runs/{victim}/save_state",
                                                 json={"seq_id": 2, "name": "before"}), 202)["id"])
        checkpoint = saved["package"]["id"]
        sequence = [1, 523, 1077, 2889, 30, 905, 3211]
        scored = succeeded(http, expect(http.post("/v1/logprobs", json={"checkpoint_id": checkpoint,
                                                                        "sequences": [sequence]}), 202)["id"])

        # A forward_backward long enough to be killed in the middle (16k tokens, micro-batches of 8k).
        long_batch = [sft_datum(list(range(3, 250)), list(range(600, 853)))] * 32
        op = expect(http.post(f"/v1/runs/{victim}/forward_backward",
                              json={**fb, "seq_id": 3, "data": long_batch}), 202)
        queued = expect(http.post(f"/v1/runs/{victim}/optim_step", json={**step, "seq_id": 4}), 202)
        until(lambda: expect(http.get(f"/v1/operations/{op['id']}"), 200)["status"] == "running", 30,
              "the long operation runs")
        pid = backend.supervisor.pids(llama)[0]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        failed = poll(http, op["id"], 30)
        assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost", failed
        assert time.monotonic() - killed_at < 15
        assert "died" in failed["error"]["message"]
        after = poll(http, queued["id"], 30)
        assert after["status"] == "failed" and after["error"]["code"] == "worker_lost"
        until(lambda: run_status(http, victim) == "interrupted", 15, "the run is interrupted")
        refused = http.post(f"/v1/runs/{victim}/forward_backward", json={**fb, "seq_id": 5})
        assert refused.status_code == 409, refused.text

        # The other model, on the other node, never noticed.
        done = succeeded(http, expect(http.post(f"/v1/runs/{other}/forward_backward", json=fb), 202)["id"])
        assert done["loss"] > 0

        # Ray restarts the worker; the lost run resumes from its checkpoint as a new run (503 while restarting).
        def resume():
            response = http.post(f"/v1/sessions/{session}/runs", json={
                "base_model": llama, "lora": {"rank": 4}, "resume_from": {"checkpoint_id": checkpoint}})
            assert response.status_code in (201, 503), response.text
            return response.json() if response.status_code == 201 else None
        resumed = until(resume, 120, "the restarted worker takes the resumed run")
        assert backend.supervisor.pids(llama)[0] != pid
        version = succeeded(http, expect(http.post(f"/v1/runs/{resumed['id']}/save_weights_for_sampler",
                                                   json={"seq_id": 0}), 202)["id"])["version"]
        rescored = succeeded(http, expect(http.post("/v1/logprobs", json={
            "run_id": resumed["id"], "version": version, "sequences": [sequence]}), 202)["id"])
        assert rescored["logprobs"][0][1:] == pytest.approx(scored["logprobs"][0][1:], abs=1e-6)
    finally:
        srv.stop()


def test_serve_command_on_a_ray_cluster(ray_cluster, tiny_llama, tiny_qwen3):
    """`whitney serve --backend ray --ray-address ...`: two models on two nodes, shown in capabilities."""
    from bench.common import start_server

    with start_server("--backend", "ray", "--ray-address", ray_cluster.address, "--model", tiny_qwen3,
                      "--samplers", "1", "--worker-resources", f"{tiny_llama}=cpus:1,node_a:1",
                      "--worker-resources", f"{Path(tiny_qwen3).name}=cpus:1,node_b:1", model=tiny_llama) as server:
        models = httpx.get(f"{server.url}/v1/training/capabilities").json()["models"]
        assert [m["name"] for m in models] == [Path(tiny_llama).name, Path(tiny_qwen3).name]
    bad = subprocess.run([sys.executable, "-m", "whitney.cli", "serve", "--samplers", "2"], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert bad.returncode == 2 and "--backend ray" in bad.stderr
