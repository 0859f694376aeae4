"""Who is looking: the viewer's key, from the sign-in cookie or an Authorization header."""

from __future__ import annotations

from fastapi import Request

from whitney.service.store.keys import Unauthorized, presented_key

COOKIE = "whitney_console_key"  # Path=/console, SameSite=Strict; the playground's script reads it for /v1 calls


class SignIn(Exception):
    """The console needs a valid key: a page goes to the sign-in form, a data request gets a 401."""

    def __init__(self, reason: str):
        self.reason = reason  # "needed" (no key) or "invalid" (a key that is unknown or revoked)


def viewer(request: Request) -> str:
    """The owner whose objects the console shows: the key's (cookie, else Authorization or X-API-Key
    header), or '' when the server requires no keys and none is given. SignIn when keys are required and
    the key is missing or not valid."""
    key = request.cookies.get(COOKIE) or presented_key(request.headers.get("authorization"),
                                                       request.headers.get("x-api-key"))
    try:
        return request.app.state.whitney.keys.owner(key)
    except Unauthorized:
        raise SignIn("invalid" if key else "needed") from None


def wants_page(request: Request) -> bool:
    """A browser navigating (a full page), not htmx swapping a part or a script fetching data."""
    return "text/html" in request.headers.get("accept", "") and not request.headers.get("hx-request")
