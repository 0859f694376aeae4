"""Tenants: 32 clients on one server at once, against the main before issue 15, in one run (issue 15).

Each client has its own session and rank-8 run and loops forward_backward (4 x 64 tokens, cross_entropy)
+ optim_step (both submitted, then both awaited), and every 8th step save_weights_for_sampler + an
8-token sample of that version. Every client first does one untimed step and sample (warm-up), then all
start together and run for a bounded time (90 s, or MIN_ROUNDS times the warm-up where longer). On the
tiny model (2 x 64, where per-operation machinery counts) and on SmolLM2 (the embedded default), one server
after the other, each a fresh process:

  baseline   the commit before issue 15 (default 3f82ad7, `python -m bench --baseline REF`), served from a
             copy of its tree under build/ (bench/baseline.py), through the native client;
  current    this tree, through the native client;
  sdk        the same workload through the official `tinker` SDK (bench/tenants_sdk.py): this tree
             (SDK 0.38, train_unembed=False) and SkyRL tx 0.4.0 (its pinned SDK 0.25, JAX on the CPU,
             one adapter slot per client and sampler) on SkyRL's copy of the same model; only where
             SkyRL is set up (../shared/peers/skyrl/setup.sh), else reported as not measured, with why.

Operations/s = operations (every kind) completed before the deadline / the phase's seconds. Latency
of an operation: the server's created_at -> finished_at (native client; the client threads share the
2 cores, so this is the figure the targets use) and the client-observed call -> result (both, and
the only one through the SDK). Targets (current / baseline): operations/s >= 4x, p99 operation latency
<= 1/4, zero errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.baseline import BASELINE_REF, checkout, start_server
from bench.common import ServerExited, free_port, percentile, sft_batch, tiny_model
from whitney.engine import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("WHITNEY_PEERS_DIR", ROOT.parent / "shared" / "peers"))
SKYRL = Path(os.environ.get("PEER", Path(tempfile.gettempdir()) / "peers" / "skyrl"))
RANK, BATCH, SEQ_LEN, SAMPLE_EVERY, SAMPLE_TOKENS = 8, 4, 64, 8, 8
# A phase lasts its seconds, or this many times the warm-up (every client's first step and sample, about one
# round of all of them) where that is longer: a server whose round of 32 clients outlasts the phase (SmolLM2
# in float32 on 2 cores: ~95 s before issue 15) would otherwise finish a handful of operations in time, and
# the ratio would measure where the deadline fell, not throughput.
MIN_ROUNDS = 4
# SkyRL's server and engine together, of the machine's 24 GiB. On the tiny model it peaks at 6.2 GiB; on SmolLM2 with 32
# clients it passed this, and, tried once with 19 GiB (2026-12-05), that too, before its warm-up round was over.
SKYRL_RSS_GUARD_KIB = 14 * 2**20


def drive(url: str, n: int, seconds: float, min_rounds: float = MIN_ROUNDS) -> dict:
    """n native clients against `url`: warm-up, then `seconds` of the loop (or `min_rounds` x the warm-up's
    time, where longer: the phase's "seconds" in the result); every operation's latencies."""
    import whitney

    batches = [sft_batch(BATCH, SEQ_LEN, seed=i) for i in range(n)]
    records: list[tuple[str, float, float, float]] = []  # (kind, server s, client s, done s since start)
    errors: list[str] = []
    lock = threading.Lock()
    clock = {"t0": 0.0, "deadline": 0.0, "seconds": seconds}

    def go() -> None:  # run by the barrier before it releases anyone: every client sees the deadline
        clock["t0"] = time.monotonic()
        clock["seconds"] = max(seconds, min_rounds * (clock["t0"] - t_setup))
        clock["deadline"] = clock["t0"] + clock["seconds"]

    ready = threading.Barrier(n + 1, action=go)

    def settle(kind: str, future, t_submit: float, record: bool) -> dict:
        op = future.wait()
        t = time.monotonic()
        if op["status"] != "succeeded":
            raise RuntimeError(f"{kind} ended {op['status']}: {op.get('error')}")
        if record:
            with lock:
                records.append((kind, op["finished_at"] - op["created_at"], t - t_submit, t - clock["t0"]))
        return op["result"]

    def step(run_, i: int, k: int, record: bool) -> None:
        t = time.monotonic()
        fb = run_.forward_backward(batches[i])
        opt = run_.optim_step(learning_rate=1e-4)
        settle("forward_backward", fb, t, record)
        settle("optim_step", opt, t, record)
        if k % SAMPLE_EVERY == 0:
            t = time.monotonic()
            version = settle("save_weights_for_sampler", run_.save_weights_for_sampler(), t, record)["version"]
            t = time.monotonic()
            prompt = batches[i][0]["input"]["token_ids"][:16]
            out = settle("sample", run_.sample(prompt, version, max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=k),
                         t, record)
            if not out["sequences"][0]["tokens"]:
                raise RuntimeError("a sample came back empty")

    def client(i: int) -> None:
        c = whitney.Client(url, timeout=600)
        run_ = None
        try:
            run_ = c.create_session(bench="tenants").create_run(rank=RANK, seed=i)
            step(run_, i, SAMPLE_EVERY, record=False)  # warm-up: one step and one sample, untimed
        except Exception as e:
            with lock:
                errors.append(f"client {i} setup: {type(e).__name__}: {e}")
            run_ = None
        try:
            ready.wait(timeout=1800)
        except threading.BrokenBarrierError:
            pass
        k = 0
        try:
            while run_ is not None and time.monotonic() < clock["deadline"]:
                k += 1
                step(run_, i, k, record=True)
        except Exception as e:  # counted, never hidden
            with lock:
                errors.append(f"client {i}: {type(e).__name__}: {e}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    t_setup = time.monotonic()
    for t in threads:
        t.start()
    ready.wait(timeout=1800)
    for t in threads:
        t.join()
    return {"setup_s": clock["t0"] - t_setup, "wall_s": time.monotonic() - clock["t0"],
            "seconds": clock["seconds"], "records": records, "errors": errors}


def summarize(raw: dict, seconds: float, native: bool) -> dict:
    """ops/s before the deadline, latency percentiles (all operations and per kind), a 10 s timeline."""
    recs = raw["records"]  # native: (kind, server, client, done); SDK: [kind, client, done]
    done = [r[-1] for r in recs]
    in_time = sum(1 for t in done if t <= seconds)

    def pcts(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_s": percentile(xs, 0.5), "p99_s": percentile(xs, 0.99),
                "max_s": max(xs) if xs else float("nan")}

    def lat(rs: list) -> dict:
        out = {"client": pcts([r[-2] for r in rs])}
        if native:
            out["server"] = pcts([r[1] for r in rs])
        return out

    kinds = sorted({r[0] for r in recs})
    buckets = [0] * max(1, int(seconds // 10) + (1 if seconds % 10 else 0))
    for t in done:
        if t <= seconds:
            buckets[min(len(buckets) - 1, int(t // 10))] += 1
    return {"operations": len(recs), "operations_in_time": in_time, "operations_per_s": in_time / seconds,
            "setup_s": raw.get("setup_s"), "overrun_s": max(0.0, raw.get("wall_s", seconds) - seconds),
            "latency": lat(recs), "by_kind": {k: lat([r for r in recs if r[0] == k]) for k in kinds},
            "ops_per_10s": buckets, "n_errors": len(raw["errors"]), "errors": raw["errors"][:10]}


def native_phase(tree: Path | None, model: str, dtype: str, n: int, seconds: float) -> dict:
    with start_server(tree, "--dtype", dtype, model=model) as server:
        where = server.extra["whitney_file"]
        print(f"  tenants: {n} clients against {where} on {Path(model).name} for {seconds:.0f}s or "
              f"{MIN_ROUNDS} warm-up rounds", flush=True)
        raw = drive(server.url, n, seconds)
        out = summarize(raw, raw["seconds"], native=True)
        out["seconds"] = raw["seconds"]
        try:
            out["rss_mib"] = server.status()["VmRSS"] / 1024
        except ServerExited as e:  # it died under the load: what the clients saw stays, marked as such
            print(f"  -> {e}", flush=True)
            out["server_exited"] = str(e)
            out["n_errors"] = max(1, out["n_errors"])
    out["whitney_file"] = where
    print(f"  -> {out['operations_per_s']:.2f} ops/s over {out['seconds']:.0f} s, p50 {out['latency']['server']['p50_s']:.2f} s, p99 "
          f"{out['latency']['server']['p99_s']:.2f} s, {out['n_errors']} errors", flush=True)
    return out


def sdk_phase(python: str, url: str, base_model: str, n: int, seconds: float, no_unembed: bool,
              guard=None) -> dict:
    """bench/tenants_sdk.py under `python` against `url`. `guard()`, polled every second, returns why to stop
    (the server is too big for the machine), and the phase then ends as not measured, with that reason."""
    with tempfile.TemporaryDirectory(prefix="whitney-tenants-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [python, str(ROOT / "bench" / "tenants_sdk.py"), base_model, "--clients", str(n), "--seconds",
               str(seconds), "--rank", str(RANK), "--batch", str(BATCH), "--seq-len", str(SEQ_LEN),
               "--sample-every", str(SAMPLE_EVERY), "--sample-tokens", str(SAMPLE_TOKENS), "--json", str(out)]
        env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-bench", "HF_HUB_OFFLINE": "1"}
        with open(Path(tmp) / "log.txt", "w+") as log:
            proc = subprocess.Popen(cmd + (["--no-unembed"] if no_unembed else []), env=env, stdout=log,
                                    stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + seconds + 2400
            why = ""
            while proc.poll() is None:
                why = (guard() if guard else "") or ("" if time.monotonic() < deadline else "the clients never ended")
                if why:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(1.0)
            log.seek(0)
            text = log.read()
        if why:
            return {"missing": f"stopped: {why}"}
        if proc.returncode != 0 or not out.exists():
            return {"missing": f"tenants_sdk.py exited {proc.returncode}: {text[-2000:]}"}
        raw = json.loads(out.read_text())
    res = summarize(raw, seconds, native=False)
    res["sdk"], res["seconds"] = raw["sdk"], seconds
    print(f"  -> SDK {raw['sdk']}: {res['operations_per_s']:.1f} ops/s, client p99 "
          f"{res['latency']['client']['p99_s']:.2f} s, {res['n_errors']} errors", flush=True)
    return res


def group_rss_kib(leader: int) -> int:
    """The summed VmRSS of the processes in process group `leader` (a server and its engine subprocesses)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != leader:  # field 5: the process group id
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def skyrl_phase(model_dir: Path, n: int, seconds: float) -> dict:
    """SkyRL tx on `model_dir` with an adapter slot per client (a sampler uses its client's; slot 0 is the
    base model's); the workload through SDK 0.25. Stopped, and reported as not held, if its processes pass
    SKYRL_RSS_GUARD or the machine's available memory falls under 3 GiB."""
    sdk = SKYRL / "sdk025" / "bin" / "python"
    if not (SKYRL / "venv" / "bin" / "python").exists() or not sdk.exists() or not model_dir.exists():
        return {"missing": f"SkyRL is not set up under {SKYRL} (run {PEERS / 'skyrl' / 'setup.sh'})"}
    from bench.capacity import available_kib

    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="skyrl-tenants-", dir=SKYRL))
    config = {"max_lora_adapters": n + 1, "max_lora_rank": RANK, "sample_max_num_sequences": max(16, n)}
    env = {**os.environ, "PEER": str(SKYRL), "RUN": str(run_dir), "BACKEND_CONFIG": json.dumps(config)}
    start = subprocess.run(["bash", str(PEERS / "skyrl" / "start_server.sh"), str(model_dir), str(port)], env=env,
                           capture_output=True, text=True)
    peak = {"kib": 0}
    try:
        if start.returncode != 0:
            return {"missing": f"SkyRL's server did not start: {start.stdout[-1500:]}"}
        leader = int((run_dir / "server.pid").read_text())

        def guard() -> str:
            rss = group_rss_kib(leader)
            peak["kib"] = max(peak["kib"], rss)
            if rss > SKYRL_RSS_GUARD_KIB:
                return (f"SkyRL tx could not hold {n} clients on {model_dir.name} here: its processes' RSS reached "
                        f"{rss / 2**20:.1f} GiB (guard {SKYRL_RSS_GUARD_KIB / 2**20:.0f} GiB of the machine's 24)")
            if available_kib() < 3 * 2**20:
                return (f"SkyRL tx could not hold {n} clients on {model_dir.name} here: the machine's available "
                        f"memory fell under 3 GiB (its processes' RSS {rss / 2**20:.1f} GiB)")
            return ""

        print(f"  tenants: {n} clients against SkyRL tx on {model_dir.name} ({config}) for {seconds:.0f}s", flush=True)
        out = sdk_phase(str(sdk), f"http://127.0.0.1:{port}", str(model_dir), n, seconds, no_unembed=False,
                        guard=guard)
        out["backend_config"] = config
        out["peak_rss_gib"] = peak["kib"] / 2**20  # SkyRL's processes, sampled every second
        return out
    finally:
        subprocess.run(["bash", str(PEERS / "skyrl" / "stop_server.sh")], env=env, capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # its log, database and checkpoints
        if peak["kib"]:
            print(f"  SkyRL tx peak RSS {peak['kib'] / 2**20:.1f} GiB", flush=True)


def run(quick: bool = False, dtype: str = "float32", baseline: str = BASELINE_REF,
        models: tuple[str, ...] = ("tiny", "smollm2"), peers: bool = True) -> dict:
    """`models` and `peers` (the SDK part) narrow a run by hand; the suite runs everything. --quick: 8 clients,
    15 s, and SkyRL on the tiny model only (its compilation alone takes minutes)."""
    n = 8 if quick else 32
    seconds = {"tiny": 15.0, "smollm2": 15.0} if quick else {"tiny": 90.0, "smollm2": 90.0}
    tree, sha = checkout(baseline)
    models = {k: v for k, v in {"tiny": tiny_model(), "smollm2": DEFAULT_MODEL}.items() if k in models}
    skyrl_models = {"tiny": SKYRL / "models" / "tiny_llama", "smollm2": SKYRL / "models" / "smol_hf"}
    results: dict[str, dict] = {}
    for name, model in models.items():
        r = results[name] = {}
        r["baseline"] = native_phase(tree, model, dtype, n, seconds[name])
        r["current"] = native_phase(None, model, dtype, n, seconds[name])
        if not peers or (quick and name != "tiny"):
            r["sdk"] = {"skyrl": {"missing": "not run (--quick runs SkyRL on the tiny model only)" if peers
                                  else "not run (peers=False)"}}
            continue
        # Both SDK phases last as long as the native phase of this tree did (its warm-up rounds included): the
        # SDK's client rounds take as long, and SkyRL's warm-up (JAX compilation) would inflate a phase of its own.
        sdk_seconds = r["current"]["seconds"]
        skyrl = skyrl_phase(skyrl_models[name], n, sdk_seconds)
        r["sdk"] = {"skyrl": skyrl}
        if skyrl_models[name].exists():  # Whitney through the SDK on SkyRL's model dir (also where SkyRL failed)
            with start_server(None, "--dtype", dtype, model=str(skyrl_models[name])) as server:
                r["sdk"]["whitney"] = sdk_phase(sys.executable, server.url, skyrl_models[name].name, n,
                                                sdk_seconds, no_unembed=True)
    return {
        "benchmark": "tenants",
        "settings": {"clients": n, "seconds": seconds, "rank": RANK, "batch": f"{BATCH} x {SEQ_LEN}",
                     "sample_every": SAMPLE_EVERY, "sample_tokens": SAMPLE_TOKENS, "baseline_ref": baseline,
                     "baseline_commit": sha, "baseline_tree": str(tree), "dtype": dtype},
        "results": results,
        "summary": table(results),
        "checks": checks(results),
    }


def table(results: dict) -> list[dict]:
    """One row per model and contender: the figures the checks compare."""
    rows = []
    for model, r in results.items():
        contenders = [(k, r[k], "native") for k in ("baseline", "current")]
        contenders += [(k, v, "sdk") for k, v in r.get("sdk", {}).items()]
        for who, x, client in contenders:
            if "missing" in x:
                rows.append({"model": model, "contender": who, "client": client, "missing": x["missing"][:300]})
                continue
            lat = x["latency"]
            sample = x["by_kind"].get("sample", {}).get("server" if client == "native" else "client", {})
            rows.append({"model": model, "contender": who, "client": client,
                         "ops_per_s": round(x["operations_per_s"], 2), "phase_s": x.get("seconds"),
                         "p50_s": lat.get("server", lat["client"])["p50_s"],
                         "p99_s": lat.get("server", lat["client"])["p99_s"],
                         "client_p50_s": lat["client"]["p50_s"], "client_p99_s": lat["client"]["p99_s"],
                         "sample_p50_s": sample.get("p50_s"), "sample_p99_s": sample.get("p99_s"),
                         "errors": x["n_errors"]})
    return rows


def checks(results: dict) -> list[dict]:
    out = []
    for model, r in results.items():
        b, c = r["baseline"], r["current"]

        def ratio(x: float, y: float) -> float | None:
            return x / y if y else None

        out += [
            {"name": f"tenants ({model}): operations/s, current / baseline",
             "ratio": ratio(c["operations_per_s"], b["operations_per_s"]), "target": 4.0, "op": ">="},
            {"name": f"tenants ({model}): p99 operation latency (server), current / baseline",
             "ratio": ratio(c["latency"]["server"]["p99_s"], b["latency"]["server"]["p99_s"]), "target": 0.25,
             "op": "<="},
            {"name": f"tenants ({model}): errors, current", "ratio": float(c["n_errors"]), "target": 0.0, "op": "<=",
             "unit": "errors"},
            {"name": f"(info) tenants ({model}): p99 operation latency (client-observed), current / baseline",
             "ratio": ratio(c["latency"]["client"]["p99_s"], b["latency"]["client"]["p99_s"]), "target": None,
             "op": None},
            {"name": f"(info) tenants ({model}): p99 sample latency (server), current / baseline",
             "ratio": ratio(c["by_kind"].get("sample", {}).get("server", {}).get("p99_s", float("nan")),
                            b["by_kind"].get("sample", {}).get("server", {}).get("p99_s", 0.0)),
             "target": None, "op": None},
            {"name": f"(info) tenants ({model}): operations/s, current", "ratio": c["operations_per_s"],
             "target": None, "op": None, "unit": "ops/s"},
            {"name": f"(info) tenants ({model}): errors, baseline", "ratio": float(b["n_errors"]), "target": None,
             "op": None, "unit": "errors"},
        ]
        sdk = r.get("sdk", {})
        w, s = sdk.get("whitney"), sdk.get("skyrl", {})
        out.append({"name": f"(info) tenants ({model}, SDK): operations/s, Whitney / SkyRL tx",
                    "ratio": ratio(w["operations_per_s"], s["operations_per_s"]) if w and "missing" not in w
                    and "missing" not in s else None, "target": None, "op": None})
    return out
