"""Server-side custom losses through the real tinker SDK and the native API, on a real server.

`ServiceClient.create_custom_loss` uploads the traced loss (client/config says custom_loss_server_side);
`forward_backward_custom(data, handle)` then runs it on the server in one forward_backward. Its loss,
metrics, log-probs and per-token loss, and the weights after an optimizer step, equal the SDK's callable
path (forward, the loss on the client, a cross_entropy pass with weights -dL/dlogprob) on a second model
of the same initialisation. The native API serves the same handle (POST /v1/custom_losses, loss_function
"custom" with loss_config {"loss_id": id}). Every hostile graph of the engine's catalogue is a 400 naming
its node over HTTP, and the server trains normally after them.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import whitney
from tests.engine.test_custom_loss import HOSTILE, clipped_is, definition, gated
from tests.tinker.conftest import API_KEY
from tests.tinker.helpers import close, sdk_logprobs

RANK, SEED = 4, 17
SEQS = [[1, 17, 250, 4000, 12, 99, 3071, 8], [5, 6, 7, 8, 9, 10], [300, 301, 302, 303]]


def items(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": np.array(s), "target_tokens": np.array(s[1:], dtype=np.int64),
             "old_logprobs": -rng.uniform(0.5, 3.0, len(s) - 1).astype(np.float32),
             "advantages": rng.normal(0, 1, len(s) - 1).astype(np.float32),
             "scale": np.array(rng.uniform(0.5, 2.0), dtype=np.float32)} for s in SEQS]


def tinker_data(rows: list[dict], keys: tuple[str, ...]) -> list:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"][:-1].tolist()),
                        loss_fn_inputs={k: types.TensorData.from_numpy(d[k]) if d[k].ndim == 0 else d[k]
                                        for k in ("target_tokens", *keys)}) for d in rows]


def per_datum_callable(fn, keys: tuple[str, ...]):
    """fn as the SDK's callable custom loss: per datum, summed; metrics :sum added, :mean averaged."""
    def loss_fn(data, logprobs_list):
        total, sums = 0.0, {}
        for d, lp in zip(data, logprobs_list):
            loss, metrics = fn(lp, *(d.loss_fn_inputs[k].to_torch() for k in keys))
            total = total + loss
            for key, v in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(v.detach())
        return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}
    return loss_fn


def advantage_weighted(logprobs, advantages):
    loss = -(logprobs * advantages).sum()
    return loss, {"custom/adv:mean": advantages.mean()}


def raw(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=60)


@pytest.mark.parametrize("fn,ranks", [
    (clipped_is, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}),
    (gated, {"logprobs": 1, "advantages": 1, "scale": 0}),
])
def test_handle_runs_on_the_server_and_equals_the_callable_path(service_client, tiny_llama, fn, ranks):
    from tinker import types

    keys = tuple(ranks)[1:]
    handle = service_client.create_custom_loss(fn, ranks).result()
    assert handle.loss_id is not None  # uploaded, not left to run client-side
    on_server, on_client = (service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED)
                            .result() for _ in range(2))
    data = tinker_data(items(), keys)
    got = on_server.forward_backward_custom(data, handle).result()
    want = on_client.forward_backward_custom(data, per_datum_callable(fn, keys)).result()
    close(got.metrics["loss:sum"], want.metrics["loss:sum"])
    custom = {k for k in want.metrics if k.startswith("custom/")}
    assert custom and custom <= set(got.metrics)
    for key in custom:
        close(got.metrics[key], want.metrics[key])
    close(sdk_logprobs(got), sdk_logprobs(want))
    close([o["elementwise_loss"].to_numpy().tolist() for o in got.loss_fn_outputs],
          [o["elementwise_loss"].to_numpy().tolist() for o in want.loss_fn_outputs], rtol=1e-4)
    # Same gradient: after one step both models give the same log-probs (and not the ones before).
    for tc in (on_server, on_client):
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    probe = tinker_data(items(), ())
    after_server = sdk_logprobs(on_server.forward(probe, "cross_entropy").result())
    after_client = sdk_logprobs(on_client.forward(probe, "cross_entropy").result())
    close(after_server, after_client, rtol=1e-4)
    assert not np.allclose(np.concatenate(after_server), np.concatenate(sdk_logprobs(got)))


def test_native_route_serves_the_same_loss(tinker_env, tiny_llama):
    spec = definition(clipped_is, {"logprobs": 1, "old_logprobs": 1, "advantages": 1})
    client = whitney.Client(tinker_env.url)
    session = client.create_session()
    try:
        with raw(tinker_env.url) as http:
            created = http.post("/v1/custom_losses", json=spec)
            assert created.status_code == 201, created.text
            loss_id = created.json()["id"]
            read = http.get(f"/v1/custom_losses/{loss_id}").json()
            assert read["graph"] == spec["graph"] and read["inputs"] == spec["inputs"]
            assert loss_id in [x["id"] for x in http.get("/v1/custom_losses").json()]
            assert http.get("/v1/custom_losses/loss-nope").status_code == 404
        rows = items()
        data = [{"input": {"token_ids": d["tokens"][:-1].tolist()},
                 "loss_inputs": {k: {"dtype": "int64" if k == "target_tokens" else "float32",
                                     "shape": list(d[k].shape), "values": d[k].tolist()}
                                 for k in ("target_tokens", "old_logprobs", "advantages")}} for d in rows]
        run = session.create_run(tiny_llama, rank=RANK, seed=SEED)
        got = run.forward_backward(data, "custom", loss_id=loss_id).result()
        lps = [torch.tensor(o["logprobs"]) for o in got["outputs"]]
        want = sum(float(clipped_is(lp, torch.tensor(d["old_logprobs"]), torch.tensor(d["advantages"]))[0])
                   for lp, d in zip(lps, rows))
        close(got["loss"], want)
        assert set(got["metrics"]) >= {"custom/ratio:mean", "custom/clipped:sum", "loss:sum"}
        with raw(tinker_env.url) as http:  # a handle is required: the graph itself is not a loss_config
            bad = http.post(f"/v1/runs/{run.id}/forward", json={"seq_id": 1, "data": data,
                                                                 "loss_function": "custom", "loss_config": spec})
            assert bad.status_code == 400 and bad.json()["field"] == "loss_config"
            unknown = http.post(f"/v1/runs/{run.id}/forward", json={
                "seq_id": 1, "data": data, "loss_function": "custom", "loss_config": {"loss_id": "loss-nope"}})
            assert unknown.status_code == 404
    finally:
        session.close()
        client.close()


def test_hostile_graphs_are_4xx_naming_the_node_and_the_server_trains_after(service_client, tinker_env, tiny_llama):
    session_id = service_client.holder.get_session_id()
    client = whitney.Client(tinker_env.url)
    session = client.create_session()
    run = session.create_run(tiny_llama, rank=RANK, seed=SEED)
    rows = items()
    data = [{"input": {"token_ids": d["tokens"][:-1].tolist()},
             "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [len(d["target_tokens"])],
                                               "values": d["target_tokens"].tolist()},
                             "weights": {"dtype": "float32", "shape": [len(d["advantages"])],
                                         "values": d["advantages"].tolist()}}} for d in rows]
    try:
        with raw(tinker_env.url) as http:
            for seq, (label, (stage, spec)) in enumerate(HOSTILE.items()):
                r = http.post("/api/v1/create_custom_loss", json={
                    "session_id": session_id, "custom_loss_seq_id": 1000 + seq, **spec})
                if stage == "create":
                    assert r.status_code == 400 and "'bad'" in r.json()["message"], (label, r.text)
                    continue
                assert r.status_code == 200, (label, r.text)  # well-formed: refused when it meets the data
                loss_id = f"{session_id}:loss:{1000 + seq}"
                r = http.post(f"/v1/runs/{run.id}/forward_backward", json={
                    "seq_id": 0, "data": data, "loss_function": "custom", "loss_config": {"loss_id": loss_id}})
                assert r.status_code == 400 and "'bad'" in r.json()["message"], (label, r.text)
                assert r.json()["datum_index"] == 0
        # Unharmed: the refused run and a Tinker model still train with a custom loss.
        handle = service_client.create_custom_loss(advantage_weighted, {"logprobs": 1, "advantages": 1}).result()
        tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
        out = tc.forward_backward_custom(tinker_data(rows, ("advantages",)), handle).result()
        assert np.isfinite(out.metrics["loss:sum"])
        assert np.isfinite(run.forward_backward(data, "cross_entropy").result()["loss"])
    finally:
        session.close()
        client.close()


def mean_logprob(logprobs):
    loss = -logprobs.mean()
    return loss, {}


def test_an_unknown_loss_id_fails_its_future_as_a_user_error(service_client, tiny_llama):
    import dataclasses

    import tinker

    handle = service_client.create_custom_loss(mean_logprob, {"logprobs": 1}).result()
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    bogus = dataclasses.replace(handle, loss_id=f"{handle.session_id}:loss:9999")
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward_custom(tinker_data(items(), ()), bogus).result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert "does not exist" in str(info.value)
    # The failed request held its seq_id; the real handle runs after it.
    out = tc.forward_backward_custom(tinker_data(items(), ()), handle).result()
    close(out.metrics["loss:sum"], -sum(np.mean(lp) for lp in sdk_logprobs(out)))


def amplified(logprobs):
    """Issue 31's amplifier: one element expanded to 65536, reduced 120 times (cheap to send, each read costly)."""
    wide = logprobs[:1].expand(65536)
    loss = logprobs.sum()
    for _ in range(120):
        loss = loss + torch.logsumexp(wide, 0)
    return loss, {}


def test_a_graph_over_the_work_budget_is_refused_on_both_apis_and_nothing_runs(service_client, tinker_env,
                                                                                tiny_llama):
    import tinker

    handle = service_client.create_custom_loss(amplified, {"logprobs": 1}).result()  # well-formed: stored
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    with pytest.raises(tinker.RequestFailedError) as info:  # Tinker: the future fails as the user's error
        tc.forward_backward_custom(tinker_data(items(), ()), handle).result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert "work budget" in str(info.value)
    client = whitney.Client(tinker_env.url)
    session = client.create_session()
    try:
        run = session.create_run(tiny_llama, rank=RANK, seed=SEED)
        data = [{"input": {"token_ids": d["tokens"][:-1].tolist()},
                 "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [len(d["target_tokens"])],
                                                   "values": d["target_tokens"].tolist()}}} for d in items()]
        with raw(tinker_env.url) as http:  # native: a 400 naming the field and the budget, and no operation
            r = http.post(f"/v1/runs/{run.id}/forward_backward", json={
                "seq_id": 0, "data": data, "loss_function": "custom", "loss_config": {"loss_id": handle.loss_id}})
            assert r.status_code == 400, r.text
            body = r.json()
            assert body["field"] == "loss_config.graph" and "work budget" in body["message"], body
            assert body["datum_index"] == 0
            assert http.get(f"/v1/runs/{run.id}/operations").json() == []
        # The same seq_id is still free, and the run trains.
        assert np.isfinite(run.forward_backward(data, "cross_entropy").result()["loss"])
    finally:
        session.close()
        client.close()
