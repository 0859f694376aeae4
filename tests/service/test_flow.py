"""Whole flows through a real server (uvicorn on a free port, SQLite file, tiny random Llama).

The seed's SFT flow over raw HTTP down to a PEFT-loadable export; training numbers equal to an
in-process Engine; resume (bound at creation or load_state first, never both); seq_id ordering,
idempotent retries, cancel/close/finish; sampler version pinning; mixed-run batches; restart
recovery; API-key isolation; session expiry; forward_backward_custom.
"""

from __future__ import annotations

import copy
import io
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from whitney import Client, WhitneyAPIError
from whitney.datums import sft_datum
from whitney.engine import AdamParams, Datum, Engine, LoraConfig

TERMINAL = ("succeeded", "failed", "cancelled")
EXAMPLES = [([1, 523, 1077, 2889, 30], [905, 3211, 17, 2]),
            ([1, 77, 4402], [12, 9983, 451, 31000, 2])]
OTHER_EXAMPLES = [([1, 8, 9, 10, 11, 12, 13], [14, 15, 2]),
                  ([1, 40000, 3], [4, 5]),
                  ([1, 600], [700, 800, 900, 1000, 1100, 2])]
ADAM = {"learning_rate": 5e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
LORA = {"rank": 8, "alpha": 16.0}


def sft_batch(examples=EXAMPLES) -> list[dict]:
    return [sft_datum(p, c) for p, c in examples]


# ---- raw HTTP helpers ------------------------------------------------------------------------


def expect(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, f"{response.request.method} {response.request.url}: " \
                                           f"{response.status_code} {response.text}"
    return response.json()


def poll(http: httpx.Client, op_id: str, timeout: float = 60.0) -> dict:
    """Long-poll GET /v1/operations/{id}?wait= until the operation is terminal."""
    deadline = time.monotonic() + timeout
    while True:
        op = expect(http.get(f"/v1/operations/{op_id}", params={"wait": 5.0}), 200)
        if op["status"] in TERMINAL:
            return op
        assert time.monotonic() < deadline, f"operation {op_id} is still {op['status']}"


def succeeded(http: httpx.Client, op_id: str) -> dict:
    op = poll(http, op_id)
    assert op["status"] == "succeeded", op
    return op["result"]


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def run_status(http: httpx.Client, run_id: str) -> str:
    return expect(http.get(f"/v1/runs/{run_id}"), 200)["status"]


def fb_body(seq_id: int, data=None, loss="cross_entropy") -> dict:
    return {"seq_id": seq_id, "data": data or sft_batch(), "loss_function": loss, "loss_config": {}}


# ---- in-process reference ------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tiny_llama):
    """An in-process Engine on the same tiny Llama: the numbers the server must reproduce."""
    engine = Engine()
    engine.load_model(tiny_llama)
    counter = iter(range(10**6))

    def new_run(**lora) -> str:
        run_id = f"local-{next(counter)}"
        engine.create_run(run_id, tiny_llama, LoraConfig(**lora))
        return run_id

    engine.new_run = new_run
    return engine


def engine_data(data: list[dict]) -> list[Datum]:
    return [Datum(d["input"]["token_ids"], d["loss_inputs"]) for d in data]


def rel_close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def assert_adapters_close(a, b, atol: float = 1e-6) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name].detach(), pb[name].detach(), atol=atol, rtol=0, msg=name)


def train(run, steps: int, data=None, **adam) -> tuple[list[float], list[dict]]:
    """Pipelined forward_backward + optim_step through the client; (losses, optimizer metrics)."""
    futures = [(run.forward_backward(data or sft_batch()), run.optim_step(**{**ADAM, **adam}))
               for _ in range(steps)]
    return [fb.result()["loss"] for fb, _ in futures], [opt.result()["metrics"] for _, opt in futures]


# ---- 1. the seed's SFT flow over raw HTTP -------------------------------------------------------


def hf_logprobs(model, data: list[dict]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for d in data:
            tokens = d["input"]["token_ids"]
            targets = torch.tensor(d["loss_inputs"]["target_tokens"]["values"])
            logits = model(torch.tensor([tokens])).logits[0].double()
            out.append(torch.log_softmax(logits, -1)[torch.arange(len(tokens)), targets])
    return out


def test_sft_flow_over_raw_http(server, tiny_llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    http = server.http()
    caps = expect(http.get("/v1/training/capabilities"), 200)
    for kind in ("forward_backward", "optim_step", "save_state", "export_lora"):
        assert kind in caps["operations"]
    assert [m["name"] for m in caps["models"]] == [Path(tiny_llama).name]  # a directory by its name, no path
    assert caps["models"][0]["compute_dtype"] == "float32"  # the default

    session = expect(http.post("/v1/sessions", json={"user_metadata": {"job": "sft"}}), 201)
    assert session["status"] == "active"
    sid = session["id"]
    run = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {**LORA, "seed": 3}}), 201)
    rid = run["id"]
    assert run["status"] == "active" and run["base_model"] == Path(tiny_llama).name and run["lora"]["rank"] == 8

    data, seq, losses = sft_batch(), 0, []
    for _ in range(3):
        op = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(seq, data)), 202)
        assert (op["seq_id"], op["kind"], op["run_id"]) == (seq, "forward_backward", rid)
        losses.append(succeeded(http, op["id"])["loss"])
        seq += 1
        op = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": seq, "adam_params": {
            **ADAM, "weight_decay": 0.0, "gradient_clip_norm": 0.0}}), 202)
        assert succeeded(http, op["id"])["metrics"]["grad_norm"] > 0
        seq += 1
    assert losses[2] < losses[1] < losses[0]

    op = expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(seq, data)), 202)
    forward = succeeded(http, op["id"])
    seq += 1
    op = expect(http.post(f"/v1/runs/{rid}/save_state", json={"seq_id": seq, "name": "sft",
                                                              "include_optimizer": True}), 202)
    state = succeeded(http, op["id"])["package"]
    assert (state["kind"], state["has_optimizer"], state["run_id"]) == ("state", True, rid)
    seq += 1
    op = expect(http.post(f"/v1/runs/{rid}/export_lora", json={"seq_id": seq, "name": "sft-adapter"}), 202)
    export = succeeded(http, op["id"])["package"]
    assert export["kind"] == "lora" and "path" not in export and "owner" not in export

    expect(http.post(f"/v1/runs/{rid}/finish"), 200)
    until(lambda: run_status(http, rid) == "finished", 30, "run finished")
    assert expect(http.post(f"/v1/sessions/{sid}/close"), 200)["status"] == "closed"
    assert run_status(http, rid) == "finished"  # closing never touches a finished run
    listed = expect(http.get("/v1/checkpoints", params={"run_id": rid}), 200)
    assert {p["id"] for p in listed} == {state["id"], export["id"]}

    response = http.get(f"/v1/checkpoints/{export['id']}/archive")
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        tar.extractall(tmp_path, filter="data")
    adapter_dir = tmp_path / f"{export['name']}-v{export['version']}"
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    base_lp = hf_logprobs(base, data)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    peft_lp = hf_logprobs(model, data)
    ours = [torch.tensor(o["logprobs"], dtype=torch.float64) for o in forward["outputs"]]
    for a, b, c in zip(ours, peft_lp, base_lp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert (a - c).abs().max() > 1e-3  # the adapter matters, so the equality means something


# ---- 2. SFT through the client equals the in-process engine ----------------------------------


def test_client_sft_loss_decreases_and_equals_engine(server, local):
    client = Client(server.url)
    run = client.create_session().create_run(**LORA, seed=5)
    losses, metrics = train(run, 4)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert [m["step"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]

    ref = local.new_run(**LORA, seed=5)
    for loss, m in zip(losses, metrics):
        result = local.forward_backward(ref, engine_data(sft_batch()))
        norm = local.optim_step(ref, AdamParams(**ADAM))["grad_norm"]
        assert rel_close(loss, result.loss), (loss, result.loss)
        assert rel_close(m["grad_norm"], norm), (m["grad_norm"], norm)
    assert_adapters_close(server.engine.runs[run.id].adapter, local.runs[ref].adapter)


# ---- 3. resume: bound at creation, or load_state first, never both ----------------------------


def test_resume_bound_or_loaded_continues_exactly(server):
    client = Client(server.url)
    session = client.create_session()
    original = session.create_run(**LORA, seed=7)
    train(original, 2)
    ckpt = original.save_state(name="mid").result()["package"]
    assert ckpt["has_optimizer"]
    ref_losses, ref_metrics = train(original, 2)
    assert [m["step"] for m in ref_metrics] == [3.0, 4.0]

    def same_as_uninterrupted(run) -> None:
        losses, metrics = train(run, 2)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (losses, ref_losses)
        for m, r in zip(metrics, ref_metrics):
            assert m["step"] == r["step"] and abs(m["grad_norm"] - r["grad_norm"]) <= 1e-6 * r["grad_norm"]

    # (a) bound at creation, with the optimizer; the run takes the checkpoint's LoRA geometry
    bound = session.create_run(resume_from=ckpt["id"], with_optimizer=True)
    assert bound.info["resume_from"] == ckpt["id"] and bound.info["resume_with_optimizer"]
    assert bound.info["lora"] == original.info["lora"]
    same_as_uninterrupted(bound)

    # (b) a fresh run (another seed) whose seq 0 is load_state_with_optimizer
    loaded = session.create_run(**LORA, seed=99)
    assert loaded.load_state_with_optimizer(ckpt["id"]).result() == {"checkpoint_id": ckpt["id"]}
    same_as_uninterrupted(loaded)

    # (c) both for one run is refused, and the refusal takes no seq_id
    http = server.http()
    both = session.create_run(resume_from=ckpt["id"], with_optimizer=True)
    for kind in ("load_state", "load_state_with_optimizer"):
        body = expect(http.post(f"/v1/runs/{both.id}/{kind}", json={"seq_id": 0, "checkpoint_id": ckpt["id"]}),
                      409)
        assert body["field"] == "seq_id" and body["code"] == "conflict"
    with pytest.raises(WhitneyAPIError) as refused:
        both.load_state(ckpt["id"])
    assert refused.value.status == 409 and refused.value.field == "seq_id"
    both._next_seq = 0  # the refused call consumed the client's seq 0, the server's is still free
    same_as_uninterrupted(both)

    # load_state (weights only): same weights, fresh optimizer, no leftover gradient. This run has
    # taken a step (optimizer moments) and holds an accumulated gradient when it loads.
    weights_only = session.create_run(**LORA, seed=99)
    train(weights_only, 1)
    weights_only.forward_backward(sft_batch(OTHER_EXAMPLES)).result()
    weights_only.load_state(ckpt["id"]).result()
    losses, metrics = train(weights_only, 2)
    assert abs(losses[0] - ref_losses[0]) <= 1e-6 * abs(ref_losses[0])  # the weights were restored
    assert abs(metrics[0]["grad_norm"] - ref_metrics[0]["grad_norm"]) <= 1e-6 * ref_metrics[0]["grad_norm"]
    assert [m["step"] for m in metrics] == [1.0, 2.0]  # the optimizer starts over ...
    assert abs(losses[1] - ref_losses[1]) > 1e-5 * abs(ref_losses[1])  # ... so the next update differs
    # and binding at creation without the optimizer is the same thing
    fresh_bound = session.create_run(resume_from=ckpt["id"], with_optimizer=False)
    again, _ = train(fresh_bound, 2)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(again, losses)), (again, losses)


# ---- 4. out-of-order submission -------------------------------------------------------------------


def test_out_of_order_submission_waits_for_the_gap(server):
    http = server.http()
    sid = expect(http.post("/v1/sessions", json={}), 201)["id"]
    rid = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {**LORA, "seed": 2}}), 201)["id"]

    step = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)
    assert step["status"] == "queued"
    held = expect(http.get(f"/v1/operations/{step['id']}", params={"wait": 1.5}), 200)
    assert held["status"] == "queued" and held["started_at"] is None  # seq 0 has not arrived

    fb = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(0)), 202)
    fb_done, step_done = poll(http, fb["id"]), poll(http, step["id"])
    assert fb_done["status"] == step_done["status"] == "succeeded"
    assert fb_done["finished_at"] <= step_done["started_at"]
    assert step_done["result"]["metrics"]["grad_norm"] > 0  # it saw seq 0's gradient
    ops = expect(http.get(f"/v1/runs/{rid}/operations"), 200)
    assert [(o["seq_id"], o["kind"]) for o in ops] == [(0, "forward_backward"), (1, "optim_step")]


# ---- 5. idempotent retries ------------------------------------------------------------------------


def test_retry_same_seq_id_is_idempotent(server, local):
    http = server.http()
    sid = expect(http.post("/v1/sessions", json={}), 201)["id"]
    rid = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {**LORA, "seed": 4}}), 201)["id"]

    body = fb_body(0)
    first = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=body), 202)
    again = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=copy.deepcopy(body)), 202)
    assert again["id"] == first["id"]

    other = fb_body(0, sft_batch(OTHER_EXAMPLES))
    refused = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=other), 409)
    assert refused["field"] == "seq_id"
    refused = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 0, "adam_params": ADAM}), 409)
    assert refused["field"] == "seq_id"

    result = succeeded(http, first["id"])
    late = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=body), 202)  # retry after it ran
    assert late["id"] == first["id"] and late["status"] == "succeeded" and late["result"] == result

    step = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)
    norm = succeeded(http, step["id"])["metrics"]["grad_norm"]
    assert len(expect(http.get(f"/v1/runs/{rid}/operations"), 200)) == 2
    # the gradient was accumulated once, not once per retry
    ref = local.new_run(**LORA, seed=4)
    assert rel_close(result["loss"], local.forward_backward(ref, engine_data(sft_batch())).loss)
    assert rel_close(norm, local.optim_step(ref, AdamParams(**ADAM))["grad_norm"])


# ---- 6. cancel, close, finish ---------------------------------------------------------------------


def new_run(http: httpx.Client, sid: str | None = None, seed: int = 0) -> tuple[str, str]:
    sid = sid or expect(http.post("/v1/sessions", json={}), 201)["id"]
    return sid, expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {"rank": 4, "seed": seed}}), 201)["id"]


def test_cancel_run_cancels_waiting_operations(server):
    http = server.http()
    _, rid = new_run(http)
    op0 = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(0)), 202)
    op2 = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(2)), 202)
    op3 = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 3, "adam_params": ADAM}), 202)
    succeeded(http, op0["id"])
    assert expect(http.get(f"/v1/operations/{op2['id']}"), 200)["status"] == "queued"

    assert expect(http.post(f"/v1/runs/{rid}/cancel"), 200)["status"] in ("cancelling", "cancelled")
    for op in (op2, op3):
        done = poll(http, op["id"])
        assert done["status"] == "cancelled" and done["error"]["code"] == "cancelled" and done["result"] is None
    until(lambda: run_status(http, rid) == "cancelled", 30, "run cancelled")
    assert expect(http.get(f"/v1/operations/{op0['id']}"), 200)["status"] == "succeeded"
    until(lambda: rid not in server.engine.runs, 10, "adapter freed")

    refused = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(1)), 409)
    assert refused["field"] == "run_id"
    expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 4, "adam_params": ADAM}), 409)
    expect(http.post(f"/v1/runs/{rid}/finish"), 409)
    assert run_status(http, rid) == "cancelled"


def test_close_session_cancels_its_runs(server):
    http = server.http()
    sid, waiting = new_run(http, seed=1)
    _, idle = new_run(http, sid, seed=2)
    _, done = new_run(http, sid, seed=3)
    other_sid, other = new_run(http, seed=4)
    queued = expect(http.post(f"/v1/runs/{waiting}/forward_backward", json=fb_body(1)), 202)
    expect(http.post(f"/v1/runs/{done}/finish"), 200)
    until(lambda: run_status(http, done) == "finished", 30, "run finished")

    assert expect(http.post(f"/v1/sessions/{sid}/close"), 200)["status"] == "closed"
    assert poll(http, queued["id"])["status"] == "cancelled"
    for rid in (waiting, idle):
        until(lambda: run_status(http, rid) == "cancelled", 30, f"run {rid} cancelled")
    assert run_status(http, done) == "finished"
    assert run_status(http, other) == "active"  # another session is untouched
    assert expect(http.post(f"/v1/sessions/{sid}/runs", json={}), 409)["field"] == "session_id"
    expect(http.post(f"/v1/sessions/{sid}/heartbeat"), 409)
    expect(http.post(f"/v1/runs/{idle}/forward_backward", json=fb_body(0)), 409)
    succeeded(http, expect(http.post(f"/v1/runs/{other}/forward_backward", json=fb_body(0)), 202)["id"])
    assert expect(http.get(f"/v1/sessions/{other_sid}"), 200)["status"] == "active"


def test_finish_runs_what_is_queued_and_cancels_after_a_gap(server):
    http = server.http()
    _, rid = new_run(http)
    op0 = expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(0)), 202)
    op1 = expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)
    op3 = expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(3)), 202)
    assert expect(http.post(f"/v1/runs/{rid}/finish"), 200)["status"] in ("finishing", "finished")
    expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(2)), 409)  # finishing takes nothing new
    assert poll(http, op0["id"])["status"] == "succeeded"
    assert poll(http, op1["id"])["status"] == "succeeded"
    gap = poll(http, op3["id"])
    assert gap["status"] == "cancelled" and gap["error"]["code"] == "cancelled"
    until(lambda: run_status(http, rid) == "finished", 30, "run finished")
    expect(http.post(f"/v1/runs/{rid}/finish"), 409)
    expect(http.post(f"/v1/runs/{rid}/cancel"), 200)
    assert run_status(http, rid) == "finished"  # cancelling a finished run changes nothing


# ---- 7. sampler versions are pinned ----------------------------------------------------------------


def test_sampler_versions_are_pinned(server):
    client = Client(server.url)
    http = server.http()
    run = client.create_session().create_run(**LORA, seed=11)
    prompt = [1, 523, 1077, 2889]
    train(run, 2, learning_rate=2e-2)
    v1 = run.save_weights_for_sampler().result()
    assert v1["version"] == 1 and v1["package"]["kind"] == "sampler"
    before = run.sample(prompt, 1, max_tokens=8, temperature=0.0).result()["sequences"][0]
    assert len(before["tokens"]) == len(before["logprobs"]) > 0

    train(run, 3, learning_rate=2e-2)
    assert run.save_weights_for_sampler().result()["version"] == 2
    after = run.sample(prompt, 1, max_tokens=8, temperature=0.0).result()["sequences"][0]
    assert after["tokens"] == before["tokens"]
    torch.testing.assert_close(after["logprobs"], before["logprobs"], atol=1e-6, rtol=0)
    newer = run.sample(prompt, 2, max_tokens=8, temperature=0.0).result()["sequences"][0]
    assert newer["tokens"] != before["tokens"] or \
        max(abs(a - b) for a, b in zip(newer["logprobs"], before["logprobs"])) > 1e-3

    sequence = prompt + before["tokens"]
    scored = {}
    for version in (1, 2):
        op = expect(http.post("/v1/logprobs", json={"run_id": run.id, "version": version,
                                                    "sequences": [sequence]}), 202)
        scored[version] = succeeded(http, op["id"])["logprobs"][0]
        assert scored[version][0] is None and len(scored[version]) == len(sequence)
    torch.testing.assert_close(scored[1][len(prompt):], before["logprobs"], atol=1e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(scored[2][1:], scored[1][1:])) > 1e-3
    # a version never saved: refused up front, or the operation fails naming it
    response = http.post("/v1/samples", json={"run_id": run.id, "version": 3, "prompt": prompt})
    assert response.status_code in (202, 404), response.text
    missing = poll(http, response.json()["id"]) if response.status_code == 202 else {"error": response.json()}
    assert missing["error"]["code"] == "not_found" and missing["error"]["field"] == "version"

    # the versions outlive the run
    run.finish()
    until(lambda: run.refresh()["status"] == "finished", 30, "run finished")
    late = run.sample(prompt, 1, max_tokens=8, temperature=0.0).result()["sequences"][0]
    assert late["tokens"] == before["tokens"]
    torch.testing.assert_close(late["logprobs"], before["logprobs"], atol=1e-5, rtol=0)


# ---- 8. two runs in one batch ----------------------------------------------------------------------


def test_mixed_run_batch_equals_each_run_alone(server, local):
    client = Client(server.url)
    session = client.create_session()
    specs = {"a": dict(rank=8, alpha=16.0, seed=21), "b": dict(rank=4, alpha=8.0, seed=22)}
    data = {"a": sft_batch(EXAMPLES), "b": sft_batch(OTHER_EXAMPLES)}
    runs = {k: session.create_run(**spec) for k, spec in specs.items()}

    # Hold the worker so both runs' seq 0 are queued when it next looks: it must batch them.
    scheduler = server.app.state.whitney.scheduler
    entered, gate = threading.Event(), threading.Event()
    held = scheduler.call(lambda: (entered.set(), gate.wait(30)))
    try:
        assert entered.wait(30), "the worker never took the call"
        fbs = {k: runs[k].forward_backward(data[k]) for k in runs}
        steps = {k: runs[k].optim_step(**ADAM) for k in runs}
    finally:
        gate.set()
    held.result(timeout=30)
    results = {k: fbs[k].result() for k in runs}
    metrics = {k: steps[k].result()["metrics"] for k in runs}
    a, b = fbs["a"].op, fbs["b"].op
    # One batch: both were marked running before either finished.
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"], (a, b)

    for k in runs:
        ref = local.new_run(**specs[k])
        alone = local.forward_backward(ref, engine_data(data[k]))
        assert rel_close(results[k]["loss"], alone.loss), (k, results[k]["loss"], alone.loss)
        for got, want in zip(results[k]["outputs"], alone.outputs):
            torch.testing.assert_close(got["logprobs"], want.logprobs, atol=1e-5, rtol=0)
        norm = local.optim_step(ref, AdamParams(**ADAM))["grad_norm"]
        assert rel_close(metrics[k]["grad_norm"], norm), (k, metrics[k]["grad_norm"], norm)
        assert_adapters_close(server.engine.runs[runs[k].id].adapter, local.runs[ref].adapter)


# ---- 9. restart --------------------------------------------------------------------------------------


def test_restart_keeps_results_and_interrupts_runs(make_server, tmp_path):
    data_dir = tmp_path / "restart-data"
    first = make_server(data_dir=data_dir)
    client = Client(first.url)
    run = client.create_session().create_run(**LORA, seed=31)
    train(run, 1)
    ckpt = run.save_state(name="before-restart").result()["package"]
    forward = run.forward(sft_batch()).result()  # seq 3
    completed = run.operations()
    assert [o["status"] for o in completed] == ["succeeded"] * 4
    http = first.http()
    stuck = expect(http.post(f"/v1/runs/{run.id}/forward_backward", json=fb_body(5)), 202)  # seq 4 never comes
    assert expect(http.get(f"/v1/operations/{stuck['id']}", params={"wait": 0.5}), 200)["status"] == "queued"
    http.close()
    client.http.close()
    first.stop()
    assert not first.thread.is_alive()

    second = make_server(data_dir=data_dir)
    http = second.http()
    for old in completed:
        now = expect(http.get(f"/v1/operations/{old['id']}"), 200)
        assert now == old
    failed = expect(http.get(f"/v1/operations/{stuck['id']}"), 200)
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
    assert expect(http.get(f"/v1/runs/{run.id}"), 200)["status"] == "interrupted"
    expect(http.post(f"/v1/runs/{run.id}/forward_backward", json=fb_body(4)), 409)
    assert expect(http.get(f"/v1/checkpoints/{ckpt['id']}"), 200)["id"] == ckpt["id"]

    client = Client(second.url)
    resumed = client.create_session().create_run(resume_from=ckpt["id"], with_optimizer=True)
    again = resumed.forward(sft_batch()).result()
    assert abs(again["loss"] - forward["loss"]) <= 1e-6 * abs(forward["loss"])
    losses, metrics = train(resumed, 1)
    assert metrics[0]["step"] == 2.0 and metrics[0]["grad_norm"] > 0
    assert losses[0] == pytest.approx(again["loss"], rel=1e-6)


# ---- 10. API keys ------------------------------------------------------------------------------------


def test_api_keys_isolate_owners(make_server):
    server = make_server(api_keys=["k1", "k2"])
    anonymous = server.http()
    body = expect(anonymous.get("/v1/sessions"), 401)
    assert body["code"] == "unauthorized"
    expect(anonymous.post("/v1/sessions", json={}), 401)
    expect(server.http("not-a-key").get("/v1/sessions"), 401)
    assert expect(anonymous.get("/v1/sessions", headers={"X-API-Key": "k1"}), 200) == []

    c1 = Client(server.url, api_key="k1")
    session = c1.create_session()
    run = session.create_run(rank=4, seed=1)
    fb = run.forward_backward(sft_batch())
    fb.result()
    ckpt = run.save_state().result()["package"]

    k2 = server.http("k2")
    for path in (f"/v1/sessions/{session.id}", f"/v1/sessions/{session.id}/runs", f"/v1/runs/{run.id}",
                 f"/v1/runs/{run.id}/operations", f"/v1/operations/{fb.id}", f"/v1/checkpoints/{ckpt['id']}",
                 f"/v1/checkpoints/{ckpt['id']}/archive"):
        assert expect(k2.get(path), 404)["code"] == "not_found", path
    expect(k2.get(f"/v1/operations/{fb.id}", params={"wait": 1.0}), 404)
    for path, payload in ((f"/v1/runs/{run.id}/forward_backward", fb_body(2)),
                          (f"/v1/runs/{run.id}/cancel", None), (f"/v1/runs/{run.id}/finish", None),
                          (f"/v1/sessions/{session.id}/close", None), (f"/v1/sessions/{session.id}/heartbeat", None),
                          (f"/v1/sessions/{session.id}/runs", {}),
                          ("/v1/samples", {"checkpoint_id": ckpt["id"], "prompt": [1, 2]}),
                          ("/v1/logprobs", {"checkpoint_id": ckpt["id"], "sequences": [[1, 2]]})):
        expect(k2.post(path, json=payload), 404)
    expect(k2.delete(f"/v1/checkpoints/{ckpt['id']}"), 404)
    own = expect(k2.post("/v1/sessions", json={}), 201)
    expect(k2.post(f"/v1/sessions/{own['id']}/runs",
                   json={"resume_from": {"checkpoint_id": ckpt["id"], "with_optimizer": False}}), 404)
    assert [s["id"] for s in expect(k2.get("/v1/sessions"), 200)] == [own["id"]]
    assert expect(k2.get("/v1/checkpoints"), 200) == []

    # k1 still owns everything, untouched
    assert [s["id"] for s in c1.list_sessions()] == [session.id]
    assert run.refresh()["status"] == "active"
    assert c1.get_checkpoint(ckpt["id"])["id"] == ckpt["id"]
    assert run.optim_step(**ADAM).result()["metrics"]["grad_norm"] > 0


# ---- 11. session expiry --------------------------------------------------------------------------------


def test_idle_session_expires_and_cancels_its_runs(make_server):
    server = make_server(session_timeout=1.0, expiry_interval=0.05)  # the reaper at each idle turn, not every 5 s
    http = server.http()
    sid, rid = new_run(http, seed=1)
    queued = expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(1)), 202)
    kept_sid, kept_rid = new_run(http, seed=2)

    def expired() -> bool:
        expect(http.post(f"/v1/sessions/{kept_sid}/heartbeat"), 200)  # this one stays alive
        return expect(http.get(f"/v1/sessions/{sid}"), 200)["status"] == "expired"

    deadline = time.monotonic() + 15
    while not expired():
        assert time.monotonic() < deadline, "session never expired"
        time.sleep(0.2)
    until(lambda: run_status(http, rid) == "cancelled", 10, "run of the expired session cancelled")
    assert poll(http, queued["id"])["status"] == "cancelled"
    expect(http.post(f"/v1/sessions/{sid}/heartbeat"), 409)
    expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(0)), 409)
    assert expect(http.get(f"/v1/sessions/{kept_sid}"), 200)["status"] == "active"
    assert run_status(http, kept_rid) == "active"


# ---- 12. forward_backward_custom -----------------------------------------------------------------------


def test_forward_backward_custom_equals_builtin(server):
    client = Client(server.url)
    session = client.create_session()
    custom_run = session.create_run(**LORA, seed=41)
    builtin_run = session.create_run(**LORA, seed=41)
    data = sft_batch()

    def minus_twice_weighted_logprob(batch, logprobs):
        total = sum(-2.0 * (lp * torch.tensor(d["loss_inputs"]["weights"]["values"], dtype=torch.float64)).sum()
                    for d, lp in zip(batch, logprobs))
        return total, {"custom_metric": 1.5}

    custom = custom_run.forward_backward_custom(data, minus_twice_weighted_logprob)
    doubled = copy.deepcopy(data)
    for d in doubled:
        d["loss_inputs"]["weights"]["values"] = [2.0 * w for w in d["loss_inputs"]["weights"]["values"]]
    builtin = builtin_run.forward_backward(doubled).result()
    assert rel_close(custom["loss"], builtin["loss"]), (custom["loss"], builtin["loss"])
    assert custom["metrics"]["custom_metric"] == 1.5

    got = custom_run.optim_step(**ADAM).result()["metrics"]
    want = builtin_run.optim_step(**ADAM).result()["metrics"]
    assert rel_close(got["grad_norm"], want["grad_norm"]), (got, want)
    assert_adapters_close(server.engine.runs[custom_run.id].adapter, server.engine.runs[builtin_run.id].adapter)
    assert [o["kind"] for o in custom_run.operations()] == ["forward", "forward_backward", "optim_step"]
