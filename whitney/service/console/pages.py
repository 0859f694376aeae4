"""The console's routes: pages, the parts htmx refreshes in place, and the JSON the curves poll.

`public` needs no key (the sign-in form); every route of `router` depends on `viewer`, so none can show
data without a valid key. Changes (delete, export) go through the same store functions as the API and
take only htmx requests (the HX-Request header, which a cross-site form cannot send; the cookie is
SameSite=Strict too).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from whitney.errors import Conflict
from whitney.service.api.native import checkpoints
from whitney.service.console import configuration, curves_csv, queries
from whitney.service.console.auth import COOKIE, SESSION_SECONDS, SignIn, session_token, viewer, viewer_digest
from whitney.service.console.exports import EXPORTABLE, export_peft
from whitney.service.console.server import server_view
from whitney.service.http import signing
from whitney.service.http.deps import ServiceState, new_router
from whitney.service.store import run_metrics, run_samples
from whitney.service.store.keys import Unauthorized
from whitney.service.store.lifecycle import OPERATION_PENDING, RUN_LIVE, RUN_OPEN

Viewer = Annotated[str, Depends(viewer)]
SPARKLINES = 50  # the newest runs whose recent losses the runs list draws
COMPARED = 8  # runs overlaid at most on the compare page
PALETTE = ("#4f46e5", "#0d9488", "#f59e0b", "#db2777", "#2563eb", "#65a30d", "#9333ea", "#dc2626")  # charts.js's
public = new_router()
router = new_router(dependencies=[Depends(viewer)])


def _context(request: Request) -> dict:
    """What every page shows: where the console is mounted, and who is signed in (an owner's first digits)."""
    st: ServiceState = request.app.state.whitney
    try:
        who = viewer(request)
    except SignIn:
        who = None
    return {"base": request.scope.get("root_path", ""), "keys_required": st.keys.required(), "viewer": who,
            "path": request.url.path, "server_url": f"{request.url.scheme}://{request.url.netloc}"}


templates = Jinja2Templates(directory=Path(__file__).resolve().parent / "templates", context_processors=[_context])


def _ago(ts: float | None) -> str:
    if ts is None:
        return "—"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{int(s // size)} {unit} ago"
    return "just now" if s < 5 else f"{int(s)} s ago"


def _when(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


def _size(n: int | float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _number(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def _sparkline(values: list[float], width: int = 120, height: int = 28) -> str:
    """SVG polyline points of `values` scaled into a width x height box (2 px margin), or '' under 2 values."""
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = (width - 4) / (len(values) - 1)
    return " ".join(f"{2 + i * step:.1f},{2 + (height - 4) * (high - v) / span:.1f}" for i, v in enumerate(values))


def _css_id(text: str) -> str:
    """`text` as an element id a CSS selector takes as it is (a Tinker run id holds colons)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


templates.env.filters.update(ago=_ago, when=_when, duration=_duration, size=_size, number=_number,
                             sparkline=_sparkline, css_id=_css_id)
templates.env.globals.update(LIVE=RUN_LIVE, PENDING=OPERATION_PENDING, EXPORTABLE=EXPORTABLE)


def _state(request: Request) -> ServiceState:
    return request.app.state.whitney


def _htmx_only(request: Request) -> None:
    """Changes come from the console's own buttons only (htmx sends HX-Request; a cross-site form cannot)."""
    if not request.headers.get("hx-request"):
        raise Conflict("console changes are made from the console's buttons (HX-Request header missing)",
                       field="hx-request")


# ---- signing in ------------------------------------------------------------------------------

@public.get("/login", response_class=HTMLResponse)
def login_form(request: Request, reason: str = "", next: str = ""):
    return templates.TemplateResponse(request, "login.html", {"reason": reason, "next": next, "error": None})


@public.post("/login", response_class=HTMLResponse)
async def login(request: Request):
    """Check the key (a valid key has an owner; a wrong one is refused here, saying so) and keep, not the key,
    but a session token signed by this server in an HttpOnly cookie (auth.py)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key, target = form.get("key", [""])[0].strip(), form.get("next", [""])[0]
    base = request.scope.get("root_path", "")
    try:  # a key not cached is looked up in the store: on a worker thread, not the event loop
        valid = bool(key) and await run_in_threadpool(_state(request).keys.owner, key) != ""
    except Unauthorized:  # unknown or revoked
        valid = False
    if not valid:
        error = "Enter your API key." if not key else "This key is not valid on this server (unknown or revoked)."
        return await run_in_threadpool(  # the page's context reads the key ring (the store): not on the event loop
            lambda: templates.TemplateResponse(request, "login.html", {"reason": "", "next": target, "error": error},
                                               status_code=401))
    if not target.startswith(f"{base}/") or target.startswith("//") or "/login" in target:
        target = f"{base}/"
    response = RedirectResponse(target, status_code=303)
    # Never the key itself: a signed token of its digest that no script can read (auth.py).
    response.set_cookie(COOKIE, session_token(key), max_age=SESSION_SECONDS, path=base or "/", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@public.post("/logout")
def logout(request: Request):
    base = request.scope.get("root_path", "")
    response = RedirectResponse(f"{base}/login", status_code=303)
    response.delete_cookie(COOKIE, path=base or "/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    return response


# ---- sessions and runs -------------------------------------------------------------------------

def _sessions(st: ServiceState, who: str, q: str = "", status: str = "") -> dict:
    """The runs list: the newest runs matching the search (text, status) under their sessions; with a search,
    only the sessions it found runs in."""
    status = status if status in queries.RUN_FILTERS else ""
    runs, total = queries.find_runs(st.store, who, q, status)
    ids = [r["id"] for r in runs]
    counts, losses = queries.operation_counts(st.store, ids), queries.recent_losses(st.store, ids[:SPARKLINES])
    by_session: dict[str, list[dict]] = {}
    for run in runs:
        recent = losses.get(run["id"], [])
        by_session.setdefault(run["session_id"], []).append(
            {**run, "counts": counts.get(run["id"], {}), "losses": recent, "last_loss": recent[-1] if recent else None})
    sessions = [{**asdict(s), "runs": by_session.get(s.id, [])} for s in reversed(st.store.list_sessions(who))]
    searching = bool(q.strip() or status)
    if searching:
        sessions = [s for s in sessions if s["runs"]]
    return {"sessions": sessions, "summary": queries.owner_summary(st.store, who), "owner": who,
            "q": q, "status": status, "filters": queries.RUN_FILTERS, "searching": searching,
            "shown": len(runs), "total": total}


@router.get("/", response_class=HTMLResponse)
def home(request: Request, who: Viewer, q: str = "", status: str = ""):
    return templates.TemplateResponse(request, "sessions.html", _sessions(_state(request), who, q, status))


@router.get("/parts/sessions", response_class=HTMLResponse)
def sessions_part(request: Request, who: Viewer, q: str = "", status: str = ""):
    return templates.TemplateResponse(request, "_sessions.html", _sessions(_state(request), who, q, status))


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, who: Viewer, run: Annotated[list[str], Query()] = []):  # noqa: B006 (FastAPI's form)
    """Runs side by side: their settings in one table, their curves overlaid (one series per run)."""
    st = _state(request)
    ids = list(dict.fromkeys(run))[:COMPARED]
    runs = [st.store.get_run(run_id, who) for run_id in ids]  # another key's run: 404
    counts = queries.operation_counts(st.store, ids)
    rows = []
    for i, r in enumerate(runs):
        config = configuration.run_config(st.store, r)
        settings = {s["name"]: s for section in config["sections"] if section["kind"] != "forward"
                    for s in section["settings"]}  # the training loss's and the optimizer's
        rows.append({"run": r, "color": PALETTE[i % len(PALETTE)], "config": config, "settings": settings,
                     "counts": counts[r.id]})
    base = request.scope.get("root_path", "")
    charted = [{"id": row["run"].id, "url": f"{base}/runs/{row['run'].id}/curves", "color": row["color"],
                "start": row["run"].created_at} for row in rows]
    return templates.TemplateResponse(request, "compare.html", {"rows": rows, "charted": charted,
                                                                "compared": COMPARED})


def _run_live(st: ServiceState, who: str, run_id: str) -> dict:
    run = st.store.get_run(run_id, who)
    counts = queries.operation_counts(st.store, [run_id])[run_id]
    return {"run": run, "counts": counts, "last_loss": queries.last_losses(st.store, [run_id]).get(run_id),
            "timeline": queries.timeline(st.store, run_id), "now": time.time(),
            "live": run.status in RUN_LIVE or any(counts.get(s) for s in OPERATION_PENDING)}


def _run_files(st: ServiceState, who: str, run_id: str) -> dict:
    run = st.store.get_run(run_id, who)
    packages = [{**asdict(p), "bytes": queries.directory_bytes(p.path)}
                for p in reversed(st.store.list_packages(who, run_id))]
    live_ids = {p["id"] for p in packages}
    versions = [{**v, "sampleable": run.status in RUN_OPEN or v["package_id"] in live_ids}
                for v in queries.sampler_versions(st.store, run_id)]
    return {"run": run, "packages": packages, "versions": versions, "live": run.status in RUN_LIVE}


def _run_config(st: ServiceState, who: str, run_id: str) -> dict:
    run = st.store.get_run(run_id, who)
    return {"run": run, "config": configuration.run_config(st.store, run), "live": run.status in RUN_LIVE}


def _run_samples(st: ServiceState, who: str, run_id: str, step: int | None) -> dict:
    """The samples the run's loop logged at `step` (default: its newest step that has samples)."""
    run = st.store.get_run(run_id, who)
    steps = run_samples.sample_steps(st.store, run_id)
    pinned = step is not None and step in {s for s, _ in steps}  # else it follows the newest step
    if not pinned:
        step = steps[0][0] if steps else None
    rows = [] if step is None else run_samples.list_samples(st.store, run_id, who, step=step,
                                                            limit=run_samples.LIMITS.max_samples_per_request)
    return {"run": run, "steps": steps, "step": step, "pinned": pinned, "samples": rows,
            "live": run.status in RUN_LIVE}


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, who: Viewer):
    st = _state(request)
    context = {**_run_live(st, who, run_id), **_run_files(st, who, run_id)}
    context["session"] = st.store.get_session(context["run"].session_id, who)
    context["config"] = configuration.run_config(st.store, context["run"])
    context["sampled"] = _run_samples(st, who, run_id, None)
    return templates.TemplateResponse(request, "run.html", context)


@router.get("/runs/{run_id}/parts/config", response_class=HTMLResponse)
def run_config_part(request: Request, run_id: str, who: Viewer):
    return templates.TemplateResponse(request, "_run_config.html", _run_config(_state(request), who, run_id))


@router.get("/runs/{run_id}/parts/samples", response_class=HTMLResponse)
def run_samples_part(request: Request, run_id: str, who: Viewer, step: str = Query("", max_length=20)):
    """The samples of `step` (empty: the newest step's, followed as new steps come)."""
    sampled = _run_samples(_state(request), who, run_id, int(step) if step.isdigit() else None)
    return templates.TemplateResponse(request, "_run_samples.html", {"run": sampled["run"], "sampled": sampled})


@router.get("/runs/{run_id}/curves.csv")
def run_curves_csv(request: Request, run_id: str, who: Viewer):
    """Every charted value of the run as CSV (curves_csv.py), streamed: the store is read a page at a time on the
    thread pool (Starlette iterates a plain generator there)."""
    st = _state(request)
    st.store.get_run(run_id, who)
    return StreamingResponse(curves_csv.lines(st.store, run_id), media_type="text/csv; charset=utf-8",
                             headers={"Content-Disposition": f'attachment; filename="{_css_id(run_id)}-curves.csv"'})


@router.get("/runs/{run_id}/parts/live", response_class=HTMLResponse)
def run_live_part(request: Request, run_id: str, who: Viewer):
    context = {**_run_live(_state(request), who, run_id), "oob": True}  # status and timeline swapped out of band
    return templates.TemplateResponse(request, "_run_live.html", context)


@router.get("/runs/{run_id}/parts/files", response_class=HTMLResponse)
def run_files_part(request: Request, run_id: str, who: Viewer):
    return templates.TemplateResponse(request, "_run_files.html", _run_files(_state(request), who, run_id))


@router.get("/runs/{run_id}/curves")
def run_curves(request: Request, run_id: str, who: Viewer, after: int = Query(-1, ge=-1),
               logged_after: int = Query(-1, ge=-1)):
    """The run's metric points after seq_id `after` (see queries.curve_points), the metrics its loop logged
    after id `logged_after` (run_metrics.points_after), and the run's status."""
    st = _state(request)
    run = st.store.get_run(run_id, who)
    return JSONResponse({"status": run.status, "live": run.status in RUN_LIVE,
                         "points": queries.curve_points(st.store, run_id, after),
                         "logged": run_metrics.points_after(st.store, run_id, logged_after)})


# ---- checkpoints -------------------------------------------------------------------------------

@router.get("/checkpoints/{package_id}/archive")
def checkpoint_archive(request: Request, package_id: str, who: Viewer):
    """The package as a tar archive (the API's download, for a browser that signed in with a cookie)."""
    return checkpoints.download_checkpoint(package_id, _state(request), who)


@router.delete("/checkpoints/{package_id}", response_class=HTMLResponse)
def checkpoint_delete(request: Request, package_id: str, who: Viewer):
    _htmx_only(request)
    st = _state(request)
    package = checkpoints.delete_checkpoint(package_id, st, who)  # the API's delete: the row, then the files
    return templates.TemplateResponse(request, "_run_files.html", _run_files(st, who, package.run_id))


@router.post("/checkpoints/{package_id}/export", response_class=HTMLResponse)
async def checkpoint_export(request: Request, package_id: str, who: Viewer):
    _htmx_only(request)
    st = _state(request)
    package = await export_peft(st, who, package_id)
    # Rendered on the thread pool: the part reads the store (its files, and the viewer's key for the page).
    return await run_in_threadpool(lambda: templates.TemplateResponse(request, "_run_files.html",
                                                                      _run_files(st, who, package.run_id)))


# ---- the playground and the server -------------------------------------------------------------

PLAYGROUND_TOKEN_SECONDS = 600  # how long the playground's token to the API works (it asks for one per chat)


@router.get("/playground/token")
def playground_token(request: Request, who: Viewer):
    """A short-lived token (signing.py's JWT of the viewer's key digest, as the Tinker SDK's) that the playground's
    script sends to /v1/chat/completions: the session cookie is HttpOnly, so no script sees the key or the cookie.
    None when the server requires no keys and the viewer gave none."""
    digest = viewer_digest(request)
    return JSONResponse({"token": signing.mint_jwt({"key_digest": digest}, PLAYGROUND_TOKEN_SECONDS)
                         if digest else None})


@router.get("/playground", response_class=HTMLResponse)
def playground(request: Request, who: Viewer, model: str = "", compare: str = ""):
    """Pick weights (a base model, a run's sampler version, a checkpoint), and a second to compare with, and
    chat with them; the page's script streams from POST /v1/chat/completions."""
    st = _state(request)
    runs = list(reversed(st.store.list_runs(who)))
    versions = queries.owner_sampler_versions(st.store, who, [r.id for r in runs])
    packages = [p for p in reversed(st.store.list_packages(who)) if p.kind in ("state", "sampler")]
    kept = {p.id for p in packages}
    # A live run samples its versions from memory; an ended one from their packages, so a deleted one is gone.
    choices = [{"value": f"{run.id}@{version}", "run": run, "version": version}
               for run in runs for version, package_id in versions.get(run.id, [])
               if run.status in RUN_OPEN or package_id in kept]
    return templates.TemplateResponse(request, "playground.html", {
        "models": st.models, "versions": choices, "packages": packages, "selected": model, "compare": compare,
        "known": model in st.models or model in kept or any(c["value"] == model for c in choices)})


@router.get("/playground/wait")
def playground_wait(request: Request, who: Viewer, op: str = Query(max_length=64)):
    """What the viewer's sampling operation waits behind (queries.sample_wait); the playground asks while no
    token of its answer has come."""
    return JSONResponse(queries.sample_wait(_state(request).store, who, op))


def _server(request: Request) -> dict:
    return server_view(_state(request), request.app.state.throughput)


@router.get("/server", response_class=HTMLResponse)
def server_page(request: Request, who: Viewer):
    return templates.TemplateResponse(request, "server.html", _server(request))


@router.get("/server/parts/stats", response_class=HTMLResponse)
def server_part(request: Request, who: Viewer):
    return templates.TemplateResponse(request, "_server.html", _server(request))


@router.get("/server/throughput")
def server_throughput(request: Request, who: Viewer):
    """Rates (per second) at each reading of the last ten minutes: training tokens, sampled tokens, operations."""
    throughput = request.app.state.throughput
    throughput.watch()
    return JSONResponse(throughput.series())
