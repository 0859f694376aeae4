"""Issue 31, item 10: a sample whose client went away, or that was cancelled, stops within a decode step and frees
its cache (a chat stream of n=64, max_tokens=470 dropped after its first event kept decoding for 357 s; Tinker's
cancel_future stopped nothing).

Each test runs a real server on a real port, and watches the in-process sampler it drives: which rows each decode
step ran, and what the sampler holds after (rows, cache rows, reserved cache tokens). Once the client has gone, the
sampler's next step waits until the server has asked for the cancel (`Scheduler.cancel_sample`, watched), so what
is counted is the decode steps the server ran for the sample after it knew, not a race with the clock.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from whitney.service.api.openai import routes as openai_routes

N, MAX_TOKENS = 4, 400  # 1,600 tokens to decode: never done within the few steps a cancel may take
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": N, "max_tokens": MAX_TOKENS,
        "seed": 3}


class Watch:
    """The server's sampler as its decode steps run: each sample's request (by operation id), and, once the client
    has gone (`gone()`), the sample's rows in every step the server ran after it asked for the cancel."""

    def __init__(self, server, monkeypatch):
        self.scheduler = server.app.state.whitney.scheduler
        self.backend, self.engine = self.scheduler.backend, server.engine
        self.requests: dict[str, object] = {}  # operation id -> the engine's SampleRequest
        self.left = threading.Event()  # the client has gone: steps wait until the cancel is asked for
        self.asked = threading.Event()  # the server asked for the cancel
        self.cancels: list[tuple[str, str]] = []
        self.rows_after: list[int] = []  # per step after the cancel was asked for: the watched sample's rows
        self.watched: str | None = None
        submit, step = self.backend.submit_sample, self.backend.sample_step

        def submitted(request_id, *args, **kwargs):
            submit(request_id, *args, **kwargs)
            self.requests[request_id] = self.backend._samples[request_id]

        def stepped():
            if self.left.is_set():
                self.asked.wait(timeout=10)  # today's code never asks: the sample decodes on
            out = step()
            if self.asked.is_set() and self.watched is not None:
                self.rows_after.append(self.rows(self.watched))
            return out

        cancel = getattr(self.scheduler, "cancel_sample", None)

        def cancelled(op_id, reason="the sample was cancelled"):
            self.cancels.append((op_id, reason))
            future = cancel(op_id, reason)
            self.asked.set()
            return future

        monkeypatch.setattr(self.backend, "submit_sample", submitted)
        monkeypatch.setattr(self.backend, "sample_step", stepped)
        monkeypatch.setattr(self.scheduler, "cancel_sample", cancelled, raising=False)

    def rows(self, op_id: str) -> int:
        """The sample's rows in the sampler's running batch now."""
        request = self.requests[op_id]
        return sum(row.request is request for sampler in list(self.engine.samplers.values()) for row in sampler.rows)

    def gone(self, op_id: str) -> None:
        self.watched = op_id
        self.left.set()

    def until(self, condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    def ended(self, op_id: str):
        store = self.scheduler.store
        self.until(lambda: store.get_operation(op_id).status in ("succeeded", "failed", "cancelled"),
                   f"{op_id} never ended")
        return store.get_operation(op_id)

    def check_stopped_and_freed(self, op_id: str, reason: str) -> None:
        """Cancelled with `reason`, at most the one step that was under way when the cancel came ran its rows,
        and the sampler holds nothing of it: no rows, no cache rows, no reserved cache tokens, not queued."""
        op = self.ended(op_id)
        assert op.status == "cancelled", (op.status, op.result and len(op.result["sequences"][0]["tokens"]))
        assert op.error == {"code": "cancelled", "message": reason}
        assert self.cancels and self.cancels[0][0] == op_id
        assert sum(1 for rows in self.rows_after if rows) <= 1, f"decoded on after the cancel: {self.rows_after}"
        assert self.rows(op_id) == 0
        for sampler in self.engine.samplers.values():
            assert not sampler.rows and not sampler.queue and sampler.cache.rows == 0
            assert sampler._reserved() == 0, "its cache tokens are released"
        assert op_id not in self.backend._samples and self.backend.sampling_in_flight == 0


def test_a_chat_stream_dropped_after_its_first_tokens_stops_decoding_and_frees_its_cache(make_server, monkeypatch):
    server = make_server()
    watch = Watch(server, monkeypatch)
    model = server.app.state.whitney.models[0]
    with server.http() as http, http.stream("POST", "/v1/chat/completions",
                                            json={**CHAT, "model": model, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"][0]["delta"].get("content"):  # tokens came: the sample is decoding
                op_id = chunk["id"].removeprefix("chatcmpl-")
                break
        assert watch.rows(op_id) > 0, "the sample is in the batch when its client goes"
        watch.gone(op_id)
    watch.check_stopped_and_freed(op_id, "the client went away")


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a plain socket, whose answer is never read (closing the socket is the client going)."""
    where = urlparse(url)
    sock = socket.create_connection((where.hostname, where.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole-answer", "stream"])
def test_a_completion_whose_client_goes_while_it_decodes_is_cancelled(make_server, monkeypatch, stream):
    """The client gives up on a whole answer (a timeout) or drops a stream before reading any of it."""
    server = make_server()
    watch = Watch(server, monkeypatch)
    model = server.app.state.whitney.models[0]
    sock = raw_request(server.url, "/v1/completions", {"model": model, "prompt": "Once upon a time", "n": N,
                                                        "max_tokens": MAX_TOKENS, "seed": 5, "stream": stream})
    watch.until(lambda: any(watch.rows(op_id) for op_id in list(watch.requests)), "the sample never decoded")
    (op_id,) = watch.requests
    watch.gone(op_id)
    sock.close()
    watch.check_stopped_and_freed(op_id, "the client went away")


def test_a_stream_whose_client_left_before_it_began_is_cancelled(make_server, monkeypatch):
    """The client is gone (the server has dropped its connection) before the answer begins, so the stream's events
    may never be made: the sample is cancelled all the same (nothing is left decoding for nobody)."""
    server = make_server()
    watch = Watch(server, monkeypatch)
    model = server.app.state.whitney.models[0]
    connections = server.server.server_state.connections
    closed = threading.Event()
    start = openai_routes.start

    def started(*args, **kwargs):  # the sample is queued; the answer waits until the connection is gone
        job = start(*args, **kwargs)
        closed.wait(timeout=30)
        watch.until(lambda: not connections, "the server never noticed the client leave")
        return job

    monkeypatch.setattr(openai_routes, "start", started)
    watch.left.set()  # from its first step, the sampler waits until the cancel is asked for
    sock = raw_request(server.url, "/v1/chat/completions", {**CHAT, "model": model, "stream": True})
    watch.until(lambda: watch.requests, "the sample was never submitted")
    (op_id,) = watch.requests
    watch.watched = op_id
    sock.close()
    closed.set()
    watch.check_stopped_and_freed(op_id, "the client went away")


def test_the_native_cancel_stops_a_sample_and_frees_its_cache(make_server, monkeypatch):
    server = make_server()
    watch = Watch(server, monkeypatch)
    with server.http() as http:
        op = http.post("/v1/samples", json={"prompt": [1, 2, 3], "num_samples": N, "max_tokens": MAX_TOKENS,
                                            "seed": 1, "stop": []}).json()
        watch.until(lambda: op["id"] in watch.requests and watch.rows(op["id"]), "the sample never decoded")
        watch.gone(op["id"])
        r = http.post(f"/v1/samples/{op['id']}/cancel")
        assert r.status_code == 202 and r.json()["id"] == op["id"], r.text
        watch.check_stopped_and_freed(op["id"], "cancelled by the client")
        again = http.post(f"/v1/samples/{op['id']}/cancel")  # ended: unchanged
        assert again.status_code == 202 and again.json()["status"] == "cancelled"
        assert len(watch.cancels) == 1
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"base_model": server.app.state.whitney.models[0],
                                                              "lora": {"rank": 2}}).json()["id"]
        trained = http.post(f"/v1/runs/{run}/save_weights_for_sampler", json={"seq_id": 0}).json()
        refused = http.post(f"/v1/samples/{trained['id']}/cancel")
        assert refused.status_code == 400 and refused.json()["field"] == "op_id", refused.text
        other = httpx.post(f"{server.url}/v1/samples/op-nope/cancel")
        assert other.status_code == 404


def test_tinker_cancel_future_stops_a_sample_and_frees_its_cache(make_server, monkeypatch):
    """Tinker's cancel_future on a sample (what the SDK sends for a sampling future it abandons, now that the
    server's dynamic config enables it) cancels it."""
    server = make_server()
    watch = Watch(server, monkeypatch)
    model = server.app.state.whitney.models[0]
    with server.http() as http:
        assert http.post("/api/v1/client/dynamic_config", json={}).json()["sample_cancel_enabled"] is True
        future = http.post("/api/v1/asample", json={
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "num_samples": N,
            "sampling_params": {"max_tokens": MAX_TOKENS, "seed": 2, "stop": []}, "base_model": model}).json()
        op_id = future["request_id"]
        watch.until(lambda: op_id in watch.requests and watch.rows(op_id), "the sample never decoded")
        watch.gone(op_id)
        assert http.post("/api/v1/cancel_future", json={"request_id": op_id}).status_code == 200
        watch.check_stopped_and_freed(op_id, "cancelled by the client (cancel_future)")
        answer = http.post("/api/v1/retrieve_future", json={"request_id": op_id}).json()
        assert answer["error"] == "cancelled by the client (cancel_future)" and answer["category"] == "user"
