"""No store call on the event loop (issue 31, item 11): the key gate's lookup of a key it has not cached, and every
store read and write of the async routes (runs opened, resumed and finished, operations long-polled, completions
awaited, the console's sign-in and export), run on worker threads. Every method of the server's store is wrapped to
note a call made on a thread that runs an asyncio event loop; real requests through a real server, none noted."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from tests.service.test_flow import ADAM, expect, fb_body, succeeded
from whitney.service.store import keys
from whitney.service.store.database import Store


def calls_on_the_loop(monkeypatch, store: Store) -> list[str]:
    """The names of the store's methods called from now on on an event loop's thread (the server's)."""
    seen: list[str] = []
    for name, method in inspect.getmembers(Store, inspect.isfunction):
        if name.startswith("__"):
            continue
        real = getattr(store, name)

        def noted(*args, _real=real, _name=name, **kwargs):
            try:
                asyncio.get_running_loop()
                seen.append(_name)
            except RuntimeError:  # a worker thread: no loop runs here
                pass
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, noted)
    return seen


@pytest.fixture
def keyed(make_server, monkeypatch):
    """A server whose key is in its database and never cached (every request looks it up)."""
    monkeypatch.setattr(keys, "CACHE_SECONDS", 0.0)
    server = make_server(require_keys=True)
    key = keys.new_key()
    server.app.state.whitney.store.create_key(keys.digest_of(key), "tenant", {})
    return server, key


def test_the_native_and_openai_routes_and_the_key_gate_call_the_store_off_the_loop(keyed, monkeypatch):
    server, key = keyed
    st = server.app.state.whitney
    on_loop = calls_on_the_loop(monkeypatch, st.store)
    with server.http(key) as http:
        sid = expect(http.post("/v1/sessions", json={}), 201)["id"]
        rid = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {"rank": 4, "seed": 3}}), 201)["id"]
        succeeded(http, expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(0)), 202)["id"])
        succeeded(http, expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 1, "adam_params": ADAM}),
                               202)["id"])
        saved = succeeded(http, expect(http.post(f"/v1/runs/{rid}/save_state", json={"seq_id": 2, "name": "s"}),
                                       202)["id"])["package"]
        resumed = expect(http.post(f"/v1/sessions/{sid}/runs", json={"resume_from": {"checkpoint_id": saved["id"]}}),
                         201)
        assert expect(http.post(f"/v1/runs/{resumed['id']}/finish"), 200)["status"] == "finished"
        chat = {"model": st.models[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert expect(http.post("/v1/chat/completions", json=chat), 200)["choices"]
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        assert http.get("/v1/sessions", headers={"Authorization": "Bearer tml-wk-unknown"}).status_code == 401
    with server.http() as browser:
        assert browser.post("/console/login", data={"key": key, "next": "/console/"}).status_code == 303
        assert browser.post("/console/login", data={"key": "tml-wk-wrong"}).status_code == 401
        exported = browser.post(f"/console/checkpoints/{saved['id']}/export",
                                headers={"HX-Request": "true", "Authorization": f"Bearer {key}"})
        assert exported.status_code == 200, exported.text
    assert on_loop == [], f"store calls made on the event loop: {sorted(set(on_loop))}"
