"""The wire protocol at the HTTP level, where the SDK hides it: long polls, seq_id order, auth, heartbeats."""

from __future__ import annotations

import random
import threading
import tracemalloc

import httpx
import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.service.conftest import start_server
from tests.tinker.conftest import API_KEY
from tests.tinker.helpers import arrays, tinker_data
from whitney.service.api.tinker import futures, proto
from whitney.service.app import ServiceConfig
from whitney.service.scheduling.limits import Limits

PROTO = {"Content-Type": "application/x-protobuf"}


def raw(url: str, key: str = API_KEY) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def fb_body(model_id: str, seq_id: int) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=tinker_data(arrays("cross_entropy")),
                                                          loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_out_of_order_requests_wait_for_their_turn(tinker_env, tiny_llama, monkeypatch):
    """seq 3 arrives first and is pending (408 try_again) until 1 and 2 have arrived and run."""
    monkeypatch.setattr(futures, "MAX_WAIT", 0.2)
    proto = PROTO
    with raw(tinker_env.url) as http:
        session_id = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}
                               ).json()["session_id"]
        created = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                   "base_model": tiny_llama, "lora_config": {"rank": 4, "seed": 1},
                                                   "future_field": "ignored"}).json()
        model_id = created["model_id"]
        assert model_id == f"{session_id}:train:0"
        third = http.post("/forward_backward", content=fb_body(model_id, 3), headers=proto).json()["request_id"]
        pending = http.post("/retrieve_future", json={"request_id": third})
        assert pending.status_code == 408 and pending.json()["type"] == "try_again"
        second = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                "adam_params": {"learning_rate": 0.01, "grad_clip_norm": 0.0}})
        first = http.post("/forward_backward", content=fb_body(model_id, 1), headers=proto).json()["request_id"]
        monkeypatch.setattr(futures, "MAX_WAIT", 30.0)
        results = [http.post("/retrieve_future", json={"request_id": r}) for r in
                   (first, second.json()["request_id"], third)]
        assert [r.status_code for r in results] == [200, 200, 200]
        assert results[0].headers["content-type"] == "application/x-protobuf"
        assert "grad_norm" in results[1].json()["metrics"]
        from tinker.proto.response_conv import deserialize_forward_backward_output

        before, after = (deserialize_forward_backward_output(r.content) for r in (results[0], results[2]))
        assert before.metrics["loss:sum"] != after.metrics["loss:sum"]  # the step ran between them
        assert np.isfinite(after.metrics["loss:sum"])
        # The session ends: heartbeats are then answered 410, which stops the SDK's heartbeat loop.
        assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 200
        assert http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}}).status_code == 200
        assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410


def test_api_keys(tmp_path, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path / "data", api_keys=[API_KEY]))
    try:
        with raw(server.url) as http:
            assert http.post("/create_session", json={"tags": []}).status_code == 200
        with raw(server.url, "tml-wrong") as http:
            assert http.post("/create_session", json={"tags": []}).status_code == 401
    finally:
        server.stop()


@pytest.mark.parametrize("body,status", [
    ({"model_id": "ses-x:train:0", "seq_id": 1, "adam_params": {}}, 404),
    ({"model_id": "ses-x:train:0", "seq_id": 0, "adam_params": {}}, 400),
])
def test_bad_requests_are_4xx(tinker_env, body, status):
    with raw(tinker_env.url) as http:
        assert http.post("/optim_step", json=body).status_code == status


# ---- malformed bodies: every one a 4xx naming its field, on a connection that stays usable ----------

def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return key(number, 2) + _varint(len(payload)) + payload


def vi(number: int, v: int) -> bytes:
    return key(number, 0) + _varint(v)


def tensor(dtype: int = 1, shape: list[int] | None = None, dense: bytes | None = None,
           csr: tuple[bytes, list[int], list[int]] | None = None) -> bytes:
    """A Tensor message: dtype 1 float32, 2 int64; csr = (values, crow_indices, col_indices)."""
    out = vi(3, dtype) + (ld(4, b"".join(_varint(s) for s in shape)) if shape is not None else b"")
    if dense is not None:
        out += ld(1, dense)
    if csr is not None:
        values, crow, col = csr
        out += ld(2, ld(1, values) + ld(2, np.array(crow, "<i8").tobytes()) + ld(3, np.array(col, "<i8").tobytes()))
    return out


def datum(tokens: list[int] = (1, 2, 3), **inputs: bytes) -> bytes:
    """A Datum: one token chunk and the given loss inputs (name -> Tensor message)."""
    chunk = ld(1, ld(1, ld(1, np.array(tokens, "<i4").tobytes())))
    return chunk + b"".join(ld(2, ld(1, name.encode()) + ld(2, t)) for name, t in inputs.items())


def f32(values: list[float]) -> bytes:
    return np.array(values, "<f4").tobytes()


# (id, what is appended to a valid request, the field named, the datum index named). The valid request has
# 2 datums, so an appended datum is data[2]. A field given again overrides (scalars) or adds (repeated).
MALFORMED = [
    ("model_id_as_varint", vi(1, 5), "model_id", None),
    ("model_id_invalid_utf8", ld(1, b"\xff\xfe"), "model_id", None),
    ("model_id_utf8_encoded_surrogate", ld(1, b"ses-\xed\xb2\x80"), "model_id", None),
    ("seq_id_as_bytes", ld(2, b"\x01"), "seq_id", None),
    ("seq_id_as_fixed64", key(2, 1) + b"\x01" * 8, "seq_id", None),
    ("loss_fn_invalid_utf8", ld(4, b"cross\xff"), "loss_fn", None),
    ("forward_only_as_bytes", ld(6, b"\x01"), "forward_only", None),
    ("loss_config_value_as_varint", ld(5, ld(1, b"beta") + vi(2, 3)), "loss_fn_config.beta", None),
    ("loss_config_value_truncated_fixed64", ld(5, ld(1, b"beta") + key(2, 1) + b"\x00\x00\x00"),
     "loss_fn_config", None),
    ("loss_config_key_as_varint", ld(5, vi(1, 1)), "loss_fn_config", None),
    ("loss_config_v2_text_invalid_utf8", ld(7, ld(1, b"k") + ld(2, ld(2, b"\xff"))), "loss_fn_config_v2.k", None),
    ("loss_config_v2_number_as_bytes", ld(7, ld(1, b"k") + ld(2, ld(1, b"12345678"))), "loss_fn_config_v2.k",
     None),
    ("loss_config_v2_value_as_varint", ld(7, ld(1, b"k") + vi(2, 1)), "loss_fn_config_v2.k", None),
    ("truncated_fixed64", key(9, 1) + b"\x00\x00", "body", None),
    ("truncated_fixed32", key(9, 5) + b"\x00", "body", None),
    ("truncated_length", key(9, 2) + _varint(1000) + b"ab", "body", None),
    ("varint_over_10_bytes", key(9, 0) + b"\xff" * 11, "body", None),
    ("group_wire_type", key(9, 3), "body", None),
    ("datum_as_varint", vi(3, 7), "data[2]", 2),
    ("model_input_as_varint", ld(3, vi(1, 3)), "data[2].model_input", 2),
    ("tokens_not_whole_int32", ld(3, ld(1, ld(1, ld(1, b"\x01\x02\x03")))), "data[2].model_input", 2),
    ("tokens_as_varint", ld(3, ld(1, ld(1, vi(1, 3)))), "data[2].model_input.encoded_text.tokens", 2),
    ("image_chunk", ld(3, ld(1, ld(2, b""))), "data[2].model_input", 2),
    ("loss_input_name_invalid_utf8", ld(3, datum() + ld(2, ld(1, b"\xffw") + ld(2, tensor(1, [3], f32([1] * 3))))),
     "data[2].loss_fn_inputs", 2),
    ("loss_input_as_varint", ld(3, datum() + vi(2, 1)), "data[2].loss_fn_inputs", 2),
    ("tensor_as_varint", ld(3, datum() + ld(2, ld(1, b"weights") + vi(2, 1))), "data[2].loss_fn_inputs.weights", 2),
    ("dtype_as_bytes", ld(3, datum(weights=ld(3, b"\x01") + ld(1, f32([1] * 3)))),
     "data[2].loss_fn_inputs.weights.dtype", 2),
    ("dtype_bfloat16", ld(3, datum(weights=tensor(4, [3], b"\0" * 6))), "data[2].loss_fn_inputs.weights", 2),
    ("dtype_missing", ld(3, datum(weights=ld(1, f32([1] * 3)))), "data[2].loss_fn_inputs.weights", 2),
    ("dense_bytes_not_whole_float32", ld(3, datum(weights=tensor(1, [3], b"\0" * 11))),
     "data[2].loss_fn_inputs.weights", 2),
    ("dense_not_filling_shape", ld(3, datum(weights=tensor(1, [4], f32([1] * 3)))),
     "data[2].loss_fn_inputs.weights", 2),
    ("dense_three_dims", ld(3, datum(weights=tensor(1, [3, 1, 1], f32([1] * 3)))),
     "data[2].loss_fn_inputs.weights", 2),
    ("shape_negative", ld(3, datum(weights=tensor(1, [-3], f32([1] * 3)))), "data[2].loss_fn_inputs.weights", 2),
    ("shape_as_fixed32", ld(3, datum(weights=tensor(1, None, f32([1] * 3)) + key(4, 5) + b"\x03\0\0\0")),
     "data[2].loss_fn_inputs.weights.shape", 2),
    # A sparse tensor of declared shape [1, 10^8] in a 100-byte body allocated 1.5 GB before it was checked.
    ("sparse_huge_shape", ld(3, datum([1], weights=tensor(1, [1, 10**8], csr=(f32([1.0]), [0, 1], [5])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_k_above_max", ld(3, datum([1], weights=tensor(1, [1, 257], csr=(f32([1.0]), [0, 1], [5])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_rows_not_tokens", ld(3, datum([1, 2, 3], weights=tensor(1, [5, 2], csr=(f32([]), [0] * 6, [])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_one_dim", ld(3, datum([1, 2, 3], weights=tensor(1, [3], csr=(f32([1.0]), [0, 1], [0])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_crow_decreasing", ld(3, datum([1, 2, 3], weights=tensor(1, [3, 2], csr=(f32([1, 1]), [0, 2, 1, 2],
                                                                                       [0, 1])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_crow_beyond_values", ld(3, datum([1, 2, 3], weights=tensor(1, [3, 2], csr=(f32([1]), [0, 10**9, 1, 1],
                                                                                          [0])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_column_out_of_range", ld(3, datum([1, 2, 3], weights=tensor(1, [3, 2], csr=(f32([1]), [0, 1, 1, 1],
                                                                                           [2])))),
     "data[2].loss_fn_inputs.weights", 2),
    ("sparse_indices_as_varint", ld(3, datum([1], weights=vi(3, 1) + ld(4, _varint(1) + _varint(2)) + ld(2, vi(2, 0)))),
     "data[2].loss_fn_inputs.weights.sparse_csr", 2),
]


def new_model(url: str, base_model: str) -> str:
    """A fresh Tinker model (its seq_ids start at 1)."""
    with raw(url) as http:
        session_id = http.post("/create_session", json={"tags": []}).json()["session_id"]
        return http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": base_model,
                                                "lora_config": {"rank": 4, "seed": 1}}).json()["model_id"]


def client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_malformed_protobuf_is_a_400_naming_the_field(tinker_env, tiny_llama):
    """Each malformed body is a 400 {code invalid_input, field, datum_index}, answered without allocating from
    a declared shape (the process's peak traced allocation per refusal), on one keep-alive connection that then
    serves a valid request."""
    assert len({m[0] for m in MALFORMED}) == len(MALFORMED) >= 40
    base = fb_body(new_model(tinker_env.url, tiny_llama), 1)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=f"{tinker_env.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60,
                      limits=limits) as http:
        ports = set()
        tracemalloc.start()  # this process's allocations: the server's thread is one of its threads
        try:
            for what, extra, field, datum_index in MALFORMED:
                tracemalloc.reset_peak()
                r = http.post("/forward_backward", content=base + extra, headers=PROTO)
                peak = tracemalloc.get_traced_memory()[1]
                assert r.status_code == 400, (what, r.status_code, r.text)
                err = r.json()
                assert err["code"] == "invalid_input" and field in err["field"], (what, err)
                assert err.get("datum_index") == datum_index, (what, err)
                assert peak < 64 * 2**20, f"{what}: {peak / 2**20:.0f} MiB allocated for a refusal"
                assert r.headers.get("connection", "") != "close", what
                ports.add(client_port(r))
        finally:
            tracemalloc.stop()
        ok = http.post("/forward_backward", content=base, headers=PROTO)
        assert ok.status_code == 200, ok.text
        ports.add(client_port(ok))
        assert len(ports) == 1, "a refusal closed the keep-alive connection"
        done = http.post("/retrieve_future", json={"request_id": ok.json()["request_id"]})
        assert done.status_code == 200 and done.headers["content-type"] == PROTO["Content-Type"], done.text


def test_sparse_tensors_within_the_bounds_are_made_dense(tinker_env, tiny_llama):
    """The SDK's own sparse [N, K] weights (soft targets) are accepted and give the dense tensor's loss."""
    from tinker.proto.response_conv import deserialize_forward_backward_output

    model, seq = new_model(tinker_env.url, tiny_llama), iter(range(1, 3))

    tokens, k = [1, 17, 250, 4000], 3
    targets = np.array([[17, 5, 6], [250, 7, 8], [4000, 9, 10], [12, 11, 13]], dtype=np.int64)
    dense_w = np.zeros((4, k), dtype=np.float32)
    dense_w[0, 0], dense_w[2, 1], dense_w[3, 2] = 1.0, 0.5, 0.25
    sparse_w = types.TensorData(data=[1.0, 0.5, 0.25], dtype="float32", shape=[4, k],
                                sparse_crow_indices=[0, 1, 1, 2, 3], sparse_col_indices=[0, 1, 2])

    def forward(weights) -> float:
        d = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[d], loss_fn="cross_entropy"), model_id=model, seq_id=next(seq))
        with raw(tinker_env.url) as http:
            r = http.post("/forward_backward", content=forward_backward_request_to_proto(request).SerializeToString(),
                          headers=PROTO)
            assert r.status_code == 200, r.text
            done = http.post("/retrieve_future", json={"request_id": r.json()["request_id"]})
            assert done.status_code == 200, done.text
            return deserialize_forward_backward_output(done.content).metrics["loss:sum"]

    # No optim_step between them: both see the same weights.
    loss = forward(sparse_w)
    assert loss != 0 and np.isclose(loss, forward(dense_w), rtol=1e-6)


# ---- declared sizes bounded before anything is made of them (issue 31, item 6) -----------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_llama):
    """A server whose requests hold at most 2,048 tokens and 2 MiB (so sparse tensors expand to at most 2^19
    values): the bounds are reached with small bodies."""
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path_factory.mktemp("small") / "data",
                                        limits=Limits(max_operation_tokens=2048, max_request_bytes=2 * 2**20)))
    yield server
    server.stop()


def sparse_zeros(rows: int, k: int, dtype: str = "float32") -> types.TensorData:
    """An all-empty sparse CSR [rows, K] tensor as the SDK sends it: 8 bytes per row on the wire."""
    return types.TensorData(data=[], dtype=dtype, shape=[rows, k], sparse_crow_indices=[0] * (rows + 1),
                            sparse_col_indices=[])


def peak_of(call) -> tuple:
    """call()'s result and the peak of this process's traced allocations meanwhile (the server runs in it)."""
    tracemalloc.start()
    try:
        out = call()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_sparse_tensors_are_bounded_before_they_are_expanded(small, tiny_llama, monkeypatch):
    """A 12 MB body of sparse [10^6, 256] weights was made a Python list of 2.6 x 10^8 values (1.6 GB) before the
    token limit refused it, on the event loop. Now the datum's positions count against max_operation_tokens and
    the values all sparse tensors of a request expand to against what a dense body of max_request_bytes holds,
    both before a tensor is read: 413s naming the limit, with a peak far below the expansion (41 MB and 98 MB
    here). The body is decoded on a worker thread, not the server's event loop."""
    model = new_model(small.url, tiny_llama)
    threads = []
    real = proto.decode_forward_backward
    monkeypatch.setattr(proto, "decode_forward_backward",
                        lambda *a: threads.append(threading.current_thread()) or real(*a))

    def body(tokens: int, **inputs: types.TensorData) -> bytes:
        datum = types.Datum(model_input=types.ModelInput.from_ints([1] * tokens), loss_fn_inputs=inputs)
        return forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id=model, seq_id=1)).SerializeToString()

    over_tokens = body(20_000, weights=sparse_zeros(20_000, 256))  # 5.1 x 10^6 values from 240 kB
    over_values = body(2000, **{f"w{i}": sparse_zeros(2000, 256) for i in range(24)})  # 24 x 512,000 from 400 kB
    with raw(small.url) as http:
        for content, words in ((over_tokens, ("20000 tokens", "2048")), (over_values, ("sparse", "524288"))):
            r, peak = peak_of(lambda: http.post("/forward_backward", content=content, headers=PROTO))
            assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a refusal of {words}"
            assert r.status_code == 413, r.text
            assert all(w in r.json()["message"] for w in words), r.text
    assert len(threads) == 2 and small.thread not in threads  # the server's event loop runs in small.thread


def test_sparse_target_prompt_logprobs_are_bounded_before_they_are_expanded(small, tiny_llama):
    """Sparse target_prompt_logprobs on asample were made rows of P x K ids before the prompt's length was
    checked (a 2 MB body took 10 s). The prompt is checked against the model's context (512) first: a 400,
    with a peak far below the 85 MB of 10^5 rows of 100."""
    import tinker

    client = tinker.ServiceClient(base_url=small.url, api_key=API_KEY)
    try:
        sampler = client.create_sampling_client(base_model=tiny_llama).result()
        n = 100_000
        tracemalloc.start()
        try:
            with pytest.raises(tinker.BadRequestError) as info:
                sampler.sample(types.ModelInput.from_ints([1] * n), 1, types.SamplingParams(max_tokens=1),
                               target_prompt_logprobs=sparse_zeros(n - 1, 100, "int64")).result()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a refusal"
        assert "100000 positions" in str(info.value) and "context of 512" in str(info.value), info.value
    finally:
        client.close("success").result()


# ---- invalid text in JSON bodies, paths and queries --------------------------------------------------

def text(body: dict) -> bytes:
    """JSON text as json.dumps writes it: a lone surrogate becomes the escape \\udc80."""
    import json

    return json.dumps(body).encode()


INVALID_TEXT = [  # (id, method, path, body, content type, status, field)
    ("session_metadata_lone_surrogate", "POST", "/create_session", text({"tags": [], "user_metadata": {"a": "\udc80"}}),
     "application/json", 400, "user_metadata.a"),
    ("session_tag_lone_surrogate", "POST", "/create_session", text({"tags": ["ok", "\ud800"]}), "application/json",
     400, "tags.1"),
    # The 422 answer echoed the invalid input, which could not be encoded: a 500.
    ("schema_error_holding_a_surrogate", "POST", "/create_model",
     text({"session_id": "\udc80", "model_seq_id": "x", "base_model": 1}), "application/json", 400, "session_id"),
    ("model_id_lone_surrogate", "POST", "/optim_step", text({"model_id": "m\udfff", "seq_id": 1, "adam_params": {}}),
     "application/json", 400, "model_id"),
    ("body_invalid_utf8", "POST", "/create_session", b'{"tags": ["\xff"]}', "application/json", 400, "body"),
    ("body_invalid_utf8_as_text_plain", "POST", "/create_model", b"\xff\xfe", "text/plain", 400, "body"),
    ("path_percent_encoded_surrogate", "GET", "/training_runs/%ED%B2%80", None, None, 404, "run_id"),
    ("path_percent_encoded_invalid_utf8", "GET", "/sessions/%FF", None, None, 404, "session_id"),
    ("sampler_percent_encoded_surrogate", "GET", "/samplers/%ED%A0%80", None, None, 404, "sampling_session_id"),
    ("checkpoint_path_percent_encoded", "DELETE", "/training_runs/x/checkpoints/weights/%ED%B2%80", None, None, 404,
     None),
    ("query_percent_encoded_invalid_utf8", "GET", "/training_runs?limit=%FF", None, None, 422, "limit"),
]


@pytest.mark.parametrize("case", INVALID_TEXT, ids=[c[0] for c in INVALID_TEXT])
def test_invalid_text_is_refused_at_the_edge(tinker_env, case):
    _, method, path, body, content_type, status, field = case
    headers = {"Content-Type": content_type} if content_type else {}
    with raw(tinker_env.url) as http:
        r = http.request(method, path, content=body, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()
        assert isinstance(err.get("message"), str) and err.get("code"), err
        if field is not None:
            assert field in err.get("field", ""), err
        assert http.post("/create_session", json={"tags": []}).status_code == 200  # the connection serves on


# ---- random mutations of valid protobuf bodies -------------------------------------------------------

def key_positions(buf: bytes, start: int = 0, depth: int = 0) -> list[int]:
    """Offsets of every field key in a message and, where a length-delimited value parses as a message
    itself, in it (a heuristic walk: the targets of the wire-type mutation)."""
    out, pos = [], 0
    try:
        while pos < len(buf):
            out.append(start + pos)
            k, pos = proto._varint(buf, pos, "body")
            wire = k & 7
            if wire == 0:
                _, pos = proto._varint(buf, pos, "body")
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                n, pos = proto._varint(buf, pos, "body")
                if depth < 6:
                    out += key_positions(buf[pos:pos + n], start + pos, depth + 1)
                pos += n
            else:
                break
    except Exception:
        pass
    return [p for p in out if p < start + len(buf)]


def mutate(body: bytes, rng: random.Random, keys: list[int]) -> bytes:
    """1-3 of: bit flip, truncation, inserted bytes, deleted bytes, duplicated slice, changed wire type."""
    b = bytearray(body)
    for _ in range(rng.randint(1, 3)):
        if not b:
            break
        kind, p = rng.randrange(6), rng.randrange(len(b))
        if kind == 0:
            b[p] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del b[rng.randrange(1, len(b) + 1):]
        elif kind == 2:
            b[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif kind == 3:
            del b[p:p + rng.randint(1, 4)]
        elif kind == 4:
            b[p:p] = b[rng.randrange(len(b)):][:rng.randint(1, 16)]
        else:
            k = rng.choice(keys)
            if k < len(b):
                b[k] = (b[k] & ~7) | rng.choice([w for w in range(8) if w != b[k] & 7])
    return bytes(b)


def test_random_protobuf_mutations_never_reach_a_5xx(tinker_env, tiny_llama):
    """300 seeded mutations of two valid SDK-made bodies (dense inputs; sparse [N, K] weights with a loss
    config): no answer is a 5xx, most are refused as 400, and the server then trains as before."""
    model = new_model(tinker_env.url, tiny_llama)
    tokens = [1, 17, 250, 4000, 12]
    sparse = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": types.TensorData(data=list(range(2, 12)), dtype="int64", shape=[5, 2]),
        "weights": types.TensorData(data=[1.0, 0.5], dtype="float32", shape=[5, 2],
                                    sparse_crow_indices=[0, 1, 1, 1, 2, 2], sparse_col_indices=[0, 1])})
    bodies = [fb_body(model, 1), forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sparse], loss_fn="cross_entropy",
                                                          loss_fn_config={"note": "x", "scale": 2.0}),
        model_id=model, seq_id=1)).SerializeToString()]
    rng = random.Random(20240610)
    statuses: dict[int, int] = {}
    with raw(tinker_env.url) as http:  # each answer within the client's timeout
        for i in range(300):
            body = bodies[i % 2]
            mutated = mutate(body, rng, key_positions(body))
            r = http.post("/forward_backward", content=mutated, headers=PROTO)
            assert r.status_code < 500, (i, mutated.hex(), r.text)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(400, 0) >= 150, statuses
    fresh = new_model(tinker_env.url, tiny_llama)
    with raw(tinker_env.url) as http:
        r = http.post("/forward_backward", content=fb_body(fresh, 1), headers=PROTO)
        assert r.status_code == 200, r.text
        done = http.post("/retrieve_future", json={"request_id": r.json()["request_id"]})
        assert done.status_code == 200 and done.headers["content-type"] == PROTO["Content-Type"], done.text
