"""Reading a request body in an ASGI middleware, and handing the same bytes on to the app."""

from __future__ import annotations


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
