"""Hostile: one hostile tenant beside 31 well-behaved ones must not slow them, break them or exhaust the server
(issue 31, "Deliver" and "Done when").

`whitney serve` on the tiny model and a tiny vision model (Qwen3-VL, which takes images), in its own process, with
one key per tenant. 31 well-behaved clients, each its own key, session and rank-8 run on the tiny model (made in
the warm-up and kept through both phases), loop forward_backward (4 x 64 tokens) + optim_step, as in fairness.py.
Two phases of equal length, in one run:
  alone    the 31 clients only;
  hostile  the same, while the hostile tenant (its own key, its own process at nice 19: its client-side work is
           not the server's) sends the issue's attacks, one thread per attack, back to back, each scaled to what
           the server's limits let through:
    custom_loss       a stored custom loss of 250 x torch.logsumexp(x.expand(65536), 0) over 12 one-token datums
                      (native forward_backward): over the work budget, to be refused at once with a 400;
    custom_loss_paid  the same amplifier paid for within the budget (datums of 511 positions x K=10 target
                      candidates, 4096 units per log-prob): accepted, its cost must stay within the tenant's share;
    jpeg_text         a 4096 x 4096 progressive JPEG whose last scan is repeated 2,000 times (~180 kB), to the
                      text model (/v1/samples): refused before decoding;
    jpeg_vision       the same to the vision model: refused from its scan count, before decoding;
    jpeg_vision_max   the most decoding the limits allow: square images of the most pixels max_image_pixels
                      admits (the server's capabilities) with 64 progressive scans (the most taken), several per
                      sample request, each other bytes (no cache answers it), to
                      the vision model: decoded before queueing, at a low CPU priority;
    expected_tokens   a 28-pixel PNG declaring expected_tokens=10^9, to the vision model: refused before any size is
                      made from it;
    proto_sparse      a Tinker protobuf forward_backward of one datum of 10^6 tokens with empty sparse [10^6, 256]
                      weights (~12 MB): refused from the declared shape, before expanding;
    asample_sparse    a Tinker asample of a 10^5-token prompt with empty sparse target_prompt_logprobs
                      [10^5 - 1, 100] (JSON): refused from the prompt's length, before expanding;
    surrogate         a JSON body ["\\ud800", 0, 0, ...] of 3 MiB to /healthz, without a key;
    deep_metadata     a session whose user_metadata nests 300 levels (600 bytes): refused at the edge; and, by a
                      well-behaved key, GET /v1/checkpoints?public=true, which must keep working.
  Every key has the server's default limits: the hostile key's refused requests soon spend its
  max_refusals_per_minute (120), and its requests then wait for that budget (service/http/refusals.py).
Figures: the well-behaved clients' p99 forward_backward latency in each phase, from submission to result as the
server stamps them (created_at -> finished_at), and their ratio hostile / alone (target at most 3); every 5xx
answer over all clients, well-behaved (each response they get, retried ones included), hostile and the /healthz
probe (target 0), and the hostile tenant's accepted requests whose operation failed as `internal` (target 0); the
server's RSS growth during the hostile phase (VmRSS of the server and every process under it, a Ray backend's
workers included, every 0.5 s: its highest in the phase minus its value as the phase began; target under 300 MB).
WHITNEY_BENCH_HOSTILE_SERVE_ARGS adds `whitney serve` flags (`--backend ray`: the engine in processes of its own).
Reported besides: the hostile tenant's answers by attack and status code (with their latency and the first message
of each), the well-behaved clients' latency as they see it (submit -> result: a stalled event loop delays requests before the server stamps them), and /healthz
latency probed every 0.5 s in each phase. A 5xx, a slow refusal or a stall is a finding, reported, never hidden.
To find which attack does the harm, WHITNEY_BENCH_HOSTILE_ATTACKS=name,name runs only those (the results file
names them under settings.attacks).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import multiprocessing
import os
import threading
import time

from bench.common import Clients, ServerExited, percentile, random_tokens, sft_batch, start_server, timed, \
    tiny_model, tiny_vision_model

GOOD_KEYS = [f"bench-good-tenant-{i}" for i in range(31)]  # one key per well-behaved client: per-key limits
EVIL_KEY = "bench-hostile-tenant-key"
ATTACKS = ["custom_loss", "custom_loss_paid", "jpeg_text", "jpeg_vision", "jpeg_vision_max", "expected_tokens",
           "proto_sparse", "asample_sparse", "surrogate", "deep_metadata"]  # hostile_attacks' keys, in order


# ---- the hostile payloads --------------------------------------------------------------------------------------

def _node(op: str, name: str, target: str, *args, **kwargs) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def amplifier(rank: int, repeats: int = 250) -> dict:
    """The issue's custom loss: one log-prob expanded to 65536 elements and reduced `repeats` times (a node's read
    costs 65536, what it makes 1); the loss itself is logprobs.sum(). As POST /v1/custom_losses takes it (the
    SDK's encoding: what tests/engine/test_custom_loss.py builds)."""
    index = {"slice": [0, 1, None]} if rank == 1 else {"tuple": [0, {"slice": [0, 1, None]}]}
    nodes = [_node("placeholder", "logprobs", "logprobs"),
             _node("call_function", "first", "operator.getitem", {"ref": "logprobs"}, index),
             _node("call_method", "wide", "expand", {"ref": "first"}, 65536)]
    nodes += [_node("call_function", f"lse{i}", "torch.logsumexp", {"ref": "wide"}, 0) for i in range(repeats)]
    nodes += [_node("call_method", "loss", "sum", {"ref": "logprobs"}),
              _node("output", "output", "output", {"tuple": [{"ref": "loss"}, {"dict": {}}]})]
    return {"name": f"amplifier-rank{rank}", "inputs": [{"name": "logprobs", "rank": rank}],
            "graph": {"format": 1, "nodes": nodes}}


def one_token_datums(n: int) -> list[dict]:
    return [{"input": {"token_ids": [100 + i]},
             "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [1], "values": [200 + i]}}}
            for i in range(n)]


def candidate_datums(n: int, length: int, k: int) -> list[dict]:
    """n datums of `length` positions, each with k target candidates ([length, k] targets: length x k log-probs)."""
    out = []
    for seq in random_tokens(n, length * k, seed=7):
        out.append({"input": {"token_ids": seq[:length]},
                    "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [length, k],
                                                      "values": seq[:length * k]}}})
    return out


def flat_progressive_jpeg(size: int, scans: int) -> bytes:
    """A size x size progressive JPEG of a smooth picture (Pillow's: 10 scans), its last scan repeated until it has
    `scans`: small on the wire, a pass over the whole image per scan to decode."""
    from PIL import Image

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    out = io.BytesIO()
    image.save(out, format="JPEG", progressive=True, quality=80)
    data = out.getvalue()
    last = data.rfind(b"\xff\xda")  # the last scan: its header and data, up to the end-of-image marker
    return data[:-2] + data[last:-2] * (scans - 10) + b"\xff\xd9"


def distinct(jpeg: bytes, mark: int) -> bytes:
    """The JPEG with a comment segment holding `mark` after its start marker: the same pixels, other bytes (so
    no server-side cache of processed images answers it)."""
    comment = b"%d" % mark
    return jpeg[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + jpeg[2:]


def small_png(size: int = 28) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.linear_gradient("L").resize((size, size)).convert("RGB").save(out, format="PNG")
    return out.getvalue()


def image_chunk(data: bytes, fmt: str, **extra) -> dict:
    return {"type": "image", "data": base64.b64encode(data).decode(), "format": fmt, **extra}


def sparse_proto_body(model_id: str, tokens: int, k: int) -> bytes:
    """A Tinker forward_backward body (protobuf, as the SDK sends it) of one datum of `tokens` tokens whose weights
    are an empty sparse CSR [tokens, k] tensor: 8 bytes a row on the wire, tokens x k values once expanded."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    weights = types.TensorData(data=[], dtype="float32", shape=[tokens, k], sparse_crow_indices=[0] * (tokens + 1),
                               sparse_col_indices=[])
    datum = types.Datum(model_input=types.ModelInput.from_ints([1] * tokens), loss_fn_inputs={"weights": weights})
    return forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1)).SerializeToString()


def sparse_asample_body(base_model: str, tokens: int, k: int) -> bytes:
    """A Tinker asample body (JSON, as the SDK sends it) of a `tokens`-token prompt with empty sparse
    target_prompt_logprobs [tokens - 1, k]."""
    from tinker import types

    request = types.SampleRequest(
        prompt=types.ModelInput.from_ints([1] * tokens), sampling_params=types.SamplingParams(max_tokens=1),
        base_model=base_model, target_prompt_logprobs={
            "data": [], "dtype": "int64", "shape": [tokens - 1, k], "sparse_crow_indices": [0] * tokens,
            "sparse_col_indices": []})
    return json.dumps(request.model_dump(exclude_unset=False, exclude_none=True, mode="json")).encode()


def surrogate_body(mib: float) -> bytes:
    """["\\ud800", 0, 0, ...]: a lone surrogate, then zeros, `mib` MiB in all."""
    n = int(mib * 2**20) // 2
    return b'["\\ud800"' + b",0" * n + b"]"


def nested(levels: int):
    out: object = 1
    for _ in range(levels):
        out = [out]
    return out


# ---- the hostile tenant --------------------------------------------------------------------------------------

class Tally:
    """Answers by attack and status code (an int, or the name of a client-side exception), their latency, and the
    first message of each (attack, status)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.codes: dict[str, dict[str, int]] = {}
        self.seconds: dict[str, list[float]] = {}
        self.messages: dict[str, str] = {}

    def add(self, attack: str, code, seconds: float, message: str = "") -> None:
        with self.lock:
            counts = self.codes.setdefault(attack, {})
            counts[str(code)] = counts.get(str(code), 0) + 1
            self.seconds.setdefault(attack, []).append(seconds)
            self.messages.setdefault(f"{attack} {code}", message[:300])

    def internal(self) -> int:
        """Accepted requests whose operation failed as the server's fault (code `internal`): an operation's 5xx."""
        return sum(n for counts in self.codes.values() for code, n in counts.items() if code.endswith(":internal"))

    def fivexx(self) -> int:
        return sum(n for counts in self.codes.values() for code, n in counts.items()
                   if code.isdigit() and int(code) >= 500)


def _message(r) -> str:
    try:
        body = r.json()
        return str(body.get("message", body) if isinstance(body, dict) else body)
    except ValueError:
        return r.text


def hostile_attacks(url: str, models: dict[str, str], quick: bool, tally: Tally) -> dict:
    """Set the hostile tenant up (its sessions, runs, stored losses, Tinker model; payloads made once) and return
    {attack: send()}, where send() sends one attack and records its answer in `tally`."""
    import httpx

    import whitney
    from whitney.client import OperationFuture

    text, vision = models["text"], models["vision"]
    evil = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {EVIL_KEY}"}, timeout=300)
    good = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {GOOD_KEYS[0]}"}, timeout=300)
    tinker = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": EVIL_KEY}, timeout=300)
    anonymous = httpx.Client(base_url=url, timeout=300)
    session = evil.post("/v1/sessions", json={"user_metadata": {}}).json()["id"]

    def new_run() -> dict:
        r = evil.post(f"/v1/sessions/{session}/runs", json={"base_model": text, "lora": {"rank": 8}})
        r.raise_for_status()
        return {"id": r.json()["id"], "seq": 0}

    def loss_id(rank: int) -> str:
        r = evil.post("/v1/custom_losses", json=amplifier(rank))
        r.raise_for_status()  # a well-formed graph: stored; its cost is found when it meets datums
        return r.json()["id"]

    def send(attack: str, method: str, path: str, http=evil, **kwargs):
        t = time.perf_counter()
        try:
            r = http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            tally.add(attack, type(e).__name__, time.perf_counter() - t, str(e))
            return None
        tally.add(attack, r.status_code, time.perf_counter() - t, "" if r.status_code < 300 else _message(r))
        return r

    def follow(attack: str, r) -> None:
        """Wait for the operation an accepted request made (until the phase's end) and record how it ended, with
        its own latency (created_at -> finished_at): an accepted attack that fails as `internal` is a finding."""
        op = OperationFuture(client, r.json())
        op = op.wait(timeout=max(1.0, deadline[0] - time.monotonic()))
        status = op["status"] if op["status"] in ("succeeded", "failed") else "unfinished"
        code = (op.get("error") or {}).get("code", "")
        tally.add(f"{attack} operation", f"{status}{':' + code if code else ''}",
                  (op.get("finished_at") or time.time()) - op["created_at"], str(op.get("error") or ""))

    def training(attack: str, run: dict, body: dict, wait: bool = False) -> None:
        """A native forward_backward on the tenant's run (the seq_id advances only when one is taken); with `wait`,
        its operation's end is recorded too."""
        r = send(attack, "POST", f"/v1/runs/{run['id']}/forward_backward", json={"seq_id": run["seq"], **body})
        if r is None or r.status_code >= 300:
            return
        run["seq"] += 1
        if wait:
            follow(attack, r)

    def sample(attack: str, body: dict) -> None:
        """A native sample request; an accepted one is followed to its end."""
        r = send(attack, "POST", "/v1/samples", json=body)
        if r is not None and r.status_code < 300:
            follow(attack, r)

    client = whitney.Client(url, api_key=EVIL_KEY, timeout=300)
    deadline = [float("inf")]  # the hostile phase's end (time.monotonic()), set by run()
    over_budget, paid = loss_id(1), loss_id(2)
    runs = {"custom_loss": new_run(), "custom_loss_paid": new_run()}
    paid_datums = candidate_datums(8 if quick else 32, 511, 10)
    many_scans = flat_progressive_jpeg(4096, 2010)
    side = math.isqrt(good.get("/v1/training/capabilities").json()["limits"]["max_image_pixels"])
    most_scans = flat_progressive_jpeg(side, 64)  # the largest square image the server admits
    marks = itertools.count()  # each image sent is other bytes: decoded anew
    png = small_png()
    word = [{"type": "encoded_text", "tokens": [1, 2]}]
    tinker_session = tinker.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "bench"}
                                 ).json()["session_id"]
    model_id = tinker.post("/create_model", json={"session_id": tinker_session, "model_seq_id": 0, "base_model": text,
                                                  "lora_config": {"rank": 8, "seed": 1}}).json()["model_id"]
    proto_body = sparse_proto_body(model_id, 10**6, 256)
    asample_body = sparse_asample_body(text, 10**5, 100)
    lone_surrogate = surrogate_body(3)
    deep = {"user_metadata": {"nest": nested(300)}}

    def deep_metadata() -> None:
        r = send("deep_metadata", "POST", "/v1/sessions", json=deep)
        if r is not None and r.status_code < 300:  # stored: do its reads break?
            send("deep_metadata read", "GET", f"/v1/sessions/{r.json()['id']}")
        send("deep_metadata others' listing", "GET", "/v1/checkpoints", http=good, params={"public": "true"})

    attacks = {
        "custom_loss": lambda: training("custom_loss", runs["custom_loss"], {
            "data": one_token_datums(12), "loss_function": "custom", "loss_config": {"loss_id": over_budget}}),
        "custom_loss_paid": lambda: training("custom_loss_paid", runs["custom_loss_paid"], {
            "data": paid_datums, "loss_function": "custom", "loss_config": {"loss_id": paid}}, wait=True),
        "jpeg_text": lambda: sample("jpeg_text", {
            "base_model": text, "prompt": word + [image_chunk(many_scans, "jpeg")], "max_tokens": 1}),
        "jpeg_vision": lambda: sample("jpeg_vision", {
            "base_model": vision, "prompt": word + [image_chunk(many_scans, "jpeg")], "max_tokens": 1}),
        "jpeg_vision_max": lambda: sample("jpeg_vision_max", {
            "base_model": vision, "prompt": [c for _ in range(2 if quick else 8) for c in (
                word[0], image_chunk(distinct(most_scans, next(marks)), "jpeg"))],
            "max_tokens": 1}),
        "expected_tokens": lambda: sample("expected_tokens", {
            "base_model": vision, "prompt": word + [image_chunk(png, "png", expected_tokens=10**9)], "max_tokens": 1}),
        "proto_sparse": lambda: send("proto_sparse", "POST", "/forward_backward", http=tinker, content=proto_body,
                                     headers={"Content-Type": "application/x-protobuf"}),
        "asample_sparse": lambda: send("asample_sparse", "POST", "/asample", http=tinker, content=asample_body,
                                       headers={"Content-Type": "application/json"}),
        "surrogate": lambda: send("surrogate", "POST", "/healthz", http=anonymous, content=lone_surrogate,
                                  headers={"Content-Type": "application/json"}),
        "deep_metadata": deep_metadata,
    }
    sizes = {"custom_loss": "12 one-token datums, 250 reductions", "custom_loss_paid":
             f"{len(paid_datums)} datums x 511 positions x 10 candidates, 250 reductions",
             "jpeg_text": f"{len(many_scans)} bytes, 2010 scans", "jpeg_vision": f"{len(many_scans)} bytes, 2010 scans",
             "jpeg_vision_max": f"{2 if quick else 8} x {len(most_scans)} bytes, 64 scans, {side} x {side}",
             "expected_tokens": f"{len(png)}-byte PNG, expected_tokens 10^9",
             "proto_sparse": f"{len(proto_body)} bytes", "asample_sparse": f"{len(asample_body)} bytes",
             "surrogate": f"{len(lone_surrogate)} bytes", "deep_metadata": "300 levels"}
    def warm() -> None:
        """What a well-behaved tenant does once before the phases: a sample on the vision model with a small image
        (the model's sampler and vision tower made ready), so the RSS growth measured is the hostile phase's."""
        r = good.post("/v1/samples", json={"base_model": vision, "prompt": word + [image_chunk(png, "png")],
                                           "max_tokens": 1})
        r.raise_for_status()
        good.get(f"/v1/operations/{r.json()['id']}", params={"wait": 30}).raise_for_status()

    return {"attacks": attacks, "sizes": sizes, "deadline": deadline, "warm": warm,
            "close": lambda: [c.close() for c in (evil, good, tinker, anonymous, client)]}


def hostile_tenant(url: str, models: dict[str, str], quick: bool, chosen: list[str], conn) -> None:
    """The hostile tenant, in a process of its own at the lowest CPU priority (nice 19): on this one machine its
    own client-side work (building and sending thousands of requests) must not count as the server's slowdown, as
    it would not where the tenant runs elsewhere; the server still answers as many of its requests as it takes.
    Sets up (hostile_attacks), sends ("ready", sizes, attack names), waits for ("start", seconds), sends every
    chosen attack back to back on a thread each until then, and sends ("tally", codes, seconds, messages)."""
    os.nice(19)
    tally = Tally()
    hostile = hostile_attacks(url, models, quick, tally)
    try:
        hostile["warm"]()
        conn.send(("ready", hostile["sizes"], list(hostile["attacks"])))
        _, seconds = conn.recv()
        deadline = time.monotonic() + seconds
        hostile["deadline"][0] = deadline

        def attacker(attack: str, send) -> None:
            while time.monotonic() < deadline:
                try:
                    send()
                except Exception as e:  # counted, never hidden (a wait that failed, a body it could not read)
                    tally.add(f"{attack} client", type(e).__name__, 0.0, str(e))
                    time.sleep(0.5)

        threads = [threading.Thread(target=attacker, args=(a, send), daemon=True)
                   for a, send in hostile["attacks"].items() if a in chosen]
        for t in threads:
            t.start()
        for t in threads:  # an attack in flight at the deadline ends first (its answer counts)
            t.join(timeout=300)
        conn.send(("tally", tally.codes, tally.seconds, tally.messages))
    finally:
        hostile["close"]()


def run(quick: bool = False, dtype: str = "float32") -> dict:
    seconds = 20 if quick else 90
    n_small = 8 if quick else 31
    small_batch = [sft_batch(4, 64, seed=i) for i in range(n_small)]
    phases: dict[str, Clients] = {}
    tally = Tally()
    responses: dict[str, dict[int, int]] = {"alone": {}, "hostile": {}}  # well-behaved answers by status
    health: dict[str, list[float]] = {"alone": [], "hostile": []}
    health_codes: dict[str, int] = {}
    rss: list[tuple[str, float, float]] = []  # (phase, seconds since the start, MB)
    phase = ["warm-up"]
    exited: list[str] = []  # the server ended while measured
    lock = threading.Lock()
    keys = [a for key in GOOD_KEYS[:n_small] + [EVIL_KEY] for a in ("--api-key", key)]
    serve_args = os.environ.get("WHITNEY_BENCH_HOSTILE_SERVE_ARGS", "").split()
    with start_server(*serve_args, "--dtype", dtype, "--model", tiny_vision_model(), *keys, "--max-sequences", "64",
                      "--session-timeout", "3600", model=tiny_model()) as server:
        import httpx

        import whitney

        with whitney.Client(server.url, api_key=GOOD_KEYS[0]) as client:
            caps = client.capabilities()
        names = [m["name"] for m in caps["models"]]
        models = {"text": next(m["name"] for m in caps["models"] if not m.get("vision")),
                  "vision": next(m["name"] for m in caps["models"] if m.get("vision"))}
        chosen = [a.strip() for a in os.environ.get("WHITNEY_BENCH_HOSTILE_ATTACKS", "").split(",") if a.strip()]
        unknown = set(chosen) - set(ATTACKS)
        if unknown:
            raise ValueError(f"WHITNEY_BENCH_HOSTILE_ATTACKS: unknown attacks {sorted(unknown)}; known: {ATTACKS}")
        chosen = chosen or list(ATTACKS)
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        tenant = context.Process(target=hostile_tenant, args=(server.url, models, quick, chosen, theirs), daemon=True)
        tenant.start()
        _, sizes, names_sent = ours.recv()  # set up, and the vision model's sampler warmed by a well-behaved sample
        assert names_sent == list(ATTACKS), names_sent
        done = threading.Event()
        t0 = time.monotonic()

        def watch() -> None:
            """The server's RSS and a /healthz round trip every 0.5 s, by phase."""
            with httpx.Client(base_url=server.url, timeout=300) as http:
                while not done.wait(0.5):
                    try:
                        rss.append((phase[0], time.monotonic() - t0, server.tree_rss_kib() * 1024 / 1e6))
                    except ServerExited as e:  # a finding: reported, and the clients' errors show it too
                        exited.append(f"{phase[0]}: {e}")
                        return
                    t = time.perf_counter()
                    try:
                        code = str(http.get("/healthz").status_code)
                    except httpx.HTTPError as e:
                        code = type(e).__name__
                    with lock:
                        health_codes[code] = health_codes.get(code, 0) + 1
                        if phase[0] in health:
                            health[phase[0]].append(time.perf_counter() - t)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        runs: dict = {}  # client index -> its run, kept from the warm-up on

        def setup(i: int, client):
            client.http.headers["Authorization"] = f"Bearer {GOOD_KEYS[i]}"
            current = phase[0]

            def count(response) -> None:
                with lock:
                    by_code = responses.setdefault(current, {})
                    by_code[response.status_code] = by_code.get(response.status_code, 0) + 1

            client.http.event_hooks["response"].append(count)
            if i not in runs:
                runs[i] = client.create_session(bench="hostile").create_run(rank=8, seed=i)
            runs[i].client = client  # this phase's connection (and its answer count); the run numbers on
            return runs[i]

        def small_step(i: int, run_):
            t = time.perf_counter()
            fb = run_.forward_backward(small_batch[i])
            opt = run_.optim_step(learning_rate=1e-4)
            server_side = timed(fb)
            seen = time.perf_counter() - t  # as the client sees it: a stalled event loop shows here, not above
            return [("forward_backward", server_side), ("forward_backward_client", seen), ("optim_step", timed(opt))]

        warm = Clients(server.url)
        warm.run(n_small, setup, small_step, 5 if quick else 15)
        try:
            for name in ("alone", "hostile"):
                phase[0] = name
                clients = Clients(server.url)
                if name == "hostile":
                    ours.send(("start", seconds))
                clients.run(n_small, setup, small_step, seconds)
                if name == "hostile":  # its attacks in flight at the deadline end first (their answers count)
                    _, tally.codes, tally.seconds, tally.messages = ours.recv()
                phases[name] = clients
            phase[0] = "after"
            time.sleep(2.0)  # the RSS as the hostile phase's last answers are freed
        finally:
            done.set()
            watcher.join()
            tenant.join(timeout=60)

    alone, contended = phases["alone"].summary(), phases["hostile"].summary()
    nan = float("nan")
    p99 = {k: x.get("forward_backward", {}).get("p99_s", nan) for k, x in (("alone", alone), ("hostile", contended))}
    ratio = p99["hostile"] / p99["alone"]
    p99_client = {k: x.get("forward_backward_client", {}).get("p99_s", nan)
                  for k, x in (("alone", alone), ("hostile", contended))}
    in_phase = [m for p, _, m in rss if p == "hostile"]
    before = [m for p, _, m in rss if p == "alone"]
    start = before[-1] if before else (in_phase[0] if in_phase else nan)
    growth = max(in_phase) - start if in_phase else nan
    good_5xx = sum(n for by_code in responses.values() for code, n in by_code.items() if code >= 500)
    health_5xx = sum(n for code, n in health_codes.items() if code.isdigit() and int(code) >= 500)
    fivexx = good_5xx + tally.fivexx() + health_5xx
    attacks = {a: {"answers": tally.codes.get(a, {}), "p50_s": percentile(tally.seconds.get(a, []), 0.5),
                   "max_s": max(tally.seconds.get(a, [nan]))} for a in sorted(tally.codes)}
    return {
        "benchmark": "hostile",
        "settings": {"seconds_per_phase": seconds, "small_clients": n_small, "small_batch": "4 x 64",
                     "serve_args": serve_args,
                     "model": "tiny llama (2 x 64) and tiny Qwen3-VL", "rank": 8, "models": names,
                     "attacks": {a: size for a, size in sizes.items() if a in chosen}},
        "alone": alone, "hostile": contended,
        "hostile_answers": attacks, "hostile_messages": tally.messages,
        "well_behaved_answers": {p: {str(k): v for k, v in sorted(c.items())} for p, c in responses.items()},
        "healthz": {p: {"n": len(xs), "p50_s": percentile(xs, 0.5), "p99_s": percentile(xs, 0.99),
                        "max_s": max(xs, default=nan)} for p, xs in health.items()},
        "healthz_answers": health_codes,
        "rss_mb": [[p, round(t, 1), round(m, 1)] for p, t, m in rss],
        "rss_growth_mb": growth, "server_exited": exited,
        "checks": [
            {"name": "hostile: well-behaved clients' p99 forward_backward latency, with / without one hostile tenant",
             "ratio": ratio, "target": 3.0, "op": "<="},
            {"name": "hostile: 5xx answers, every client (well-behaved, hostile, /healthz probe)",
             "ratio": float(fivexx), "target": 0.0, "op": "<=", "unit": "errors"},
            {"name": "hostile: the hostile tenant's accepted requests whose operation failed as `internal`",
             "ratio": float(tally.internal()), "target": 0.0, "op": "<=", "unit": "errors"},
            {"name": "hostile: server RSS growth during the hostile phase", "ratio": growth, "target": 300.0,
             "op": "<", "unit": "MB"},
            {"name": "(info) hostile: well-behaved clients' forward_backward operations completed, with / without",
             "ratio": contended.get("forward_backward", {"n": 0})["n"] / max(1, alone.get("forward_backward",
                                                                                           {"n": 0})["n"]),
             "target": None, "op": None},
            {"name": "(info) hostile: well-behaved clients' p99 forward_backward latency as they see it (submit -> "
                     "result), with / without", "ratio": p99_client["hostile"] / p99_client["alone"], "target": None,
             "op": None},
            {"name": "(info) hostile: /healthz p99 latency, with / without the hostile tenant",
             "ratio": percentile(health["hostile"], 0.99) / percentile(health["alone"], 0.99)
             if health["alone"] and health["hostile"] else nan, "target": None, "op": None},
            {"name": "hostile: well-behaved clients' errors in both phases",
             "ratio": float(alone["n_errors"] + contended["n_errors"]), "target": 0.0, "op": "<=", "unit": "errors"},
        ],
    }
