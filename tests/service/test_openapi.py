"""The OpenAPI document and docs/API.md describe exactly the routes the app serves, with their real schemas."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from tests.service.conftest import start_server
from whitney.service.api.native import schemas
from whitney.service.app import ServiceConfig

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
METHODS = "GET|POST|PUT|PATCH|DELETE"
ROUTE_HEADING = re.compile(rf"^#+\s+`?({METHODS}) (/\S*?)`?\s*$")  # "### `POST /v1/sessions`"
ROUTE_MENTION = re.compile(rf"\b({METHODS}) (/v1/[^\s`)\"',?]*)")  # a query string is not part of the route


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path_factory.mktemp("openapi") / "data"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spec(srv) -> dict:
    with srv.http() as http:
        r = http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def api_routes(app) -> dict[tuple[str, str], APIRoute]:
    """(METHOD, path) -> route for every API route of the app, however this FastAPI nests included routers."""
    try:
        from fastapi.routing import iter_route_contexts
        pairs = [(c.original_route, c.path_format) for c in iter_route_contexts(app.routes)]
    except ImportError:  # older FastAPI: included routes are plain APIRoutes of the app
        pairs = [(r, getattr(r, "path_format", None)) for r in app.routes]
    out = {}
    for route, path in pairs:
        if isinstance(route, APIRoute):
            for method in route.methods:
                out[(method, path)] = route
    return out


def body_model(route: APIRoute) -> type[BaseModel] | None:
    field = route.body_field
    return None if field is None else field.field_info.annotation


def resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """The model and every request model reachable through its fields (lora -> LoraSpec, data -> WireDatum...)."""
    seen: list[type[BaseModel]] = []

    def walk(tp) -> None:
        if isinstance(tp, type) and issubclass(tp, schemas.Wire):
            if tp not in seen:
                seen.append(tp)
                for f in tp.model_fields.values():
                    walk(f.annotation)
        for arg in typing.get_args(tp):
            walk(arg)

    walk(model)
    return seen


def doc_sections() -> dict[tuple[str, str], str]:
    """The text under each route heading of docs/API.md, up to the next heading of any route or chapter."""
    sections: dict[tuple[str, str], str] = {}
    current = None
    for line in API_MD.read_text().splitlines():
        m = ROUTE_HEADING.match(line)
        if m:
            current = (m.group(1), m.group(2))
            assert current not in sections, f"{current} is documented twice"
            sections[current] = ""
        elif line.startswith("#") and not line.startswith("####"):
            current = None
        elif current is not None:
            sections[current] += line + "\n"
    return sections


# ---- the OpenAPI document ----------------------------------------------------------------------------

def test_openapi_lists_every_route(srv, spec):
    routes = api_routes(srv.app)
    assert len(routes) >= 28  # sessions, runs, nine training operations, polling, sampling, checkpoints
    documented = {(m.upper(), path) for path, ops in spec["paths"].items() for m in ops}
    assert documented == set(routes)


def test_request_bodies_are_the_real_schemas(srv, spec):
    """Each body route's requestBody is its pydantic model: same fields, same required ones, no extras allowed."""
    with_body = 0
    for (method, path), route in api_routes(srv.app).items():
        op = spec["paths"][path][method.lower()]
        model = body_model(route)
        if model is None:
            assert "requestBody" not in op, (method, path)
            continue
        with_body += 1
        schema = resolve(spec, op["requestBody"]["content"]["application/json"]["schema"])
        assert set(schema["properties"]) == set(model.model_fields), (method, path)
        required = {name for name, f in model.model_fields.items() if f.is_required()}
        assert set(schema.get("required", [])) == required, (method, path)
        assert schema.get("additionalProperties") is False, f"{path}: unknown fields must be refused"
        assert str(route.status_code) in op["responses"], (method, path)
    assert with_body == 22  # POST /v1/runs/{run_id}/samples is the 22nd


def test_key_request_schemas(spec):
    def props(name: str) -> dict:
        return spec["components"]["schemas"][name]["properties"]

    fp = props("ForwardPayload")
    assert {"seq_id", "data", "loss_function", "loss_config"} <= set(fp)
    assert fp["loss_function"]["default"] == "cross_entropy" and fp["data"]["minItems"] == 1
    assert fp["seq_id"]["minimum"] == 0
    datum = resolve(spec, fp["data"]["items"])
    assert set(datum["properties"]) == {"input", "loss_inputs"}
    assert "token_ids" in resolve(spec, datum["properties"]["input"])["properties"]
    tensor = resolve(spec, datum["properties"]["loss_inputs"]["additionalProperties"])
    assert set(tensor["properties"]) == {"dtype", "shape", "values"}
    assert set(tensor["properties"]["dtype"]["enum"]) == {"int64", "int32", "float32", "float64"}

    sample = props("SampleRequest")
    assert {"prompt", "num_samples", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
            "prompt_logprobs", "topk_prompt_logprobs", "run_id", "version", "checkpoint_id", "base_model"} <= set(sample)
    assert sample["temperature"]["default"] == 1.0 and sample["top_p"]["default"] == 1.0
    assert set(props("LogprobsRequest")) == {"sequences", "run_id", "version", "checkpoint_id", "base_model"}

    adam = resolve(spec, props("OptimStep")["adam_params"])
    assert set(adam["properties"]) == {"learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                       "gradient_clip_norm", "lora_plus_ratio", "gradient_scale"}
    lora = resolve(spec, props("RunCreate")["lora"])
    assert {"rank", "alpha", "train_attn", "train_mlp", "train_unembed", "target_modules"} <= set(lora["properties"])
    for name in ("SaveState", "SaveWeights", "ExportLora"):
        assert props(name)["name"]["pattern"] == r"^[A-Za-z0-9._-]+$", name
    assert set(props("LoadState")) == {"seq_id", "checkpoint_id"}


def test_long_poll_parameter(spec):
    params = {p["name"]: p for p in spec["paths"]["/v1/operations/{op_id}"]["get"]["parameters"]}
    wait = params["wait"]
    assert wait["in"] == "query" and not wait["required"]
    assert wait["schema"]["minimum"] == 0 and wait["schema"]["maximum"] == 30 and wait["schema"]["default"] == 0


def test_error_responses_are_documented_as_they_are_sent(srv, spec):
    """Every route documents its 4xx as the Error body, and real 4xx bodies fit that schema."""
    error = spec["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"code", "message"}
    assert {"field", "datum_index"} <= set(error["properties"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # FastAPI's 422 shape is not what we send
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status in ("400", "404", "409", "422"):
                schema = op["responses"].get(status, {}).get("content", {}).get("application/json", {}).get("schema")
                assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
    with srv.http() as http:
        bodies = [http.post("/v1/sessions", json={"bogus": 1}), http.get("/v1/runs/run-nope"),
                  http.post("/v1/samples", json={"prompt": []})]
    for r in bodies:
        assert 400 <= r.status_code < 500
        body = r.json()
        assert set(body) <= set(error["properties"]), body
        assert set(error["required"]) <= set(body), body


# ---- docs/API.md ---------------------------------------------------------------------------------------

def test_docs_cover_every_route_and_no_other(srv):
    sections = doc_sections()
    assert set(sections) == set(api_routes(srv.app))
    for key, text in sections.items():
        assert text.strip(), f"{key} has no description"
    for line_no, line in enumerate(API_MD.read_text().splitlines(), 1):
        for method, path in ROUTE_MENTION.findall(line):
            assert (method, path) in sections, f"docs/API.md:{line_no} mentions {method} {path}, which is no route"


def test_docs_name_every_request_field(srv):
    """Each route's section names every field of its body, nested ones (lora.rank, adam_params.eps...) too."""
    sections = doc_sections()
    named = 0
    for key, route in api_routes(srv.app).items():
        for param in route.dependant.query_params:
            assert f"`{param.name}`" in sections[key], f"{key[0]} {key[1]}: the doc does not name `{param.name}`"
            named += 1
        model = body_model(route)
        for m in nested_models(model) if model is not None else []:
            for name in m.model_fields:
                assert f"`{name}`" in sections[key], f"{key[0]} {key[1]}: the doc does not name `{name}` ({m.__name__})"
                named += 1
    assert named >= 70  # the walk did reach the nested models (lora, adam_params, datums, tensors)


def test_docs_describe_errors_and_long_polling():
    text = API_MD.read_text()
    for code in ("invalid_input", "unauthorized", "not_found", "conflict", "too_large", "invalid_request"):
        assert f"`{code}`" in text, code
    for word in ("`datum_index`", "`field`", "`wait`", "30"):
        assert word in text, word


# ---- what the schema states is what the server enforces -------------------------------------------

def test_enforced_constraints_are_published(spec):
    """The rules the server can state without the model are in the schema: ranges, non-empty lists, 2**63 - 1."""
    def props(name: str) -> dict:
        return spec["components"]["schemas"][name]["properties"]

    for name in ("ForwardPayload", "OptimStep", "SaveState", "LoadState", "SaveWeights", "ExportLora",
                 "SaveForSampler"):
        seq = props(name)["seq_id"]
        assert seq["type"] == "integer" and seq["minimum"] == 0, name
        # an integer in the JSON text, not 9.223372036854776e+18 (nor 2**63 - 1 rounded up to 2**63)
        assert type(seq["exclusiveMaximum"]) is int and seq["exclusiveMaximum"] == 2**63, (name, seq)
        assert type(seq["minimum"]) is int, (name, seq)
    token_ids = props("ModelInput")["token_ids"]["anyOf"]
    assert token_ids[0]["minItems"] == 1 and token_ids[0]["items"]["minimum"] == 0
    assert token_ids[1]["minItems"] == 1 and token_ids[1]["items"]["minItems"] == 1
    # a prompt or scored sequence: token ids, or typed chunks (text and images); non-empty either way
    assert [b["minItems"] for b in props("SampleRequest")["prompt"]["oneOf"]] == [1, 1]
    assert props("LogprobsRequest")["sequences"]["minItems"] == 1
    assert [b["minItems"] for b in props("LogprobsRequest")["sequences"]["items"]["oneOf"]] == [1, 1]

    adam = props("AdamSpec")
    assert adam["learning_rate"]["exclusiveMinimum"] == 0 and adam["eps"]["exclusiveMinimum"] == 0
    for beta in ("beta1", "beta2"):
        assert adam[beta]["minimum"] == 0 and adam[beta]["exclusiveMaximum"] == 1
    assert adam["weight_decay"]["minimum"] == 0 and adam["gradient_clip_norm"]["minimum"] == 0
    assert adam["lora_plus_ratio"]["exclusiveMinimum"] == 0 and adam["gradient_scale"]["exclusiveMinimum"] == 0

    sample = props("SampleRequest")
    assert sample["max_tokens"]["minimum"] == 1 and sample["num_samples"]["minimum"] == 1
    assert sample["temperature"]["minimum"] == 0 and sample["top_k"]["minimum"] == -1
    assert sample["top_p"]["exclusiveMinimum"] == 0 and sample["top_p"]["maximum"] == 1
    assert sample["topk_prompt_logprobs"]["minimum"] == 0 and sample["topk_prompt_logprobs"]["maximum"] == 100
    assert sample["seed"]["anyOf"][0]["exclusiveMaximum"] == 2**63

    lora = props("LoraSpec")
    assert lora["rank"]["minimum"] == 1 and lora["alpha"]["exclusiveMinimum"] == 0
    assert lora["seed"]["minimum"] == 0 and lora["seed"]["exclusiveMaximum"] == 2**63


@pytest.fixture(scope="module")
def run_id(srv) -> str:
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        return http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 2}}).json()["id"]


DATUM = {"input": {"token_ids": [1, 2, 3]},
         "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [3], "values": [2, 3, 4]}}}


def weighted(values: list) -> dict:
    return {"seq_id": 0, "data": [{**DATUM, "loss_inputs": {**DATUM["loss_inputs"], "weights": {
        "dtype": "float32", "shape": [3], "values": values}}}]}


@pytest.mark.parametrize("route, body, field", [
    ("forward", {"seq_id": True, "data": [DATUM]}, "seq_id"),  # not seq 1
    ("forward", {"seq_id": "0", "data": [DATUM]}, "seq_id"),  # not seq 0
    ("forward", {"seq_id": 0.0, "data": [DATUM]}, "seq_id"),
    ("forward", weighted([False, True, True]), "weights.values"),  # not 0.0 and 1.0
    ("forward", weighted(["1", "1", "1"]), "weights.values"),
    ("forward", {"seq_id": 0, "data": [{**DATUM, "input": {"token_ids": [True, 2, 3]}}]}, "token_ids"),
    ("forward", {"seq_id": 0, "data": [{**DATUM, "input": {"token_ids": []}}]}, "token_ids"),
    ("forward", {"seq_id": 0, "data": [{**DATUM, "input": {"token_ids": [[1, 2], []]}}]}, "token_ids"),
    ("forward", {"seq_id": 2**63, "data": [DATUM]}, "seq_id"),
    ("optim_step", {"seq_id": 0, "adam_params": {"learning_rate": "0.1"}}, "adam_params.learning_rate"),
    ("optim_step", {"seq_id": 0, "adam_params": {"beta1": True}}, "adam_params.beta1"),
    ("optim_step", {"seq_id": 0, "adam_params": {"beta2": 1.0}}, "adam_params.beta2"),
    ("optim_step", {"seq_id": 0, "adam_params": {"eps": 0}}, "adam_params.eps"),
    ("save_state", {"seq_id": 0, "include_optimizer": 1}, "include_optimizer"),
])
def test_wire_types_are_strict_and_ranges_enforced(srv, run_id, route, body, field):
    """A JSON boolean is no number and a string no integer (no coercion), and a published range is a 422."""
    with srv.http() as http:
        r = http.post(f"/v1/runs/{run_id}/{route}", json=body)
        assert r.status_code == 422, r.text
        assert field in r.json()["field"], r.json()
        assert http.get(f"/v1/runs/{run_id}/operations").json() == []  # nothing was queued


@pytest.mark.parametrize("path, body, field", [
    ("/v1/samples", {"prompt": [1], "num_samples": True}, "num_samples"),
    ("/v1/samples", {"prompt": [1], "temperature": "0.5"}, "temperature"),
    ("/v1/samples", {"prompt": [1], "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/samples", {"prompt": [1], "top_p": 0}, "top_p"),
    ("/v1/samples", {"prompt": [1], "topk_prompt_logprobs": 101}, "topk_prompt_logprobs"),
    ("/v1/samples", {"prompt": [1], "seed": 2**63}, "seed"),
    ("/v1/logprobs", {"sequences": [[1, 2], []]}, "sequences"),
])
def test_sampling_types_are_strict(srv, path, body, field):
    with srv.http() as http:
        r = http.post(path, json=body)
    assert r.status_code == 422 and field in r.json()["field"], r.text


def test_floats_accept_json_integers(srv):
    """An integer is a number: learning_rate 1 and temperature 0 are floats on the wire."""
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 2, "alpha": 4}})
        assert run.status_code == 201, run.text
        step = http.post(f"/v1/runs/{run.json()['id']}/optim_step",
                         json={"seq_id": 0, "adam_params": {"learning_rate": 1, "weight_decay": 0, "beta1": 0}})
        assert step.status_code == 202, step.text
        sample = http.post("/v1/samples", json={"prompt": [1, 2], "temperature": 0, "top_p": 1, "max_tokens": 1})
        assert sample.status_code == 202, sample.text


def test_tinker_bodies_are_strict(srv):
    """The Tinker routes accept unknown fields, but a known one is not coerced either."""
    with srv.http() as http:
        r = http.post("/api/v1/create_session", json={"user_metadata": {}, "tags": ["a"], "some_new_field": 1})
        assert r.status_code == 200, r.text
        session = r.json()["session_id"]
        for body, field in (({"session_id": session, "model_seq_id": True, "base_model": srv.config.models[0]},
                             "model_seq_id"),
                            ({"session_id": session, "model_seq_id": "0", "base_model": srv.config.models[0]},
                             "model_seq_id")):
            r = http.post("/api/v1/create_model", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["code"] == "invalid_request" and field in r.json()["field"], r.json()


# ---- methods: OPTIONS and Allow -----------------------------------------------------------------------

def allow(response) -> set[str]:
    return {m.strip() for m in response.headers["allow"].split(",")}


def test_options_lists_every_method_of_every_path(srv, spec):
    """OPTIONS on each documented path (native and Tinker) answers 204 with every method of the path."""
    with srv.http() as http:
        tinker_spec = http.get("/api/v1/openapi.json").json()
        for prefix, paths in (("", spec["paths"]), ("/api/v1", tinker_spec["paths"])):
            for path, ops in paths.items():
                url = prefix + re.sub(r"\{[^}]+\}", "x", path)
                r = http.options(url)
                assert r.status_code == 204, (url, r.status_code)
                # every documented path the URL matches (/sessions/search is also /sessions/{session_id}; a Tinker
                # checkpoint id holds a slash, so {checkpoint_id} is a path converter: .../x/ttl is one too)
                alike = [o for p, o in paths.items() if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", p.replace(
                    "{checkpoint_id}", ".+")), url[len(prefix):])]
                assert allow(r) == {m.upper() for o in alike for m in o} | {"OPTIONS"}, (url, r.headers["allow"])
        assert http.options("/v1/no/such/path").status_code == 404


@pytest.mark.parametrize("method, path, methods", [
    ("PUT", "/v1/checkpoints/pkg-x", {"GET", "DELETE", "PATCH"}),  # several routes on one path: all named
    ("POST", "/v1/checkpoints/pkg-x", {"GET", "DELETE", "PATCH"}),
    ("DELETE", "/v1/sessions", {"GET", "POST"}),
    ("GET", "/v1/runs/run-x/forward_backward", {"POST"}),
    ("GET", "/api/v1/create_session", {"POST"}),
    ("POST", "/api/v1/training_runs/run-x/checkpoints/weights/a", {"DELETE"}),
    ("HEAD", "/v1/sessions", {"GET", "POST"}),  # a GET route does not answer HEAD, and says so
])
def test_wrong_method_is_405_with_every_allowed_method(srv, method, path, methods):
    with srv.http() as http:
        r = http.request(method, path)
    assert r.status_code == 405, r.status_code
    assert allow(r) == methods | {"OPTIONS"}, r.headers["allow"]
    if method != "HEAD":
        assert r.json()["code"] == "method_not_allowed", r.text


# ---- the Tinker sub-app's document ---------------------------------------------------------------------

def test_tinker_documents_its_errors(srv):
    """Every Tinker route documents its 4xx as the Error body they are sent with; 408 and 410 where they occur."""
    with srv.http() as http:
        tinker_spec = http.get("/api/v1/openapi.json").json()
        assert "HTTPValidationError" not in tinker_spec["components"]["schemas"]
        error = tinker_spec["components"]["schemas"]["Error"]
        for path, ops in tinker_spec["paths"].items():
            for method, op in ops.items():
                for status in ("400", "401", "404", "413", "422", "429"):
                    schema = op["responses"][status]["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
        assert "408" in tinker_spec["paths"]["/retrieve_future"]["post"]["responses"]
        assert "application/x-protobuf" in tinker_spec["paths"]["/retrieve_future"]["post"]["responses"]["200"]["content"]
        assert "410" in tinker_spec["paths"]["/session_heartbeat"]["post"]["responses"]
        bodies = [http.post("/api/v1/create_model", json={"session_id": 1}),
                  http.post("/api/v1/get_info", json={"model_id": "nope"}), http.get("/api/v1/nope"),
                  http.post("/api/v1/weights_info", json={"tinker_path": "nope"})]
    for r in bodies:
        assert 400 <= r.status_code < 500, r.status_code
        body = r.json()
        assert set(body) <= set(error["properties"]) and set(error["required"]) <= set(body), body
