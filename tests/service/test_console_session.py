"""The console's sign-in cookie (issue 31, item 11), over plain HTTP against a real server: it never holds the key
(a signed token of the key's digest, HttpOnly, SameSite=Strict), opens the console only, never the API, and stops
working once its key is revoked; the playground's script gets a short-lived API token instead of the key."""

from __future__ import annotations

import base64

import pytest

from whitney.service.console.auth import COOKIE
from whitney.service.store import keys


@pytest.fixture
def keyed(make_server, monkeypatch):
    """A server whose one key is in its database (so it can be revoked), looked up afresh on every request."""
    monkeypatch.setattr(keys, "CACHE_SECONDS", 0.0)
    server = make_server(require_keys=True)
    key = keys.new_key()
    row = server.app.state.whitney.store.create_key(keys.digest_of(key), "console", {})
    return server, key, row


def test_the_cookie_holds_a_signed_session_not_the_key(keyed):
    server, key, row = keyed
    with server.http() as http:
        signed_in = http.post("/console/login", data={"key": key, "next": "/console/"})
        assert signed_in.status_code == 303, signed_in.text
        set_cookie = signed_in.headers["set-cookie"]
        token = signed_in.cookies[COOKIE]
        assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower(), set_cookie
        assert key not in set_cookie and key not in base64.urlsafe_b64decode(token.split(".")[1] + "==").decode()
        session = {"Cookie": f"{COOKIE}={token}"}
        http.cookies.clear()
        assert http.get("/console/parts/sessions", headers=session).status_code == 200
        # The session opens the console, never the API.
        for header in ({"Authorization": f"Bearer {token}"}, {"X-API-Key": token}):
            assert http.get("/v1/sessions", headers=header).status_code == 401
        # A cookie holding the key itself (what the console set before) is no session.
        assert http.get("/console/parts/sessions", headers={"Cookie": f"{COOKIE}={key}"}).status_code == 401
        # The playground's script asks for a short-lived token of the key, which the API takes.
        api_token = http.get("/console/playground/token", headers=session).json()["token"]
        assert api_token and key not in api_token
        assert http.get("/v1/sessions", headers={"Authorization": f"Bearer {api_token}"}).status_code == 200
        assert http.get("/console/playground/token").status_code == 401

        server.app.state.whitney.store.revoke_key(row.id)
        revoked = http.get("/console/parts/sessions", headers=session)
        assert revoked.status_code == 401 and revoked.json()["code"] == "unauthorized"
        assert http.get("/console/", headers={**session, "Accept": "text/html"}).headers["location"] \
            .startswith("/console/login?reason=invalid")
        assert http.get("/v1/sessions", headers={"Authorization": f"Bearer {api_token}"}).status_code == 401
        assert http.get("/console/playground/token", headers=session).status_code == 401
