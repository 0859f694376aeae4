"""GET /metrics scraped from a real server after real work: counts, histograms, tokens, holdings."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_flow import LORA, expect, sft_batch, until
from whitney import Client


def scrape(http) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_what_the_server_did_and_holds(server):
    http = server.http()
    client = Client(server.url)
    run = client.create_session().create_run(**LORA, seed=3)
    data = sft_batch()
    tokens = sum(len(d["input"]["token_ids"]) for d in data)
    for _ in range(2):
        run.forward_backward(data).result()
        run.optim_step(learning_rate=1e-3).result()
    version = run.save_weights_for_sampler().result()["version"]
    sample = run.sample([1, 523, 1077], version, num_samples=2, max_tokens=5, temperature=1.0, seed=1).result()
    generated = sum(len(s["tokens"]) for s in sample["sequences"])
    waiting = expect(http.post(f"/v1/runs/{run.id}/forward_backward",  # seq_id 5 never comes
                               json={"seq_id": 6, "data": data, "loss_function": "cross_entropy"}), 202)

    m = scrape(http)
    assert value(m, "whitney_operations_total", kind="forward_backward", outcome="succeeded", code="") == 2
    assert value(m, "whitney_operations_total", kind="optim_step", outcome="succeeded", code="") == 2
    assert value(m, "whitney_operations_total", kind="sample", outcome="succeeded", code="") == 1
    assert value(m, "whitney_training_tokens_total", kind="forward_backward") == 2 * tokens
    assert value(m, "whitney_sampled_tokens_total") == generated > 0
    assert value(m, "whitney_operation_run_seconds_count", kind="forward_backward") == 2
    assert value(m, "whitney_operation_queue_seconds_count", kind="optim_step") == 2
    assert value(m, "whitney_operation_run_seconds_sum", kind="forward_backward") > 0
    assert value(m, "whitney_runs", status="active") == 1 and value(m, "whitney_sessions", status="active") == 1
    assert value(m, "whitney_sampling_requests_in_flight") == 0
    model = server.app.state.whitney.models[0]
    info = server.app.state.whitney.model_info(model)
    assert value(m, "whitney_base_model_bytes", model=model, device="cpu", dtype="float32") == info.weight_bytes
    assert info.weight_bytes > 49152 * 64 * 4, "at least the embedding"
    held = server.app.state.whitney.quotas.run_bytes(model, {"rank": LORA["rank"], "alpha": LORA["alpha"]})
    assert value(m, "whitney_run_adapter_bytes", run_id=run.id, base_model=model) == held > 0

    run.cancel()
    assert expect(http.get(f"/v1/operations/{waiting['id']}", params={"wait": 10}), 200)["status"] == "cancelled"
    until(lambda: run.refresh()["status"] == "cancelled", 10, "the run's adapter freed")  # cancelling holds it
    m = scrape(http)
    assert value(m, "whitney_operations_total", kind="forward_backward", outcome="cancelled", code="cancelled") == 1
    assert value(m, "whitney_operation_run_seconds_count", kind="forward_backward") == 2, "it never started"
    assert value(m, "whitney_runs", status="active") == 0
    assert not any(name == "whitney_run_adapter_bytes" for name, _ in m)


def test_metrics_are_the_operators_not_a_tenants(make_server, tmp_path):
    """Issue 31, item 11: /metrics lists every tenant's run ids, so with keys on only the metrics key (the
    operator's, `--metrics-key`) reads it; a tenant's valid key is refused, and the metrics key opens nothing
    else. Without a metrics key, a server with keys answers /metrics to no one."""
    server = make_server(api_keys=["k1", "k2"], metrics_key="m-operator")
    run = Client(server.url, api_key="k2").create_session().create_run(**LORA, seed=3)
    for key in (None, "k1", "k2", "m-wrong"):
        r = server.http(key).get("/metrics")
        assert r.status_code == 401 and r.json()["field"] == "authorization", (key, r.text)
        assert run.id not in r.text and "--metrics-key" in r.json()["message"]
    m = scrape(server.http("m-operator"))
    assert value(m, "whitney_run_adapter_bytes", run_id=run.id, base_model=server.app.state.whitney.models[0]) > 0
    tinker_style = server.http().get("/metrics", headers={"X-API-Key": "m-operator"})
    assert tinker_style.status_code == 200
    assert server.http("m-operator").get("/v1/sessions").status_code == 401, "the metrics key is no tenant's key"

    unset = make_server(api_keys=["k1"], data_dir=tmp_path / "other")
    for key in (None, "k1"):
        r = unset.http(key).get("/metrics")
        assert r.status_code == 401 and "no metrics key" in r.json()["message"], r.text
