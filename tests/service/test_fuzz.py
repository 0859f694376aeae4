"""schemathesis against both published schemas on a real server: no 5xx, and every answer fits its schema.

Each operation of /openapi.json and of /api/v1/openapi.json gets a bounded number of derandomized
examples: valid requests (positive) with made-up path ids and with ids that exist (a session, a run,
an operation, a checkpoint, a sampler), so the fuzzer reaches past the 404, and requests the schema
refuses (negative) where there is a body or query to break. Each answer passes schemathesis's checks:
not a 5xx, a documented status, a documented content type, and a body that fits the documented
schema. Failures are collected, not shrunk, so the test stays bounded (under a minute on two cores)
and reports every failing operation at once. `pytest -s` prints the seconds each operation took.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.service.conftest import start_server
from whitney.service.app import ServiceConfig

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 15  # per operation and plan (valid with made-up ids, valid with existing ids, invalid)
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path_factory.mktemp("fuzz") / "data"))
    yield server
    server.stop()


def _done(http: httpx.Client, op_id: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        op = http.get(f"/v1/operations/{op_id}", params={"wait": 5}).json()
        if op["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            assert op["status"] == "succeeded", op
            return op


@pytest.fixture(scope="module")
def existing(srv) -> dict[str, dict[str, str]]:
    """Path ids that exist, per schema: a session, a run with an operation, a saved state, a sampler."""
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 2}}).json()["id"]
        op = http.post(f"/v1/runs/{run}/forward_backward", json={"seq_id": 0, "data": [
            {"input": {"token_ids": [1, 2, 3]},
             "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [3], "values": [2, 3, 4]}}}]}).json()["id"]
        saved = _done(http, http.post(f"/v1/runs/{run}/save_state", json={"seq_id": 1, "name": "fuzz"}).json()["id"])
        native = {"session_id": session, "run_id": run, "op_id": op, "package_id": saved["result"]["package"]["id"]}

        api = "/api/v1"
        t_session = http.post(f"{api}/create_session", json={}).json()["session_id"]
        model = http.post(f"{api}/create_model", json={
            "session_id": t_session, "model_seq_id": 0, "base_model": srv.config.models[0],
            "lora_config": {"rank": 2}}).json()["model_id"]
        saved = http.post(f"{api}/save_weights", json={"model_id": model, "seq_id": 1, "path": "fuzz"}).json()
        _done(http, saved["request_id"])
        sampler = http.post(f"{api}/create_sampling_session", json={
            "session_id": t_session, "sampling_session_seq_id": 0,
            "base_model": srv.config.models[0]}).json()["sampling_session_id"]
        tinker = {"session_id": t_session, "run_id": model, "checkpoint_id": "weights/fuzz", "sampler_id": sampler}
    return {"/openapi.json": native, "/api/v1/openapi.json": tinker}


def fuzz_operation(operation, base_url: str, ids: dict[str, str]) -> list[str]:
    """Run the bounded examples of one operation; return what failed (each failure once)."""
    failures: dict[str, str] = {}
    path_names = {p.name for p in operation.path_parameters}
    known = {k: v for k, v in ids.items() if k in path_names} or None
    # Valid requests with made-up ids and with existing ones; invalid bodies and queries with existing ids
    # (an invalid path id is only a 404, and negating a free-form string is slow for hypothesis).
    plan = [(POSITIVE, None)] + ([(POSITIVE, known)] if known else [])
    if len(operation.body) or len(operation.query):
        plan.append((NEGATIVE, known))
    for mode, fixed in plan:
        @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed))
        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call(base_url=base_url, timeout=60)
            try:
                case.validate_response(response, checks=CHECKS)
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001  (collected: all are reported at once)
                text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
                kinds = " ".join(line for line in text if line.startswith("- ")) or type(e).__name__
                failures.setdefault(kinds,
                                    f"{operation.label} [{mode.value}]: {response.status_code} {response.text[:300]!r}"
                                    f"\n  {' / '.join(text[:6])}\n  request: {case.method} {case.formatted_path} "
                                    f"{str(case.body)[:300]}")

        try:
            run()
        except Unsatisfiable:  # a negative plan with nothing left to make invalid
            if mode != NEGATIVE:
                raise
    return list(failures.values())


def ends_something(operation) -> bool:
    """Operations that end the existing session, run or checkpoint go last, so the others reach them alive."""
    return operation.method.upper() == "DELETE" or operation.path.rsplit("/", 1)[-1] in ("close", "finish", "cancel")


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")  # schemathesis's own
@pytest.mark.parametrize("spec_path", ["/openapi.json", "/api/v1/openapi.json"])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(srv, existing, spec_path):
    with srv.http() as http:
        raw: dict[str, Any] = http.get(spec_path).json()
    schema = schemathesis.openapi.from_dict(raw)
    base_url = srv.url + spec_path.removesuffix("/openapi.json")
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=ends_something)
    failures = []
    for operation in operations:
        started = time.monotonic()
        failures += fuzz_operation(operation, base_url, existing[spec_path])
        print(f"{time.monotonic() - started:6.2f}s {operation.label}")
    assert len(operations) >= 25, len(operations)
    assert not failures, "\n".join(failures)
