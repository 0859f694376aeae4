"""Valid text at the edge: every string the service takes in or stores is Unicode that encodes as UTF-8.

Two ways in for invalid text, both refused before any route runs (`TextCheck`, on the outer app, so
the mounted /api/v1 sub-app is covered too), with a 400 {code: invalid_input, field, message}:
  - a request body that is not valid UTF-8 (binary bodies, declared as protobuf or octet-stream, are
    exempt: they are read by their own decoder, which checks its strings);
  - a JSON string or key holding a lone surrogate, written as an escape (`"\\udc80"`): valid JSON, but
    no UTF-8 encoding exists for it, so it cannot be stored or echoed back. The field names its JSON path.
Path and query parameters need no check: the server decodes their percent-escapes with U+FFFD for any
invalid byte, so they never hold a surrogate.

Rows stored before this check may still hold such strings: `loads` (the store's JSON reader) turns
each lone surrogate into U+FFFD, so one bad row cannot break a listing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from whitney.service.http.bodies import read_body, replaying

# Cheap pre-check on raw bytes: only a body with a \uD800-\uDFFF escape can decode to a lone surrogate
# (a surrogate pair decodes to one valid character, so a match is then confirmed by a full parse).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_TEXT = re.compile(SURROGATE_ESCAPE.pattern.decode())
SURROGATE = re.compile("[\ud800-\udfff]")
BINARY_TYPES = ("application/x-protobuf", "application/protobuf", "application/octet-stream")


def invalid_path(value: Any) -> str | None:
    """The JSON path ("a.b.0.c") of a string or key in `value` holding a lone surrogate, else None.

    A bad key is named by its own path with the surrogate shown as U+FFFD. Iterative: depth is not limited.
    """
    stack: list[tuple[Any, list[str]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if SURROGATE.search(item):
                return ".".join(path) or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                where = path + [SURROGATE.sub("\ufffd", key)]
                if SURROGATE.search(key):
                    return ".".join(where)
                stack.append((child, where))
        elif isinstance(item, list):
            stack.extend((child, path + [str(i)]) for i, child in enumerate(item))
    return None


def sanitize(value: Any) -> Any:
    """`value` with every lone surrogate in its strings and keys replaced by U+FFFD."""
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {sanitize(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [sanitize(v) for v in value]
    return value


def loads(text: str | bytes) -> Any:
    """json.loads for stored JSON columns: lone surrogates (only possible where the text holds a
    surrogate escape) come back as U+FFFD. PostgreSQL's driver hands the column over as bytes."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    value = json.loads(text)
    return sanitize(value) if _SURROGATE_ESCAPE_TEXT.search(text) else value


def body_error(body: bytes, content_type: str | None) -> tuple[str, str] | None:
    """(field, message) if a request body holds invalid text, else None."""
    if not body or (content_type or "").split(";")[0].strip().lower() in BINARY_TYPES:
        return None
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return "body", f"the body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}"
    if not SURROGATE_ESCAPE.search(body):
        return None
    try:
        path = invalid_path(json.loads(body))
    except (ValueError, RecursionError):  # not JSON: the route answers that
        return None
    if path is None:
        return None
    return path, f"{path}: text must be valid Unicode; a lone surrogate (\\ud800-\\udfff) is not"


class TextCheck:
    """ASGI middleware: reads each request body once (BodyLimit, outside it, has bounded its size),
    answers 400 if it holds invalid text (`body_error`), else hands the same bytes on to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, _ = await read_body(receive)
        if body is None:  # the client went away
            return
        content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
        error = body_error(body, content_type)
        if error is not None:
            payload = json.dumps({"code": "invalid_input", "field": error[0], "message": error[1]}).encode()
            await send({"type": "http.response.start", "status": 400, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
            return await send({"type": "http.response.body", "body": payload})
        await self.app(scope, replaying(body, receive), send)
