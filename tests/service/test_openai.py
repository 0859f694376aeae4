"""The OpenAI-compatible endpoint on a real server (a real port), driven by the official `openai` client.

References are independent of the route under test: the native `POST /v1/samples` route with the same
seed and prompt tokens (same tokens, same log-probs), and the model's tokenizer and chat template through
transformers. Three copies of the tiny model are served: SmolLM2's ChatML template, another template
("### User:" style, written here), and no template at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.service.conftest import start_server
from whitney.datums import chat_datum, render_chat
from whitney.service.api.openai import routes as openai_routes
from whitney.service.api.openai.text import TextStream
from whitney.service.app import ServiceConfig

KEY, OTHER_KEY = "tml-key-of-alice", "tml-key-of-bob"  # tml-: the Tinker SDK takes no other key
HASHES_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}"
    "{{ eos_token }}\n{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "training" / "http"
SAMPLE_DATA = EXAMPLES / "data" / "chats.jsonl"  # the examples' shipped dataset (examples/training/http/README.md)
CHAT = [{"role": "user", "content": "Say yes."}]


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Served name -> directory: the tiny model with its own template, another template, and none."""
    root = tmp_path_factory.mktemp("openai-models")
    hashes, plain = shutil.copytree(tiny_llama, root / "tiny-hashes"), shutil.copytree(tiny_llama, root / "tiny-plain")
    (hashes / "chat_template.jinja").write_text(HASHES_TEMPLATE)
    (plain / "chat_template.jinja").unlink()
    return {Path(tiny_llama).name: tiny_llama, "tiny-hashes": str(hashes), "tiny-plain": str(plain)}


@pytest.fixture(scope="module")
def srv(models, tmp_path_factory):
    server = start_server(ServiceConfig(models=list(models.values()), api_keys=[KEY, OTHER_KEY],
                                        data_dir=tmp_path_factory.mktemp("openai") / "data"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def name(models) -> str:
    return next(iter(models))


@pytest.fixture(scope="module")
def tokenizer(models, name):
    return AutoTokenizer.from_pretrained(models[name])


def client(srv, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def native_sample(srv, prompt: list[int], key: str = KEY, **body) -> dict:
    """POST /v1/samples and poll it to its end: the operation's result."""
    with srv.http(key) as http:
        op = http.post("/v1/samples", json={"prompt": prompt, **body})
        assert op.status_code == 202, op.text
        while (got := http.get(f"/v1/operations/{op.json()['id']}", params={"wait": 10}).json())["status"] in (
                "queued", "running"):
            pass
    assert got["status"] == "succeeded", got
    return got["result"]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def text_of(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- answers equal the native sampler's -------------------------------------------------------------------

def test_chat_completion_equals_the_native_sample(srv, name, tokenizer):
    """n=2 with a seed, log-probs and top log-probs: the same tokens and log-probs as POST /v1/samples on the
    prompt the model's own chat template makes, and the text is those tokens decoded (EOS left out)."""
    answer = client(srv).chat.completions.create(model=name, messages=CHAT, n=2, seed=11, temperature=0.9,
                                                 max_tokens=12, logprobs=True, top_logprobs=3)
    prompt = chat_prompt(tokenizer, CHAT)
    native = native_sample(srv, prompt, num_samples=2, seed=11, temperature=0.9, max_tokens=12)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(len(s["tokens"]) for s in native["sequences"])
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, seq in zip(answer.choices, native["sequences"]):
        assert choice.message.role == "assistant" and choice.message.content == text_of(tokenizer, seq["tokens"])
        assert choice.finish_reason == {"stop": "stop", "length": "length"}[seq["stop_reason"]]
        content = choice.logprobs.content
        assert [c.logprob for c in content] == pytest.approx(seq["logprobs"], abs=1e-5)
        assert [c.token for c in content] == [tokenizer.decode([t]) for t in seq["tokens"]]
        for entry in content:  # the top 3 alternatives, most likely first, the sampled one among them if likely
            assert len(entry.top_logprobs) == 3
            lps = [t.logprob for t in entry.top_logprobs]
            assert lps == sorted(lps, reverse=True) and lps[0] >= entry.logprob - 1e-6
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.id.startswith("chatcmpl-op-")


def test_completion_equals_the_native_sample(srv, name, tokenizer):
    """A string prompt is the tokenizer's encoding; token-id prompts are taken as they are; integer logprobs
    gives the sampled token's log-prob and that many alternatives."""
    prompt_text = "The capital of France is"
    answer = client(srv).completions.create(model=name, prompt=prompt_text, seed=5, max_tokens=10, logprobs=2)
    prompt = tokenizer(prompt_text)["input_ids"]
    native = native_sample(srv, prompt, seed=5, max_tokens=10)
    (seq,) = native["sequences"]
    (choice,) = answer.choices
    assert choice.text == text_of(tokenizer, seq["tokens"])
    assert choice.logprobs.token_logprobs == pytest.approx(seq["logprobs"], abs=1e-5)
    assert len(choice.logprobs.top_logprobs) == len(seq["tokens"]) and all(
        1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert answer.usage.prompt_tokens == len(prompt) and answer.object == "text_completion"

    ids = client(srv).completions.create(model=name, prompt=prompt, seed=5, max_tokens=10)
    assert ids.choices[0].text == choice.text


def test_a_streamed_answer_joined_equals_the_whole_one(srv, name):
    common = dict(model=name, messages=CHAT, n=2, seed=3, max_tokens=40, logprobs=True, top_logprobs=1)
    whole = client(srv).chat.completions.create(**common)
    chunks = list(client(srv).chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
    texts, logprobs, reasons = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id and chunk.usage is None
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        logprobs[choice.index] += [c.logprob for c in (choice.logprobs.content if choice.logprobs else [])]
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert logprobs[choice.index] == [c.logprob for c in choice.logprobs.content]
        assert reasons[choice.index] == choice.finish_reason

    text_whole = client(srv).completions.create(model=name, prompt="Once upon", seed=4, max_tokens=30)
    pieces = list(client(srv).completions.create(model=name, prompt="Once upon", seed=4, max_tokens=30, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text_whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == text_whole.choices[0].finish_reason


def test_streaming_hands_tokens_on_while_the_sample_still_decodes(srv, name, monkeypatch):
    """The first chunk reaches the client, then the sampler still decodes many steps (events in order)."""
    backend = srv.app.state.whitney.scheduler.backend
    events, lock, step = [], threading.Lock(), backend.sample_step

    def logged_step():
        out = step()
        with lock:
            events.append("decode step")
        time.sleep(0.005)  # a slower decoder, so that the order of the two sides shows at a glance
        return out

    monkeypatch.setattr(backend, "sample_step", logged_step)
    stream = client(srv).completions.create(model=name, prompt="Tell me", seed=9, max_tokens=200, stream=True)
    chunks = 0
    for piece in stream:
        if piece.choices and piece.choices[0].text:
            chunks += 1
            if chunks == 1:
                with lock:
                    events.append("first chunk")
    first = events.index("first chunk")
    assert events.count("decode step") >= 150  # about one per token (the first comes with the prompt)
    assert events[first + 1:].count("decode step") >= 100, "the first chunk came only as the decoding ended"
    assert chunks >= 20


def test_stop_strings_end_the_text_before_them(srv, name):
    free = client(srv).completions.create(model=name, prompt="Hello", seed=21, max_tokens=30).choices[0]
    stop = free.text[10:13]
    cut = free.text.index(stop)
    for stream in (False, True):
        answer = client(srv).completions.create(model=name, prompt="Hello", seed=21, max_tokens=30, stop=[stop, "@@@"],
                                                stream=stream)
        if stream:
            pieces = list(answer)
            text, reason = "".join(p.choices[0].text for p in pieces), pieces[-1].choices[0].finish_reason
        else:
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert (text, reason) == (free.text[:cut], "stop"), stream


def test_text_stream_holds_back_split_characters_and_stop_prefixes(tokenizer):
    """Fed one token at a time, each piece is whole text (a character split over tokens waits for its last
    byte), the pieces join up to the whole decode, and a stop string's start is held until it is ruled out."""
    text = "日本語 naïve 🎉 ok, then STOP here"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokens)  # the test has split characters
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa
    stream = TextStream(decode)
    pieces = [stream.add([t]) for t in tokens] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text
    stopping = TextStream(decode, ("STOP",))
    pieces = [stopping.add([t]) for t in tokens] + [stopping.finish()]
    assert "".join(pieces) == text[:text.index("STOP")] and stopping.stopped


# ---- models: base, a run's sampler version, a checkpoint; keys -----------------------------------------

def test_a_runs_sampler_version_and_a_checkpoint_as_model(srv, name, tokenizer):
    with srv.http(KEY) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"base_model": name, "lora": {"rank": 4}}).json()["id"]
        tokens = tokenizer("yes yes yes yes yes yes", add_special_tokens=False)["input_ids"]
        datum = {"input": {"token_ids": tokens[:-1]}, "loss_inputs": {"target_tokens": {
            "dtype": "int64", "shape": [len(tokens) - 1], "values": tokens[1:]}}}
        ops = [http.post(f"/v1/runs/{run}/forward_backward", json={"seq_id": 0, "data": [datum]}),
               http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 1, "adam_params": {"learning_rate": 0.1}}),
               http.post(f"/v1/runs/{run}/save_weights_for_sampler", json={"seq_id": 2}),
               http.post(f"/v1/runs/{run}/save_state", json={"seq_id": 3, "name": "chat"})]
        done = [http.get(f"/v1/operations/{op.json()['id']}", params={"wait": 30}).json() for op in ops]
        assert [d["status"] for d in done] == ["succeeded"] * 4, done
        version, checkpoint = done[2]["result"]["version"], done[3]["result"]["package"]["id"]

    prompt = chat_prompt(tokenizer, CHAT)
    base = client(srv).chat.completions.create(model=name, messages=CHAT, seed=2, max_tokens=8, logprobs=True)
    for model, ref in ((f"{run}@{version}", {"run_id": run, "version": version}), (checkpoint, {"checkpoint_id": checkpoint})):
        answer = client(srv).chat.completions.create(model=model, messages=CHAT, seed=2, max_tokens=8, logprobs=True)
        (seq,) = native_sample(srv, prompt, seed=2, max_tokens=8, **ref)["sequences"]
        assert answer.model == model and answer.choices[0].message.content == text_of(tokenizer, seq["tokens"])
        assert [c.logprob for c in answer.choices[0].logprobs.content] == pytest.approx(seq["logprobs"], abs=1e-5)
        assert [c.logprob for c in answer.choices[0].logprobs.content] != \
            pytest.approx([c.logprob for c in base.choices[0].logprobs.content], abs=1e-3)  # the adapter is used

    mine = {m.id for m in client(srv).models.list()}
    assert {name, "tiny-hashes", "tiny-plain", f"{run}@{version}", checkpoint} <= mine
    theirs = {m.id for m in client(srv, OTHER_KEY).models.list()}
    assert theirs == {name, "tiny-hashes", "tiny-plain"}, "another key's runs and checkpoints are not listed"
    with pytest.raises(openai.NotFoundError):
        client(srv, OTHER_KEY).chat.completions.create(model=f"{run}@{version}", messages=CHAT, max_tokens=2)


def new_run(http, name: str) -> str:
    session = http.post("/v1/sessions", json={}).json()["id"]
    return http.post(f"/v1/sessions/{session}/runs", json={"base_model": name, "lora": {"rank": 2}}).json()["id"]


def run_ops(http, run: str, *ops: tuple[str, dict]) -> list[dict]:
    """Submit a new run's operations in seq_id order and wait for each: their results."""
    submitted = [http.post(f"/v1/runs/{run}/{kind}", json={"seq_id": i, **body}).json()
                 for i, (kind, body) in enumerate(ops)]
    done = [http.get(f"/v1/operations/{op['id']}", params={"wait": 30}).json() for op in submitted]
    assert [d["status"] for d in done] == ["succeeded"] * len(ops), done
    return [d["result"] for d in done]


def model_ids(srv, key: str = KEY) -> list[str]:
    return [m.id for m in client(srv, key).models.list()]


def test_models_lists_the_keys_newest_sampler_versions_and_checkpoints_up_to_the_cap(srv, name, monkeypatch):
    """Each sampler version as '<run_id>@<version>' (newest first), each checkpoint by id, never another key's;
    every id listed is one chat completions takes; an ended run's deleted version is not listed; at most
    LISTED of each kind, the newest."""
    with srv.http(KEY) as http:
        run = new_run(http, name)
        saved = run_ops(http, run, ("save_weights_for_sampler", {}), ("save_weights_for_sampler", {}),
                        ("save_state", {"name": "s"}), ("save_weights_for_sampler", {}))
        versions = [saved[i]["version"] for i in (0, 1, 3)]
        packages = [r["package"]["id"] for r in saved]
        assert versions == [1, 2, 3]
    mine = model_ids(srv)
    assert mine[:3] == [name, "tiny-hashes", "tiny-plain"]
    ats = [m for m in mine if m.startswith(f"{run}@")]
    assert ats == [f"{run}@3", f"{run}@2", f"{run}@1"], mine  # newest first
    assert set(packages) <= set(mine)
    assert not any(m.startswith(f"{run}@") or m in packages for m in model_ids(srv, OTHER_KEY))
    for model in ats + packages:
        answer = client(srv).completions.create(model=model, prompt="Hi", max_tokens=1, seed=0)
        assert answer.model == model

    monkeypatch.setattr(openai_routes, "LISTED", 2)
    capped = model_ids(srv)
    assert capped == [name, "tiny-hashes", "tiny-plain", f"{run}@3", f"{run}@2", packages[3], packages[2]], capped
    monkeypatch.undo()

    with srv.http(KEY) as http:  # an ended run samples a version from its package: a deleted one is gone
        assert http.post(f"/v1/runs/{run}/finish").status_code == 200
        assert http.delete(f"/v1/checkpoints/{packages[0]}").status_code == 200
        after = model_ids(srv)
        assert f"{run}@1" not in after and packages[0] not in after and f"{run}@2" in after, after
        r = http.post("/v1/completions", json={"model": f"{run}@1", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["field"] == "model", r.text


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    from whitney.service.store.database import Store

    if request.param == "sqlite":
        return Store(f"sqlite:///{tmp_path / 'store.db'}")
    return Store(request.getfixturevalue("postgres").new_database())


def test_the_listing_queries_read_the_newest_live_versions_on_each_database(store):
    """Without HTTP, on SQLite and PostgreSQL (the JSON paths of the join): per owner, newest first, at most
    `limit`; an ended run's version whose package was deleted is left out, an open run's is kept (it samples
    from memory); checkpoints leave out deleted, expired and export packages."""
    from whitney.service.store.lifecycle import OperationKind, OperationStatus, RunStatus

    def save(owner: str, run_id: str, seq: int, version: int) -> str:
        op, _ = store.submit_operation(owner, run_id, seq, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER, f"d{seq}")
        package = store.register_package(run_id, owner, "sampler", str(version), "/p", "m", False)
        store.set_operation(op.id, OperationStatus.RUNNING)
        store.set_operation(op.id, OperationStatus.SUCCEEDED, {"version": version, "package": {"id": package.id}})
        return package.id

    runs = {}
    for owner in ("alice", "bob"):
        session = store.create_session(owner).id
        for k in ("ended", "open"):
            runs[owner, k] = store.create_run(session, owner, "m", {}, None, False, None).id
    packages = {(k, v): save("alice", runs["alice", k], v - 1, v) for k in ("ended", "open") for v in (1, 2)}
    save("bob", runs["bob", "open"], 0, 1)
    for k in ("ended", "open"):
        store.delete_package(packages[k, 1], "alice")
    assert store.set_run_status(runs["alice", "ended"], RunStatus.FINISHED)
    state = store.register_package(runs["alice", "open"], "alice", "state", "s", "/p", "m", True).id
    store.register_package(runs["alice", "open"], "alice", "lora", "export", "/p", "m", False)

    got = [(v["run_id"], v["version"]) for v in store.newest_sampler_versions("alice", 10)]
    assert got == [(runs["alice", "open"], 2), (runs["alice", "open"], 1), (runs["alice", "ended"], 2)], got
    assert len(store.newest_sampler_versions("alice", 2)) == 2
    assert [v["run_id"] for v in store.newest_sampler_versions("bob", 10)] == [runs["bob", "open"]]
    checkpoints = [p["id"] for p in store.newest_checkpoints("alice", 10)]
    assert checkpoints == [state, packages["open", 2], packages["ended", 2]], checkpoints
    assert store.newest_checkpoints("alice", 1)[0]["id"] == state


def test_a_tinker_sampler_path_from_the_sdk_is_a_model(srv, name, tokenizer):
    """The path the Tinker SDK's save_weights_for_sampler hands out samples in chat and text completions what
    the SDK's own sampling client samples from it (same seed: same tokens and log-probs), with the trained
    adapter; its version is listed as '<run_id>@<version>' and answers the same; another key gets the 404
    an unknown path gets."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=name, rank=4, seed=3).result()
    tokens = tokenizer("yes yes yes yes yes yes", add_special_tokens=False)["input_ids"]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    path = tc.save_weights_for_sampler("chat-v1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/chat-v1"

    prompt = tokenizer("The sea is", add_special_tokens=False)["input_ids"]
    sdk = service.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, seed=6, temperature=1.0)).result()
    (expected,) = sdk.sequences
    answer = client(srv).completions.create(model=path, prompt=prompt, max_tokens=8, seed=6, logprobs=0)
    (choice,) = answer.choices
    assert answer.model == path and choice.text == text_of(tokenizer, list(expected.tokens))
    assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-5)
    base = client(srv).completions.create(model=name, prompt=prompt, max_tokens=8, seed=6, logprobs=0)
    assert base.choices[0].logprobs.token_logprobs != pytest.approx(choice.logprobs.token_logprobs, abs=1e-3)
    chat = client(srv).chat.completions.create(model=path, messages=CHAT, max_tokens=4, seed=1)
    assert chat.model == path and chat.choices[0].message.content is not None

    (listed,) = [m for m in model_ids(srv) if m.startswith(f"{tc.model_id}@")]
    again = client(srv).completions.create(model=listed, prompt=prompt, max_tokens=8, seed=6, logprobs=0)
    assert again.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs

    with srv.http(KEY) as mine, srv.http(OTHER_KEY) as theirs:
        unknown = mine.post("/v1/completions", json={"model": path.replace("chat-v1", "nope"), "prompt": "x"})
        other = theirs.post("/v1/completions", json={"model": path, "prompt": "x"})
    assert unknown.status_code == other.status_code == 404, (unknown.text, other.text)
    assert unknown.json()["field"] == other.json()["field"] == "model"
    assert other.json()["message"] == unknown.json()["message"].replace("nope", "chat-v1")
    service.close("success").result()


@pytest.mark.parametrize("model, status", [
    ("tinker://only-a-run", 400),
    ("tinker://run-x/bogus/name", 400),
    ("tinker://run-x/external_weights/name", 400),
    ("tinker://run-x/sampler_weights/", 400),
    ("tinker://run-x/sampler_weights/nope", 404),
    ("tinker://run-x/weights/nope", 404),
    ("run-x@latest", 400),
    ("run-x@", 400),
    ("run-nope@1", 404),
    ("pkg-nope", 404),
    ("no-such-model", 404),
])
def test_bad_or_unknown_model_ids_are_4xx_naming_model_and_the_rule(srv, model, status):
    with srv.http(KEY) as http:
        for route, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": CHAT})):
            r = http.post(f"/v1/{route}", json={"model": model, **body})
            assert r.status_code == status and r.json()["field"] == "model", r.text
            if status == 400 or model == "no-such-model":  # the rule is spelled out
                assert "tinker://<" in r.json()["message"] or "<run_id>@<version>" in r.json()["message"], r.text


def test_a_wrong_key_is_refused(srv, name):
    with pytest.raises(openai.AuthenticationError):
        client(srv, "not-a-key").chat.completions.create(model=name, messages=CHAT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(srv, "not-a-key").models.list()


# ---- bad input: a 4xx naming the field, never a 5xx -------------------------------------------------

@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"max_tokens": 100000}, "max_tokens"),  # beyond the context
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ({"n": 10**6}, "n"),
])
def test_unsupported_or_bad_chat_parameters_are_a_400_naming_them(srv, name, extra, field):
    with srv.http(KEY) as http:
        r = http.post("/v1/chat/completions", json={"model": name, "messages": CHAT, **extra})
    assert r.status_code == 400 and r.json()["field"] == field, r.text
    with pytest.raises(openai.BadRequestError):
        client(srv).chat.completions.create(model=name, messages=CHAT, **extra)


@pytest.mark.parametrize("body, status, field", [
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": [10**9]}, 400, "prompt"),  # beyond the vocabulary
    ({"prompt": []}, 422, "prompt"),
    ({"prompt": "x", "logprobs": 99}, 422, "logprobs"),
    ({"prompt": "x", "temperature": -1}, 422, "temperature"),
    ({"prompt": "x", "bogus": 1}, 422, "bogus"),
    ({"prompt": "x", "stop": [""]}, 422, "stop"),
    ({"prompt": "x", "stop": ["s"] * 40}, 413, "stop"),
])
def test_bad_completion_requests_are_4xx_naming_the_field(srv, name, body, status, field):
    with srv.http(KEY) as http:
        r = http.post("/v1/completions", json={"model": name, **body})
    assert r.status_code == status and field in r.json()["field"], r.text


def test_unknown_models_and_a_model_without_a_chat_template(srv):
    with srv.http(KEY) as http:
        for model in ("no-such-model", "run-nope@1", "pkg-nope"):
            r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT})
            assert r.status_code == 404 and r.json()["field"] == "model", r.text
        r = http.post("/v1/chat/completions", json={"model": "tiny-plain", "messages": CHAT})
        assert r.status_code == 400 and r.json()["field"] == "messages" and "chat template" in r.json()["message"]
        r = http.post("/v1/completions", json={"model": "tiny-plain", "prompt": "fine", "max_tokens": 2})
        assert r.status_code == 200, r.text  # text completion needs no template
        r = http.post("/v1/chat/completions", json={"model": "tiny-hashes", "messages": [{"role": "tool",
                                                                                           "content": "x"}]})
        assert r.status_code == 422 and r.json()["field"].startswith("messages"), r.text


# ---- the chat render route and datums (issue 12) -----------------------------------------------------------

@pytest.mark.parametrize("model, end_of_turn", [("tiny-llama", "<|im_end|>\n"), ("tiny-hashes", "<|im_end|>\n")])
def test_chat_render_marks_each_assistant_message_with_its_templates_end(srv, models, model, end_of_turn):
    """Each model's own template renders the conversation; the mask covers exactly each assistant reply and
    the end-of-turn text its template writes after it."""
    tok = AutoTokenizer.from_pretrained(models[model])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes."},
                {"role": "assistant", "content": "yes"}, {"role": "user", "content": "And no?"},
                {"role": "assistant", "content": "no"}]
    rendered = render_chat(srv.url, messages, model, KEY)
    expected = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert rendered["tokens"] == expected and rendered["model"] == model
    mask = rendered["assistant_mask"]
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tok.decode(rendered["tokens"][start:i]))
            start = None
    assert spans == [f"yes{end_of_turn}", f"no{end_of_turn}"]

    datum = chat_datum(rendered)
    weights = datum["loss_inputs"]["weights"]["values"]
    assert datum["input"]["token_ids"] == expected[:-1] and weights == [float(m) for m in mask[1:]]


def test_whitney_datums_builds_batches_with_the_served_template(srv, tmp_path):
    """The example script renders through the server: the two templates give two different batches, each
    ending every completion with its own template's end-of-turn, and the server trains on them."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Say yes.", "completion": "yes"}) + "\n")
    env = {**os.environ, "WHITNEY_BASE_URL": srv.url, "WHITNEY_API_KEY": KEY}
    batches = {}
    for model in ("tiny-llama", "tiny-hashes"):
        out = tmp_path / f"{model}.json"
        subprocess.run([sys.executable, str(EXAMPLES / "whitney_datums.py"), str(pairs), str(out), "--model", model],
                       env=env, check=True, capture_output=True, text=True)
        batches[model] = json.loads(out.read_text())
    assert batches["tiny-llama"]["data"][0]["input"] != batches["tiny-hashes"]["data"][0]["input"]
    with srv.http(KEY) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run = http.post(f"/v1/sessions/{session}/runs", json={"base_model": "tiny-hashes", "lora": {"rank": 2}}).json()
        op = http.post(f"/v1/runs/{run['id']}/forward_backward", json={"seq_id": 0, **batches["tiny-hashes"]}).json()
        done = http.get(f"/v1/operations/{op['id']}", params={"wait": 30}).json()
    assert done["status"] == "succeeded" and done["result"]["loss"] > 0


def example(srv, script: str, *args: str, cwd: Path) -> str:
    """An example script run as its README runs it (the server and key from the environment): its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WHITNEY_BASE_URL": srv.url, "WHITNEY_API_KEY": KEY}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_examples_readme_steps_run_on_the_shipped_data(srv, models, name, tmp_path):
    """examples/training/http/README.md in order, on data/chats.jsonl: a batch of one datum per conversation;
    sl_loop prints per step the server's summed loss, labelled as such, and that sum over the batch's total
    weight as the loss per token; the saved state is a chat model; distillation from it and RL run."""
    conversations = [json.loads(line) for line in SAMPLE_DATA.read_text().splitlines() if line.strip()]
    assert len(conversations) >= 24 and all(c["messages"][-1]["role"] == "assistant" for c in conversations)
    out = example(srv, "whitney_datums.py", str(SAMPLE_DATA), "batch.json", cwd=tmp_path)
    batch = json.loads((tmp_path / "batch.json").read_text())
    assert out.strip() == f"wrote {len(conversations)} datums to batch.json"
    assert len(batch["data"]) == len(conversations)
    weight = sum(sum(d["loss_inputs"]["weights"]["values"]) for d in batch["data"])

    out = example(srv, "sl_loop.py", "--forward-backward-json", "batch.json", "--steps", "2", "--rank", "4",
                  "--learning-rate", "1e-2", cwd=tmp_path)
    run = re.search(r"^\[self-hosted\] run (\S+) on ", out, re.M).group(1)
    steps = re.findall(r"^step (\d+): loss per token ([0-9.]+) \(summed loss ([0-9.]+) over ([0-9.]+) weighted target "
                       r"tokens\)  grad_norm [0-9.]+$", out, re.M)
    with srv.http(KEY) as http:
        served = [op["result"]["loss"] for op in http.get(f"/v1/runs/{run}/operations").json()
                  if op["kind"] == "forward_backward"]
    assert len(steps) == len(served) == 2, out
    for (_, per_token, summed, tokens), loss in zip(steps, served):
        assert float(summed) == pytest.approx(loss, abs=1e-4) and float(tokens) == weight, out
        assert float(per_token) == pytest.approx(loss / weight, abs=1e-4), out
    assert float(steps[1][1]) < float(steps[0][1]), out
    state = re.search(r"^saved state (pkg-\S+) ", out, re.M).group(1)
    assert list((tmp_path / "sl_loop_out").rglob("adapter_config.json")), out

    answer = client(srv).chat.completions.create(model=state, messages=CHAT, max_tokens=4, temperature=0)
    assert answer.model == state and answer.choices[0].finish_reason in ("stop", "length")
    out = example(srv, "distill_loop.py", "--model", models[name], "--teacher-checkpoint", state, "--steps", "1",
                  "--samples", "2", cwd=tmp_path)
    assert re.search(r"^step 0: reverse KL estimate per token -?[0-9.]+$", out, re.M), out
    out = example(srv, "rl_loop.py", "--model", models[name], "--steps", "1", "--questions", "1", "--group", "2",
                  cwd=tmp_path)
    assert re.search(r"^step 0: mean reward [0-9.]+ ", out, re.M), out


def test_chat_render_refuses_a_model_without_a_template_and_unknown_models(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = http.post("/v1/chat/render", json={"model": "tiny-plain", "messages": CHAT})
        assert r.status_code == 400 and "chat template" in r.json()["message"]
        r = http.post("/v1/chat/render", json={"model": "nope", "messages": CHAT})
        assert r.status_code == 404 and r.json()["field"] == "model"
