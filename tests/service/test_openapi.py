"""The OpenAPI document and docs/API.md describe exactly the routes the app serves, with their real schemas."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from tests.service.conftest import start_server
from whitney.service import schemas
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
    assert with_body == 13


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
