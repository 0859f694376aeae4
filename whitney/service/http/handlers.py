"""Error answers in one shape for both APIs (native /v1 and Tinker /api/v1).

Every 4xx body is {code, message, field?, datum_index?}: a domain error (`whitney.errors`) with the
status its app maps it to (and its headers: a quota's Retry-After), Starlette's own errors (no such
path, wrong method), and schema violations (422, the first one named by its field, all listed without
echoing the input back, since it may not even be text).
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from whitney.errors import WhitneyError

# pydantic's names for the branch of a union or a constrained type inside a `loc`: not a field.
_TYPE_TAG = re.compile(r"^(list|dict|tuple|set|int|float|str|bool|union|tagged-union|(constrained|function)-[\w-]+)"
                       r"(\[.*\])?$")
_CHUNK_TAGS = ("encoded_text", "image", "image_asset_pointer", "other")  # schemas.Chunk's union branches


def install(app: FastAPI, status: dict[type, int]) -> None:
    """Register the three handlers on `app`; `status` maps each domain error type to its HTTP status."""

    @app.exception_handler(WhitneyError)
    async def domain_error(request: Request, exc: WhitneyError):
        return JSONResponse(status_code=status.get(type(exc), 400), content=exc.to_dict(),
                            headers=getattr(exc, "headers", None))  # QuotaExceeded's Retry-After

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content={"code": code, "message": str(exc.detail)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(status_code=422, content=invalid_request(exc.errors()))


def invalid_request(errors: list[dict]) -> dict:
    """The 422 body: the first violation's field (datum index where it is inside `data`) and message."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    # An unparsable body's loc ends in a character offset, which names no field.
    loc = [] if first.get("type") == "json_invalid" else field_path(first.get("loc", ()))
    where = ".".join(loc) or "body"
    body = {"code": "invalid_request", "field": where, "message": f"{where}: {_text(first.get('msg'))}",
            "errors": [{"loc": [_text(p) for p in e.get("loc", ())], "msg": _text(e.get("msg")),
                        "type": _text(e.get("type"))} for e in errors[:20]]}
    if "data" in loc and len(loc) > loc.index("data") + 1 and loc[loc.index("data") + 1].isdigit():
        body["datum_index"] = int(loc[loc.index("data") + 1])
    return body


def field_path(loc) -> list[str]:
    """A pydantic `loc` as the request's field path: no "body" prefix, no union-branch or type tags (a chunk's
    type tag follows its index: chunks.1.image.format is chunks.1.format)."""
    return [_text(p) for i, p in enumerate(loc) if p != "body" and not (isinstance(p, str) and _TYPE_TAG.match(p))
            and not (p in _CHUNK_TAGS and i > 0 and isinstance(loc[i - 1], int))]


def _text(value) -> str:
    """Printable UTF-8 whatever the request held (a lone surrogate in a key is shown escaped)."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")
