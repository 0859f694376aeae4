"""Capacity: many runs on one server, idle ones paged out to disk (issue 15), against the main before it.

SmolLM2 (the embedded default), LoRA rank 32, each run stepped once: forward_backward (1 x 64 tokens) +
optim_step, created by several client threads at once. The server's memory is VmRSS of its process
(/proc/PID/status), read every second.

  current    `whitney serve --page-idle-seconds P --max-resident-runs 3`: first one run is stepped, and its RSS is the
             one-run server's; then runs are created up to the target (1,000; --quick 40). The creation
             stops early, with the reason recorded, if the server's RSS passes 8 GiB, the machine's
             available memory falls under 4 GiB, the paged files would leave less than 20 GiB of disk
             free, or the time budget is spent (a run pages out at about 136 MiB at rank 32: 1,000 of
             them need about 133 GiB of disk). Then, once every run is idle and paged out (RSS settled):
               page-in   for 20 paged-out runs one at a time, a forward (1 x 16 tokens) and the same
                         forward again right after: the server-stamped latency of the first minus the
                         second is the page-in (the first operation of a paged-out run pays it),
                         after the same pair on another paged-out run, untimed (`warm_up`): the first
                         forward a server ever runs pays one-time set-up (over a second here);
               active    50 runs (paged out before) loop forward_backward + optim_step from 50 clients
                         for a while: the RSS's peak over that time against the one-run server's. The
                         budget of 3 resident runs is what holds it (50 runs' state is 50 x 130 MiB): the
                         engine takes the 50 runs' work 3 runs at a time, paging the rest.
             Page-out/in seconds per run: from the server's metrics when it exposes them (any
             /metrics series with "page" in its name), and bytes per paged run from <data dir>/paged.
  baseline   the commit before issue 15 (no paging): runs created the same way until the same guards
             stop it; the run count it reached and its RSS per run.

Targets: RSS (50 active, after 1,000 created) at most 2x the one-run server's; page-in p50 at most
100 ms; runs reached (1,000); zero errors.

`--rank R` runs the same at another LoRA rank, into its own result (capacity-rank{R}.json): a paged run's
bytes scale with the rank (rank 8: ~33 MiB, 1,000 runs ~32 GiB), so where the disk cannot hold 1,000 runs
at rank 32 the run count, the RSS with every run paged out and with 50 active are measured at a rank
whose 1,000 runs it can hold. What a paged-out run keeps in memory (its files' entries: one per tensor,
1,266 here) does not depend on the rank.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

from bench.baseline import BASELINE_REF, checkout, start_server
from bench.common import median, percentile, sft_batch

RANK = 32
# The current server's residency budget: 3 runs in memory plus the one on its way to disk (a page-out is
# written while the next run is read in), 1 + 3 runs' state over a one-run server's (~3 x 130-170 MiB).
MAX_RESIDENT = 3
RSS_GUARD_KIB = 8 * 2**20  # stop creating runs when the server's RSS passes 8 GiB (the machine has 24)
AVAILABLE_GUARD_KIB = 4 * 2**20  # ... or the machine's available memory falls under 4 GiB
DISK_RESERVE = 20 * 2**30  # ... or the disk would have less than 20 GiB free
CREATE_BUDGET_S = 1500.0  # ... or this time is spent (about 1 run/s here: 1,000 runs take ~1,000 s)


def available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class Monitor:
    """The server's RSS every second, in the background; `peak(since)` over a window."""

    def __init__(self, server):
        self.server, self.samples = server, []  # (time.monotonic(), VmRSS KiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.samples.append((time.monotonic(), self.server.status()["VmRSS"]))
            except OSError:
                return

    def peak(self, since: float) -> int:
        return max((kib for t, kib in self.samples if t >= since), default=self.server.status()["VmRSS"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def residency(client) -> dict | None:
    """{"in_memory": n, "paged_out": m} from the capabilities, or None where the server does not report it."""
    for path in ("/v1/capabilities", "/v1/training/capabilities"):
        try:
            runs = client.request("GET", path).get("runs")
        except Exception:
            continue
        if isinstance(runs, dict) and "paged_out" in runs:
            return runs
    return None


def paging_metrics(client) -> dict[str, float]:
    """Every /metrics sample whose name mentions paging (page-out/in histograms, counters, gauges)."""
    try:
        text = client.request("GET", "/metrics")
    except Exception:
        return {}
    text = text.decode() if isinstance(text, bytes) else str(text)
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+([-+\w.]+)$", line)
        if m and "page" in m.group(1):
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


def create_runs(server, target: int, threads: int, seconds: float, batch: list[dict], data_dir: Path | None,
                errors: list[str], clients: list, rank: int = RANK) -> tuple[list, str]:
    """Create (LoRA `rank`) and step once up to `target` runs from `threads` clients (appended to `clients`,
    left open), until a guard trips; (the runs, why the creation stopped)."""
    import whitney

    runs: list = []
    lock = threading.Lock()
    stop = {"why": ""}
    deadline = time.monotonic() + seconds
    free0 = shutil.disk_usage(data_dir.parent if data_dir else "/").free  # data_dir: made at the first page-out

    def guard() -> str:
        if len(runs) >= target:
            return "target reached"
        if time.monotonic() > deadline:
            return f"time budget spent ({seconds:.0f} s)"
        if server.status()["VmRSS"] > RSS_GUARD_KIB:
            return f"server RSS passed {RSS_GUARD_KIB / 2**20:.0f} GiB"
        if available_kib() < AVAILABLE_GUARD_KIB:
            return f"machine's available memory under {AVAILABLE_GUARD_KIB / 2**20:.0f} GiB"
        if data_dir is not None and runs:
            written = dir_bytes(data_dir)
            per_run = written / max(1, len(runs))
            if free0 - written - 2 * threads * per_run < DISK_RESERVE:
                return f"disk: paged files would leave under {DISK_RESERVE / 2**30:.0f} GiB free"
        return ""

    def worker(w: int) -> None:
        # The client stays open (its session heartbeating) for the later phases, which use these runs.
        client = whitney.Client(server.url, timeout=600)
        clients.append(client)
        try:
            session = client.create_session(bench="capacity", worker=str(w))
            while True:
                with lock:
                    why = stop["why"] or guard()
                    if why:
                        stop["why"] = why
                        return
                    index = len(runs)
                    runs.append(None)  # reserved; filled once stepped
                run_ = session.create_run(rank=rank, seed=index)
                run_.forward_backward(batch).result()
                run_.optim_step(learning_rate=1e-4).result()
                with lock:
                    runs[index] = run_
        except Exception as e:  # counted, never hidden
            with lock:
                errors.append(f"creating runs (worker {w}): {type(e).__name__}: {e}")
                stop["why"] = stop["why"] or f"error: {type(e).__name__}"

    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(threads)]
    for t in ts:
        t.start()
    last = time.monotonic()
    while any(t.is_alive() for t in ts):
        time.sleep(0.5)
        if time.monotonic() - last > 15:
            last = time.monotonic()
            print(f"  capacity: {sum(r is not None for r in runs)} runs stepped, server RSS "
                  f"{server.status()['VmRSS'] / 2**20:.2f} GiB", flush=True)
    for t in ts:
        t.join()
    return [r for r in runs if r is not None], stop["why"]


def wait_paged(client, n: int, page_idle: float) -> dict | None:
    """Poll the residency until every one of the `n` runs is paged out (at most a minute past the idle time);
    the last reading (None where the server does not report it: then the idle time and a sweep are waited)."""
    deadline = time.monotonic() + page_idle + 60
    res = residency(client)
    if res is None:
        time.sleep(page_idle + 5)
    while res is not None and res["paged_out"] < n and time.monotonic() < deadline:
        time.sleep(0.5)
        res = residency(client)
    return res


def page_in_latency(runs: list, probe: list[dict]) -> list[dict]:
    """Per run, one at a time: a forward on the paged-out run, then the same forward again (resident now)."""
    out = []
    for run_ in runs:
        first = run_.forward(probe).wait()
        again = run_.forward(probe).wait()
        for op in (first, again):
            if op["status"] != "succeeded":
                raise RuntimeError(f"forward ended {op['status']}: {op.get('error')}")
        t1, t2 = (op["finished_at"] - op["created_at"] for op in (first, again))
        out.append({"first_s": t1, "resident_s": t2, "page_in_s": t1 - t2})
    return out


def active(runs: list, batch: list[dict], seconds: float, errors: list[str]) -> dict:
    """Each run in its own thread loops forward_backward + optim_step for `seconds`; server-stamped latencies."""
    lat: dict[str, list[float]] = {"first_forward_backward": [], "forward_backward": [], "optim_step": []}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(run_) -> None:
        first = True
        try:
            while time.monotonic() < deadline:
                fb, opt = run_.forward_backward(batch), run_.optim_step(learning_rate=1e-4)
                for kind, future in (("first_forward_backward" if first else "forward_backward", fb),
                                     ("optim_step", opt)):
                    op = future.wait()
                    if op["status"] != "succeeded":
                        raise RuntimeError(f"{kind} ended {op['status']}: {op.get('error')}")
                    with lock:
                        lat[kind].append(op["finished_at"] - op["created_at"])
                first = False
        except Exception as e:  # counted, never hidden
            with lock:
                errors.append(f"active run {run_.id}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=loop, args=(r,), daemon=True) for r in runs]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    return {"runs": len(runs), "seconds": seconds, "wall_s": wall,
            "steps_per_s": len(lat["optim_step"]) / wall,
            "latency": {k: {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)}
                        for k, v in lat.items()}}


def measure(tree: Path | None, dtype: str, target: int, threads: int, create_s: float, n_probe: int, n_active: int,
            active_s: float, page_idle: float | None, rank: int = RANK) -> dict:
    """One server (this tree with paging, or the baseline without): the phases above; RSS in MiB."""
    import whitney

    batch, probe = sft_batch(1, 64, seed=1), sft_batch(1, 16, seed=2)
    # One key creates every run: its default quota (256 live runs) would stop the bench, not the server.
    args = ["--dtype", dtype, "--max-runs-per-key", "0"] + (
        ["--page-idle-seconds", str(page_idle), "--max-resident-runs", str(MAX_RESIDENT)] if page_idle is not None
        else [])
    errors: list[str] = []
    clients: list = []
    out: dict = {}
    with start_server(tree, *args) as server:
        out["whitney_file"] = server.extra["whitney_file"]
        monitor = Monitor(server)
        paged_dir = Path(server.data_dir.name) / "paged" if page_idle is not None else None
        try:
            with whitney.Client(server.url, timeout=600) as probe_client:
                out["rss_idle_mib"] = server.status()["VmRSS"] / 1024
                one, _ = create_runs(server, 1, 1, 600, batch, None, errors, clients, rank)
                out["rss_one_run_mib"] = server.status()["VmRSS"] / 1024
                t = time.monotonic()
                runs, why = create_runs(server, target - 1, threads, create_s, batch, paged_dir, errors, clients, rank)
                runs = one + runs
                out["create"] = {"runs": len(runs), "stopped": why, "seconds": time.monotonic() - t,
                                 "runs_per_s": (len(runs) - 1) / (time.monotonic() - t),
                                 "rss_mib": server.status()["VmRSS"] / 1024,
                                 "peak_rss_mib": monitor.peak(t) / 1024, "residency": residency(probe_client)}
                print(f"  capacity: {len(runs)} runs ({why}); RSS {out['create']['rss_mib']:.0f} MiB, "
                      f"residency {out['create']['residency']}", flush=True)
                if page_idle is None:  # the baseline: how far it got, and what a run costs it
                    extra = out["create"]["rss_mib"] - out["rss_one_run_mib"]
                    out["rss_per_run_mib"] = extra / max(1, len(runs) - 1)
                    return out
                res = wait_paged(probe_client, len(runs), page_idle)
                out["settled"] = {"residency": res, "rss_mib": server.status()["VmRSS"] / 1024,
                                  "paged_bytes": dir_bytes(paged_dir) if paged_dir else None}
                if res and res["paged_out"]:
                    out["settled"]["mib_per_paged_run"] = out["settled"]["paged_bytes"] / res["paged_out"] / 2**20
                print(f"  capacity: settled {res}, RSS {out['settled']['rss_mib']:.0f} MiB", flush=True)
                probes = runs[:n_probe]
                if len(runs) > n_probe + n_active:  # the server's first forwards ever, on a run used nowhere else
                    out["warm_up"] = page_in_latency(runs[-1:], probe)
                out["page_in"] = page_in_latency(probes, probe)
                chosen = runs[n_probe:n_probe + n_active]
                t = time.monotonic()
                out["active"] = active(chosen, batch, active_s, errors)
                out["active"]["peak_rss_mib"] = monitor.peak(t) / 1024
                out["active"]["rss_mib"] = server.status()["VmRSS"] / 1024
                out["active"]["residency"] = residency(probe_client)
                res = wait_paged(probe_client, len(runs), page_idle)
                out["after"] = {"residency": res, "rss_mib": server.status()["VmRSS"] / 1024}
                out["paging_metrics"] = paging_metrics(probe_client)
        finally:
            monitor.stop()
            out["rss_timeline_mib"] = [[round(t - monitor.samples[0][0], 1), round(k / 1024)]
                                       for t, k in monitor.samples[::5]] if monitor.samples else []
            for c in clients:
                c.close()
            out["errors"], out["n_errors"] = errors[:10], len(errors)
    return out


def run(quick: bool = False, dtype: str = "float32", baseline: str = BASELINE_REF, rank: int = RANK) -> dict:
    """The phases above at LoRA `rank` (the issue's 32 by default; `python -m bench --only capacity --rank R`):
    the result is "capacity", or "capacity-rank{R}" at another rank."""
    target, threads = (40, 4) if quick else (1000, 4)
    create_s, active_s = (90.0, 15.0) if quick else (CREATE_BUDGET_S, 60.0)
    n_probe, n_active = (5, 8) if quick else (20, 50)
    page_idle = 3.0 if quick else 10.0
    tree, sha = checkout(baseline)
    current = measure(None, dtype, target, threads, create_s, n_probe, n_active, active_s, page_idle, rank)
    base = measure(tree, dtype, target, threads, create_s, 0, 0, 0.0, None, rank)
    page_in = [p["page_in_s"] for p in current.get("page_in", [])]
    metrics = current.get("paging_metrics", {})

    def mean_of(kind: str) -> float | None:  # seconds per page-out/in: the server's counters, total / count
        seconds, count = metrics.get(f"whitney_page_{kind}_seconds_total"), metrics.get(f"whitney_page_{kind}s_total")
        return seconds / count if seconds is not None and count else None

    one = current["rss_one_run_mib"]
    summary = {
        "runs_target": target, "runs_reached": current["create"]["runs"], "stopped": current["create"]["stopped"],
        "rss_one_run_mib": one, "rss_after_creation_settled_mib": current.get("settled", {}).get("rss_mib"),
        "rss_peak_active_mib": current.get("active", {}).get("peak_rss_mib"),
        "page_in_p50_ms": 1000 * median(page_in) if page_in else None,
        "page_in_p90_ms": 1000 * percentile(page_in, 0.9) if page_in else None,
        "first_forward_p50_ms": 1000 * median([p["first_s"] for p in current.get("page_in", [])]) if page_in else None,
        "resident_forward_p50_ms": 1000 * median([p["resident_s"] for p in current.get("page_in", [])])
        if page_in else None,
        "runs_created_per_s": current["create"]["runs_per_s"],
        "page_out_mean_ms": 1000 * x if (x := mean_of("out")) is not None else None,
        "page_in_mean_ms_metrics": 1000 * x if (x := mean_of("in")) is not None else None,
        "mib_per_paged_run": current.get("settled", {}).get("mib_per_paged_run"),
        "baseline_runs_reached": base["create"]["runs"], "baseline_stopped": base["create"]["stopped"],
        "baseline_rss_mib": base["create"]["rss_mib"], "baseline_rss_per_run_mib": base["rss_per_run_mib"],
        "errors": current["n_errors"] + base["n_errors"],
    }
    peak = summary["rss_peak_active_mib"]
    label = "capacity" if rank == RANK else f"capacity (rank {rank})"
    return {
        "benchmark": "capacity" if rank == RANK else f"capacity-rank{rank}",
        "settings": {"model": "SmolLM2-135M-Instruct", "rank": rank, "step": "forward_backward 1 x 64 + optim_step",
                     "runs_target": target, "creating_threads": threads, "create_budget_s": create_s,
                     "page_idle_seconds": page_idle, "max_resident_runs": MAX_RESIDENT, "page_in_probes": n_probe,
                     "active_runs": n_active,
                     "active_s": active_s, "baseline_ref": baseline, "baseline_commit": sha, "dtype": dtype},
        "summary": summary, "current": current, "baseline": base,
        "checks": [
            {"name": f"{label}: runs created and stepped once on one server", "ratio": float(summary["runs_reached"]),
             "target": float(target), "op": ">=", "unit": "ops"},
            {"name": f"{label}: server RSS with {n_active} runs active after the rest were created / a one-run "
                     "server's", "ratio": peak / one if peak else None, "target": 2.0, "op": "<="},
            {"name": f"{label}: page-in p50 (first forward of a paged-out run minus the same forward resident)",
             "ratio": summary["page_in_p50_ms"], "target": 100.0, "op": "<=", "unit": "ms"},
            {"name": f"{label}: errors", "ratio": float(summary["errors"]), "target": 0.0, "op": "<=",
             "unit": "errors"},
            {"name": f"(info) {label}: server RSS once every run is paged out / a one-run server's",
             "ratio": summary["rss_after_creation_settled_mib"] / one
             if summary["rss_after_creation_settled_mib"] else None, "target": None, "op": None},
            {"name": f"(info) {label}: page-out per run, mean (server metrics)", "ratio": summary["page_out_mean_ms"],
             "target": None, "op": None, "unit": "ms"},
            {"name": f"(info) {label}: runs the baseline held before a guard stopped it",
             "ratio": float(summary["baseline_runs_reached"]), "target": None, "op": None, "unit": "ops"},
        ],
    }
