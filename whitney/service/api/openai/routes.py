"""The OpenAI-compatible endpoint: chat and text completions (streamed as server-sent events or not) and the
models a key can use, over the same sampler, limits, quotas and keys as `POST /v1/samples`.

A completion is one sampling operation (its id is the completion's, after "chatcmpl-" or "cmpl-"). The chat
template and the tokenizer stay in the engine (`Backend.render_chat`, `encode`, `decode`); a streamed
completion hands each report of new tokens on as soon as the sampler makes it (`Scheduler.submit_sample`
with `stream`), decoded by `TextStream`. A completion whose client goes away (a stream dropped part-way, or
before it began; a request given up while it waits for the whole answer) is cancelled at once: the sampler drops
its rows and frees their cache before its next decode step (`Scheduler.cancel_sample`).

`model` is a served base model's name, "<run_id>@<version>" (a run's sampler version), a saved state's
or sampler version's checkpoint id ("pkg-..."), or the Tinker path of one (`tinker://<run_id>/sampler_weights/
<name>` or `.../weights/<name>`, read by the Tinker routes' own parser and lookup). `GET /v1/models` lists the
caller's own: its newest `LISTED` sampler versions and its newest `LISTED` checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from whitney.errors import InvalidInput, NotFound, WhitneyError
from whitney.protocol.backend import Failure, PackageKind, raise_failure
from whitney.protocol.sampling import SamplingParams, validate
from whitney.service.api.native.sampling import resolve
from whitney.service.api.native.schemas import WeightsRef
from whitney.service.api.openai import schemas as wire
from whitney.service.api.openai.text import TextStream
from whitney.service.cluster.payloads import SampleJob
from whitney.service.api.tinker.common import parse_path, resolve_path
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.scheduling.limits import check_stops
from whitney.service.scheduling.results import StopReason
from whitney.service.scheduling.streams import SampleStream
from whitney.service.store.lifecycle import OPERATION_TERMINAL, FailureCategory, OperationKind, OperationStatus

router = new_router(prefix="/v1", tags=["openai"])
KEEPALIVE_SECONDS = 15.0  # an SSE comment line while no token comes (a long prefill, a full queue)
EVENT_STREAM = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                      "description": "the completion, or (stream: true) its chunks as server-sent events"}}
# The engine's names for what OpenAI calls otherwise.
FIELDS = {"num_samples": "n", "base_model": "model", "run_id": "model", "version": "model", "checkpoint_id": "model"}
# GET /v1/models lists at most this many of the key's sampler versions, and as many checkpoints, newest first:
# the answer (and each query's result) stays this size whatever the key holds. Older ones remain usable by name.
LISTED = 100
MODEL_FORMS = ("a served base model, '<run_id>@<version>' (a version from save_weights_for_sampler), a checkpoint "
               "id (pkg-...), or a Tinker path tinker://<run_id>/sampler_weights/<name> (or .../weights/<name>)")


@dataclass
class Started:
    """A completion's sampling operation, submitted."""

    op_id: str
    model: str  # as the request named it
    base_model: str
    prompt: list[int]
    n: int
    stops: tuple[str, ...]
    listener: SampleStream | None
    created: int
    streamed_to_end: bool = False  # the stream saw the operation end (else closing it cancels the sample)


def refuse_unsupported(body: wire.Sampling) -> None:
    """A 400 naming the first OpenAI parameter Whitney does not implement that asks for anything."""
    for name, harmless in wire.REFUSED.items():
        if name in type(body).model_fields and getattr(body, name) not in harmless:
            raise InvalidInput(f"{name} is not supported by this server: leave it out (or send its default "
                               f"{harmless[1] if len(harmless) > 1 else None!r})", field=name)
    if body.stream_options is not None and not body.stream:
        raise InvalidInput("stream_options goes with stream: true", field="stream_options")


def weights_ref(st: ServiceState, who: str, model: str) -> WeightsRef:
    """The weights `model` names (MODEL_FORMS); a malformed name is a 400, an unknown one (or another key's) a
    404, both naming `model`."""
    if st.serves(model):
        return WeightsRef(base_model=st.model_aliases.get(model, model))  # a directory by its shown name
    if model.startswith("tinker://"):
        try:
            _, kind, _ = parse_path(model)
            if kind not in (PackageKind.SAMPLER, PackageKind.STATE):
                raise InvalidInput(f"model {model!r} names an external_weights export, which does not sample: a "
                                   "Tinker path here is tinker://<run_id>/sampler_weights/<name> (or .../weights/"
                                   "<name>)", field="model")
            return WeightsRef(checkpoint_id=resolve_path(st, who, model).id)
        except WhitneyError as e:
            raise renamed(e, {"path": "model"}) from None
    run_id, at, version = model.rpartition("@")
    if at and run_id:
        if not version.isdigit():
            raise InvalidInput(f"model {model!r}: a run's sampler version is '<run_id>@<version>', the version a "
                               "number that save_weights_for_sampler returned", field="model")
        return WeightsRef(run_id=run_id, version=int(version))
    if model.startswith("pkg-"):
        return WeightsRef(checkpoint_id=model)
    raise NotFound(f"model {model!r} is not known here; name {MODEL_FORMS} (GET /v1/models lists them)",
                   field="model")


def plain_messages(messages: list[wire.ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: text parts joined, `developer` as `system`."""
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
             **({"name": m.name} if m.name is not None else {})} for m in messages]


def renamed(error: WhitneyError, fields: dict[str, str]) -> WhitneyError:
    error.field = fields.get(error.field, error.field)
    return error


def start(st: ServiceState, who: str, body: wire.Sampling, chat: bool) -> Started:
    """Validate the request, render or encode its prompt, queue its sampling operation (in a worker thread)."""
    refuse_unsupported(body)
    fields = {**FIELDS, "prompt": "messages" if chat else "prompt",
              "top_logprobs": "top_logprobs" if chat else "logprobs"}
    try:
        weights, base_model = resolve(st, who, weights_ref(st, who, body.model))
        backend, info = st.scheduler.backend, st.model_info(base_model)
        if chat:
            prompt = backend.render_chat(base_model, plain_messages(body.messages), add_generation_prompt=True).tokens
        else:
            prompt = backend.encode(base_model, body.prompt) if isinstance(body.prompt, str) else body.prompt
            if not prompt:
                raise InvalidInput("the prompt encodes to no tokens", field="prompt")
        backend.decode(base_model, [[]])  # the tokenizer is loaded here, off the event loop (RayBackend: once)
        n = body.n or 1
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != body.max_completion_tokens:
                raise InvalidInput("max_tokens and max_completion_tokens differ; send one", field="max_tokens")
            max_tokens = body.max_completion_tokens
        if max_tokens is None:  # OpenAI's defaults: chat up to the context (and this server's cache), text 16
            room = min(info.max_context, backend.config.max_cached_tokens // n) - len(prompt)
            max_tokens = max(room, 1) if chat else 16
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        check_stops(st.limits, stops)
        if chat:
            top = body.top_logprobs or 0
            if top and not body.logprobs:
                raise InvalidInput("top_logprobs needs logprobs: true", field="top_logprobs")
        else:
            top = body.logprobs or 0
        temperature = 1.0 if body.temperature is None else body.temperature
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                stop=tuple(info.eos_token_ids) + stops, num_samples=n, top_logprobs=top)
        validate(prompt, params, info, backend.config.max_sequences)
        reserved, cache = n * (len(prompt) + max_tokens), backend.config.max_cached_tokens
        if reserved > cache:  # now a 400, not a failure after a stream has begun
            raise InvalidInput(f"n x (prompt + max_tokens) = {reserved} tokens exceeds this server's cache of {cache}",
                               field="max_tokens")
    except WhitneyError as e:
        raise renamed(e, fields) from None
    op, _ = st.store.submit_operation(who, None, None, OperationKind.SAMPLE, "",  # 429 over the key's queued ops
                                      admit=lambda conn: st.quotas.admit_operation(who, None, None, 0, conn),
                                      payload=st.payload(SampleJob(prompt, params, weights)))
    listener = st.scheduler.submit_sample(op, prompt, params, weights, stream=bool(body.stream))
    return Started(op.id, body.model, base_model, prompt, n, stops, listener, int(time.time()))


async def ended(st: ServiceState, job: Started) -> dict:
    """The sampling operation's result once it is terminal (its error raised as what it is)."""
    while True:
        op = await run_in_threadpool(st.store.get_operation, job.op_id)  # a store read: off the event loop
        if op.status in OPERATION_TERMINAL:
            break
        await st.scheduler.wait(job.op_id, 30.0)
    if op.status != OperationStatus.SUCCEEDED:
        error = op.error or {"code": "cancelled", "message": "the sample was cancelled"}
        raise_failure(Failure(error["code"], error["message"], error.get("category", FailureCategory.USER),
                              error.get("field")))
    return op.result


class Choices:
    """The text and log-probs of a completion's n samples, streamed or whole."""

    def __init__(self, st: ServiceState, job: Started, logprobs: bool, chat: bool):
        self.backend, self.job, self.logprobs, self.chat = st.scheduler.backend, job, logprobs, chat
        decode = lambda tokens: self.backend.decode(job.base_model, [tokens])[0]  # noqa: E731
        self.texts = [TextStream(decode, job.stops) for _ in range(job.n)]
        self.offsets = [0] * job.n  # completions: where the next token's text starts

    def add(self, i: int, tokens: list[int], logprobs: list[float], top: list | None, last: bool) -> dict:
        """Sample i's next tokens: its new text, and their log-probs in OpenAI's shape (None unless asked)."""
        text = self.texts[i].finish(tokens) if last else self.texts[i].add(tokens)
        return {"text": text, "logprobs": self._logprobs(i, tokens, logprobs, top) if self.logprobs else None}

    def _logprobs(self, i: int, tokens: list[int], logprobs: list[float], top: list | None) -> dict:
        alternatives = [[token for token, _ in at] for at in top or ()]
        ids = sorted(set(tokens) | {t for at in alternatives for t in at})
        shown = dict(zip(ids, self.backend.decode(self.job.base_model, [[t] for t in ids], False)))
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text = shown[token]
                return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in (top[k] if top else [])]}
                                for k, (t, lp) in enumerate(zip(tokens, logprobs))]}
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(shown[t])
        return {"tokens": [shown[t] for t in tokens], "token_logprobs": logprobs, "text_offset": offsets,
                "top_logprobs": [{shown[a]: alp for a, alp in at} for at in top] if top is not None else None}


def usage(job: Started, completion_tokens: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt) + completion_tokens}


def whole(st: ServiceState, job: Started, result: dict, logprobs: bool, chat: bool) -> dict:
    choices = Choices(st, job, logprobs, chat)
    out = []
    for i, seq in enumerate(result["sequences"]):
        got = choices.add(i, seq["tokens"], seq["logprobs"], seq.get("top_logprobs"), last=True)
        reason = StopReason.STOP if seq["stop_reason"] == StopReason.STOP or choices.texts[i].stopped \
            else StopReason.LENGTH
        if chat:
            out.append({"index": i, "message": {"role": "assistant", "content": got["text"]},
                        "logprobs": got["logprobs"], "finish_reason": reason})
        else:
            out.append({"index": i, "text": got["text"], "logprobs": got["logprobs"], "finish_reason": reason})
    kind, prefix = ("chat.completion", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    return {"id": prefix + job.op_id, "object": kind, "created": job.created, "model": job.model, "choices": out,
            "usage": usage(job, sum(len(s["tokens"]) for s in result["sequences"]))}


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def streamed(st: ServiceState, job: Started, logprobs: bool, chat: bool, include_usage: bool):
    """The completion's chunks as server-sent events, each report of new tokens as it arrives, then "[DONE]"."""
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    head = {"id": prefix + job.op_id, "object": kind, "created": job.created, "model": job.model}
    tail = {"usage": None} if include_usage else {}
    choices = Choices(st, job, logprobs, chat)
    sent = [0] * job.n  # tokens of each sample handed on

    def chunk(i: int, got: dict | None, reason: str | None = None) -> str:
        if chat:
            delta = {"content": got["text"]} if got is not None else {}
            choice = {"index": i, "delta": delta, "logprobs": got and got["logprobs"], "finish_reason": reason}
        else:
            choice = {"index": i, "text": got["text"] if got else "", "logprobs": got and got["logprobs"],
                      "finish_reason": reason}
        return event({**head, "choices": [choice], **tail})

    try:
        if chat:
            for i in range(job.n):
                yield event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}], **tail})
        while True:
            reports, over = await job.listener.get(KEEPALIVE_SECONDS)
            for report in reports:
                for i, tokens in enumerate(report.tokens):
                    if not tokens:
                        continue
                    top = report.top_logprobs[i] if report.top_logprobs is not None else None
                    got = choices.add(i, tokens, report.logprobs[i], top, last=False)
                    sent[i] += len(tokens)
                    if got["text"] or got["logprobs"]:
                        yield chunk(i, got)
            if over:
                job.streamed_to_end = True
                break
            if not reports:
                yield ": keep-alive\n\n"
        try:
            result = await ended(st, job)
        except WhitneyError as e:
            yield event({"error": {"message": e.message, "type": "invalid_request_error", "param": e.field,
                                   "code": e.code}})
            return
        except Exception as e:  # noqa: BLE001  (a server error, after the 200 has gone out)
            yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": "internal"}})
            return
        for i, seq in enumerate(result["sequences"]):
            rest = seq["tokens"][sent[i]:]
            top = seq.get("top_logprobs")
            got = choices.add(i, rest, seq["logprobs"][sent[i]:], top[sent[i]:] if top is not None else None,
                              last=True)
            if got["text"] or rest and logprobs:
                yield chunk(i, got)
            reason = StopReason.STOP if seq["stop_reason"] == StopReason.STOP or choices.texts[i].stopped \
                else StopReason.LENGTH
            yield chunk(i, None, reason)
        if include_usage:
            yield event({**head, "choices": [],
                         "usage": usage(job, sum(len(s["tokens"]) for s in result["sequences"]))})
        yield event("[DONE]")
    finally:
        st.scheduler.drop_stream(job.op_id)


CLIENT_GONE = "the client went away"


class SampleEvents(StreamingResponse):
    """A streamed completion; however the response ends before the stream saw the operation end (the client
    dropped it part-way, or before its first event, when the stream never even starts), the sample is cancelled."""

    def __init__(self, st: ServiceState, job: Started, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.st, self.job = st, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.streamed_to_end:
                self.st.scheduler.cancel_sample(self.job.op_id, CLIENT_GONE)


async def gone(request: Request) -> None:
    """Return once the client has gone (the request's body is read: the next message is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(st: ServiceState, job: Started, request: Request) -> dict | None:
    """The operation's result (`ended`), or None once the client has gone first: the sample is cancelled."""
    result, watch = asyncio.ensure_future(ended(st, job)), asyncio.ensure_future(gone(request))
    try:
        await asyncio.wait((result, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        cancelled = not result.done()
        if cancelled:
            result.cancel()
            st.scheduler.cancel_sample(job.op_id, CLIENT_GONE)
    return None if cancelled else result.result()


async def complete(st: ServiceState, who: str, body: wire.Sampling, chat: bool, request: Request):
    job = await run_in_threadpool(start, st, who, body, chat)
    logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SampleEvents(st, job, streamed(st, job, logprobs, chat, include_usage))
    result = await unless_gone(st, job, request)
    if result is None:  # nobody reads an answer
        return Response(status_code=204)
    return await run_in_threadpool(whole, st, job, result, logprobs, chat)


@router.post("/chat/completions", response_model=wire.ChatCompletion, status_code=200, responses=EVENT_STREAM)
async def chat_completions(body: wire.ChatCompletionRequest, st: State, who: Owner, request: Request):
    """OpenAI's chat completion: the messages rendered with the model's own chat template."""
    return await complete(st, who, body, chat=True, request=request)


@router.post("/completions", response_model=wire.Completion, status_code=200, responses=EVENT_STREAM)
async def completions(body: wire.CompletionRequest, st: State, who: Owner, request: Request):
    """OpenAI's text completion of a prompt (a string, or token ids)."""
    return await complete(st, who, body, chat=False, request=request)


@router.get("/models", response_model=wire.ModelList, status_code=200)
def list_models(st: State, who: Owner):
    """What the caller's key can name as `model`: the served base models, then its newest `LISTED` sampler
    versions ("<run_id>@<version>"), then its newest `LISTED` saved states and sampler versions by checkpoint
    id. Other keys' are never listed; older ones are not listed but still answer by name."""
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "whitney"} for name in st.models]
    cards += [{"id": f"{v['run_id']}@{v['version']}", "object": "model", "created": v["created"],
               "owned_by": v["run_id"]} for v in st.store.newest_sampler_versions(who, LISTED)]
    cards += [{"id": p["id"], "object": "model", "created": p["created"], "owned_by": p["run_id"]}
              for p in st.store.newest_checkpoints(who, LISTED)]
    return {"object": "list", "data": cards}


@router.post("/chat/render", response_model=wire.ChatRendering, status_code=200)
def render_chat(body: wire.ChatRenderRequest, st: State, who: Owner):
    """A conversation as the model reads it: its own chat template, tokenized, with each assistant
    message's tokens (end-of-turn included) marked; `whitney.datums.chat_datum` turns it into a datum."""
    try:
        _, base_model = resolve(st, who, weights_ref(st, who, body.model) if body.model else WeightsRef())
    except WhitneyError as e:
        raise renamed(e, FIELDS) from None
    rendered = st.scheduler.backend.render_chat(base_model, plain_messages(body.messages), body.add_generation_prompt,
                                                mark_assistant=True)
    return {"model": base_model, "tokens": rendered.tokens, "assistant_mask": rendered.assistant_mask}
