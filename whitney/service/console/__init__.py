"""The web console at /console: a reader over the service's own state (store, scheduler, backend, metrics).

Server-rendered pages (Jinja2) with htmx for the parts that refresh in place, uPlot for the curves, and
small scripts of our own (charts.js: the charts and their view, smoothing and axes; console.js: a run's live
curves and the server's throughput; compare.js: runs overlaid; playground.js: the streaming chat, one model or
two side by side); the third-party files are
vendored under static/vendor/ (versions and licenses in static/vendor/README.md), so nothing is built or
fetched at run time. See docs/ARCHITECTURE.md, "The console".

Keys: the API's KeyGate lets /console through and the console checks keys itself. Its static files are
public; every other route needs the viewer's key, sent in a cookie set by the sign-in form (or as
`Authorization: Bearer`), and shows only that key's sessions, runs and checkpoints. Pages without a valid
key go to the sign-in form; data requests get a 401.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from whitney.errors import WhitneyError
from whitney.service.console import pages
from whitney.service.console.auth import SignIn, wants_page
from whitney.service.console.pages import templates
from whitney.service.console.server import Throughput
from whitney.service.http.deps import ServiceState, new_app

HERE = Path(__file__).resolve().parent
# Scripts only from our own files (no inline script, no other origin); the playground's requests go to
# this server only. Styles may be inline (uPlot sizes its elements with them).
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
          "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")


def create_console(state: ServiceState, status: dict[type, int]) -> FastAPI:
    """The console app, to be mounted at /console on the service's app; `status` maps the domain errors
    to HTTP statuses, as the API does."""
    app = new_app(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.whitney = state
    app.state.throughput = Throughput(state.metrics)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.include_router(pages.public)
    app.include_router(pages.router)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", POLICY)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        if not request.url.path.startswith(f"{request.scope.get('root_path', '')}/static/"):
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.exception_handler(SignIn)
    async def sign_in(request: Request, exc: SignIn):
        base = request.scope.get("root_path", "")
        target = f"{base}/login?reason={exc.reason}&next={quote(request.url.path, safe='/')}"
        if request.headers.get("hx-request"):  # htmx follows HX-Redirect with a full page load
            return Response(status_code=401, headers={"HX-Redirect": target})
        if request.method == "GET" and wants_page(request):
            return RedirectResponse(target, status_code=303)
        message = "a valid API key is required (sign in at /console/login or send Authorization: Bearer <key>)"
        return JSONResponse(status_code=401, content={"code": "unauthorized", "field": "authorization",
                                                      "message": message})

    @app.exception_handler(WhitneyError)
    async def domain_error(request: Request, exc: WhitneyError):
        code = status.get(type(exc), 400)
        if wants_page(request):
            return templates.TemplateResponse(request, "error.html", {"status": code, "message": exc.message},
                                              status_code=code)
        return JSONResponse(status_code=code, content=exc.to_dict())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if wants_page(request):
            return templates.TemplateResponse(request, "error.html", {"status": exc.status_code,
                                                                      "message": str(exc.detail)},
                                              status_code=exc.status_code)
        return JSONResponse(status_code=exc.status_code, content={"code": "http_error", "message": str(exc.detail)})

    return app
