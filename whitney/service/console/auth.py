"""Who is looking: the viewer's key, from the sign-in cookie or an Authorization header.

The cookie never holds the key. Signing in checks the key and sets a session token signed by this server
(http/signing.py) that carries the key's sha256 and an expiry (SESSION_SECONDS), HttpOnly (no script reads
it), SameSite=Strict, Secure over HTTPS, for the console's path only. Every request checks the token's
signature and expiry, then the key behind it against the key ring as the key itself would be: a key revoked
since stops its sessions within the ring's cache time, and a restart (a new signing secret) ends them all.
The token opens the console only, never the API (keys.key_digest refuses it). The playground's script calls
the API with a short-lived token it asks the console for (pages.playground_token), never with the key.
"""

from __future__ import annotations

from fastapi import Request

from whitney.service.http import signing
from whitney.service.store.keys import Unauthorized, key_digest, presented_key

COOKIE = "whitney_console_session"  # a signed token of the key's digest: HttpOnly, SameSite=Strict, Path=/console
AUDIENCE = "whitney-console"  # the token's `aud`: the console's, refused by the API
SESSION_SECONDS = 12 * 3600  # a sign-in lasts at most this long (then the form again)


class SignIn(Exception):
    """The console needs a valid key: a page goes to the sign-in form, a data request gets a 401."""

    def __init__(self, reason: str):
        self.reason = reason  # "needed" (no key) or "invalid" (a key that is unknown or revoked)


def session_token(key: str) -> str:
    """The sign-in cookie's value for `key` (checked valid by the caller): its digest, signed, expiring."""
    return signing.mint_jwt({"key_digest": key_digest(key), "aud": AUDIENCE}, SESSION_SECONDS)


def viewer_digest(request: Request) -> str | None:
    """The sha256 of the viewer's key: from the session cookie, else the Authorization or X-API-Key header
    (None: neither). SignIn("invalid") for a cookie this server did not sign, or that has expired."""
    token = request.cookies.get(COOKIE)
    if token:
        claims = signing.read_jwt(token)
        if claims is None or claims.get("aud") != AUDIENCE or not isinstance(claims.get("key_digest"), str):
            raise SignIn("invalid")
        return claims["key_digest"]
    try:
        return key_digest(presented_key(request.headers.get("authorization"), request.headers.get("x-api-key")))
    except Unauthorized:
        raise SignIn("invalid") from None


def viewer(request: Request) -> str:
    """The owner whose objects the console shows: the key's (the session cookie's, else the Authorization or
    X-API-Key header's), or '' when the server requires no keys and none is given. SignIn when keys are
    required and the key is missing or not valid (unknown, revoked, a cookie expired). May read the store: a
    plain `def` dependency, so FastAPI runs it on a worker thread."""
    digest = viewer_digest(request)
    try:
        return request.app.state.whitney.keys.owner_of_digest(digest)
    except Unauthorized:
        raise SignIn("invalid" if digest else "needed") from None


def wants_page(request: Request) -> bool:
    """A browser navigating (a full page), not htmx swapping a part or a script fetching data."""
    return "text/html" in request.headers.get("accept", "") and not request.headers.get("hx-request")
