"""Valid text at the edge: every string the service takes in or stores is Unicode that encodes as UTF-8.

Two ways in for invalid text, both refused before any route runs (`TextCheck`, on the outer app, so
the mounted /api/v1 sub-app is covered too), with a 400 {code: invalid_input, field, message}:
  - a request body that is not valid UTF-8 (binary bodies, declared as protobuf or octet-stream, are
    exempt: they are read by their own decoder, which checks its strings);
  - a JSON string or key holding a lone surrogate, written as an escape (`"\\udc80"`): valid JSON, but
    no UTF-8 encoding exists for it, so it cannot be stored or echoed back. The field names its JSON path.
Path and query parameters need no check: the server decodes their percent-escapes with U+FFFD for any
invalid byte, so they never hold a surrogate.

The check is linear in the body and reads it once: UTF-8 is decoded a chunk at a time, and a lone surrogate is
found by one scan of the raw JSON text (`lone_surrogate_at`: in JSON one can only be written as a \\uD8xx-
\\uDFxx escape, so the scan steps over every other character and escape, and over each escaped pair); only a
body that holds one is parsed, to name its path. A body of more than INLINE_BYTES is checked on a worker thread,
a chunk at a time, so a large body never holds the event loop. Only a request a route takes with a body is read
(POST, PUT or PATCH to a path and method the app answers): any other is handed on unread.

Rows stored before this check may still hold such strings: `loads` (the store's JSON reader) turns
each lone surrogate into U+FFFD, so one bad row cannot break a listing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio

from whitney.service.http.bodies import read_body, replaying, routed

# A \uD800-\uDFFF escape in JSON text: the only way a JSON body can hold a lone surrogate.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_TEXT = re.compile(SURROGATE_ESCAPE.pattern.decode())
# Everything JSON text may hold but a lone surrogate escape, each token matched whole, possessively (no
# backtracking, so no state kept per token): runs without a backslash, an escape other than \u, a \u escape
# outside the surrogates, a high surrogate escape followed by a low one (a pair, one valid character). The
# match ends where a lone surrogate escape starts, at an invalid escape (not JSON: the route answers that) or
# at the end. The longest token is a pair, TOKEN_BYTES long.
_NO_LONE_SURROGATE = re.compile(rb"(?:[^\\]++|\\[^u]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}"
                                rb"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})*+")
TOKEN_BYTES = 12
SURROGATE = re.compile("[\ud800-\udfff]")
BINARY_TYPES = ("application/x-protobuf", "application/protobuf", "application/octet-stream")
CHUNK_BYTES = 2**20  # the check works a chunk at a time: a worker thread lets the event loop run between chunks
INLINE_BYTES = 64 * 2**10  # a larger body is checked on a worker thread
CHECK_THREADS = 2  # bodies checked at once on worker threads (more would only share the same cores)
ROUTED_PATHS = 4096  # whether a route takes a request, remembered for this many paths


def invalid_path(value: Any) -> str | None:
    """The JSON path ("a.b.0.c") of the first string or key in `value` (in document order) holding a lone
    surrogate, else None. A bad key is named by its own path with the surrogate shown as U+FFFD.

    Linear: each item is visited once and the path is one list kept as the walk descends (nothing is copied
    per item). Iterative: depth is not limited.
    """
    if not isinstance(value, (dict, list)):
        return "body" if isinstance(value, str) and SURROGATE.search(value) else None
    path: list[str] = []
    stack = [_items(value)]
    while stack:
        for key, child in stack[-1]:
            if isinstance(key, str) and SURROGATE.search(key):
                return ".".join([*path, SURROGATE.sub("\ufffd", key)])
            if isinstance(child, str):
                if SURROGATE.search(child):
                    return ".".join([*path, str(key)])
            elif isinstance(child, (dict, list)) and child:
                path.append(str(key))
                stack.append(_items(child))
                break
        else:  # this container is done
            stack.pop()
            del path[max(len(stack) - 1, 0):]
    return None


def _items(container: dict | list):
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


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
    """(field, message) if a request body holds invalid text, else None. Linear in the body; a chunk at a time."""
    if not body or (content_type or "").split(";")[0].strip().lower() in BINARY_TYPES:
        return None
    offset = utf8_error_at(body)
    if offset is not None:
        return "body", f"the body is not valid UTF-8: byte 0x{body[offset]:02x} at offset {offset}"
    if lone_surrogate_at(body) is None:
        return None
    try:  # only now is the body parsed, to name the field
        path = invalid_path(json.loads(body))
    except (ValueError, RecursionError):  # not JSON: the route answers that
        return None
    if path is None:
        return None
    return path, f"{path}: text must be valid Unicode; a lone surrogate (\\ud800-\\udfff) is not"


def utf8_error_at(body: bytes, chunk: int = CHUNK_BYTES) -> int | None:
    """The offset of the first byte of `body` that is not valid UTF-8 (a UTF-8-encoded surrogate included),
    else None; decoded a chunk at a time, each cut at a character's first byte."""
    start = 0
    while start < len(body):
        end = min(start + chunk, len(body))
        while end < len(body) and end > start and body[end] & 0xC0 == 0x80:  # inside a character: cut before it
            end -= 1
        if end == start:  # no character starts in the chunk: not UTF-8 (a run of continuation bytes)
            end = min(start + chunk, len(body))
        piece = body[start:end]
        if not piece.isascii():
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError as e:
                return start + e.start
        start = end
    return None


def lone_surrogate_at(body: bytes, chunk: int = CHUNK_BYTES) -> int | None:
    """The offset of the first lone surrogate escape (\\uD800-\\uDFFF not part of a high-low pair) in JSON
    text, else None; None too where the text stops being JSON first (an invalid escape). One scan, a chunk at a
    time: a token cut by a chunk's end is matched again whole from the next chunk."""
    assert chunk > TOKEN_BYTES, "a chunk must hold a whole token"
    start = 0
    while True:
        end = min(start + chunk, len(body))
        stop = _NO_LONE_SURROGATE.match(body, start, end).end()
        if stop == len(body):
            return None
        if end < len(body) and stop > end - TOKEN_BYTES:  # perhaps a token cut at the chunk's end
            start = stop
            continue
        return stop if SURROGATE_ESCAPE.match(body, stop) else None


class TextCheck:
    """ASGI middleware: reads the body of a request a route takes with a body (`routed`; BodyLimit, outside it,
    has bounded its size), answers 400 if it holds invalid text (`body_error`, on a worker thread for a body of
    more than INLINE_BYTES), else hands the same bytes on to the app. Any other request goes on unread."""

    def __init__(self, app):
        self.app = app
        self._threads: anyio.CapacityLimiter | None = None  # made on the server's event loop, at first use
        self._routed: dict[tuple[str, str, str], bool] = {}  # (method, root_path, path) -> routed, the latest

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH") or not self._takes(scope):
            return await self.app(scope, receive, send)
        body, _ = await read_body(receive)
        if body is None:  # the client went away
            return
        content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
        if len(body) <= INLINE_BYTES:
            error = body_error(body, content_type)
        else:
            if self._threads is None:
                self._threads = anyio.CapacityLimiter(CHECK_THREADS)
            error = await anyio.to_thread.run_sync(body_error, body, content_type, limiter=self._threads)
        if error is not None:
            payload = json.dumps({"code": "invalid_input", "field": error[0], "message": error[1]}).encode()
            await send({"type": "http.response.start", "status": 400, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
            return await send({"type": "http.response.body", "body": payload})
        await self.app(scope, replaying(body, receive), send)

    def _takes(self, scope) -> bool:
        """`routed(scope)`, remembered for the paths of the latest ROUTED_PATHS requests (the routes are fixed:
        matching every route costs up to ~100 us, a Tinker path matching last)."""
        key = (scope["method"], scope.get("root_path", ""), scope["path"])
        takes = self._routed.get(key)
        if takes is None:
            if len(self._routed) >= ROUTED_PATHS:
                self._routed.clear()
            takes = self._routed[key] = routed(scope)
        return takes
