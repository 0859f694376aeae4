"""Reading a request body in an ASGI middleware, and handing the same bytes on to the app; which requests a
route takes (so a middleware reads no body that nothing would use)."""

from __future__ import annotations

from starlette.routing import Match, Mount


async def read_body(receive, limit: int | None = None) -> tuple[bytes | None, int]:
    """(body, size) from the request's messages. body is None if the client went away, or if more than
    `limit` bytes arrived (size then says how many had, and reading stopped there)."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None, size
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if limit is not None and size > limit:
            return None, size
    return b"".join(chunks), size


def replaying(body: bytes, receive):
    """An ASGI `receive` that hands the app the whole `body` once, then the real messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def routed(scope) -> bool:
    """Whether a route of the app answers the request's method at its path (not a 404 or a 405), through mounted
    apps (the Tinker one, the console) too."""
    return answers(scope["app"].routes, scope)


def path_methods(routes, scope) -> set[str]:
    """Every method the app answers at the request's path: each is tried on the routes as the router would
    match it, through mounted apps (the Tinker one) too. HEAD only where a route answers it (FastAPI's GET
    routes do not)."""
    return {m for m in ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT") if answers(routes, {**scope, "method": m})}


def answers(routes, scope) -> bool:
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL and (not isinstance(route, Mount) or answers(route.routes, {**scope, **child})):
            return True
    return False
