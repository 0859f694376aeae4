"""API keys: shown once when made, stored as a digest, looked up on every request; their limits.

A caller's identity (the owner every row carries) is `owner_of_key(key)`, the first 32 hex digits of
the key's sha256, whether the key was given to `whitney serve --api-key` or made by `whitney keys
create`: moving a key from one to the other keeps its sessions, runs and checkpoints. The database
keeps the whole sha256, never the key. Plain sha256 is enough: a made key holds 256 random bits, so no
dictionary guesses it (a salt protects weak secrets such as passwords), and an unsalted digest is
an index every request can look up.

Keys are required when the server has `--api-key`s, when it was started with `--require-keys`, or
when its database holds any key, revoked ones included (revoking the last key never opens the
server). Lookups are cached for CACHE_SECONDS, so `whitney keys create|revoke` take effect on a
running server within that time.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from whitney.errors import WhitneyError
from whitney.service.http.signing import is_jwt, read_jwt
from whitney.service.store.database import Store
from whitney.service.store.key_limits import LIMITS
from whitney.service.store.records import KeyRecord

PREFIX = "tml-wk-"  # the Tinker SDK refuses keys that do not start with "tml-"
CACHE_SECONDS = 1.0
CACHE_ENTRIES = 10_000  # unknown keys are cached too: a flood of made-up keys may not grow memory
OPEN_PATHS = ("/healthz",)  # the one route that answers without a key
METRICS_PATH = "/metrics"  # the operator's: the route checks the metrics key instead (http/metrics.py), no tenant key
SIGNED_PREFIX = "/v1/signed/"  # signed download URLs: the route checks the signature instead (signing.py)
CONSOLE = "/console"  # the web console checks keys itself: its sign-in form and static files are open, its data not


class Unauthorized(WhitneyError):
    code = "unauthorized"


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of_key(key: str) -> str:
    return digest_of(key)[:32]


def key_digest(credential: str | None) -> str | None:
    """The sha256 of a key, or of the key a JWT of this server was exchanged for (None: no key behind it)."""
    if not is_jwt(credential):
        return digest_of(credential) if credential else None
    claims = read_jwt(credential)
    if claims is None or "aud" in claims:  # an audience: a token for something else (the console's session)
        raise Unauthorized("the token has expired or was not issued by this server", field="token")
    return claims.get("key_digest") or None


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """Native clients send `Authorization: Bearer <key>`; Tinker's SDK sends `X-API-Key`."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return x_api_key or None


_UNKNOWN = object()  # a key not in the ring's cache


class KeyRing:
    """The keys a server accepts: those it was started with, and the store's (cached for CACHE_SECONDS)."""

    def __init__(self, store: Store, config_keys: list[str], require_keys: bool = False):
        self.store = store
        self._config = {digest_of(k) for k in config_keys}
        self._always = bool(config_keys) or require_keys
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}  # digest -> (until, key or None)
        self._any: tuple[float, bool] = (0.0, False)
        self._own: dict[str, dict] = {}  # owner -> its key's own limits, as last looked up
        self._lock = threading.Lock()

    def required(self, lookup: bool = True) -> bool | None:
        """Whether requests need a key (None: not known without the store, and lookup=False)."""
        if self._always:
            return True
        until, held = self._any
        if time.monotonic() >= until:
            if not lookup:
                return None
            held = self.store.has_keys()
            self._any = (time.monotonic() + CACHE_SECONDS, held)
        return held

    def owner(self, key: str | None) -> str:
        """The owner of a valid key (or of a JWT the Tinker SDK exchanged one for, signing.py); without one, ''
        if the server requires no keys, else Unauthorized. May read the store: call it off the event loop."""
        return self.owner_of_digest(key_digest(key))

    def cached_owner(self, key: str | None) -> str | None:
        """owner(key) where it is known without the store (a configured key, a lookup cached in the last
        CACHE_SECONDS); None where it needs the store (KeyGate then asks owner() on a worker thread)."""
        return self.owner_of_digest(key_digest(key), lookup=False)

    def owner_of_digest(self, digest: str | None, lookup: bool = True) -> str | None:
        """owner() of the key whose sha256 is `digest` (None: no key); lookup=False: None where the store is
        needed."""
        if digest is not None and digest in self._config:
            return digest[:32]
        row = None
        if digest is not None:
            row = self._lookup(digest, lookup)
            if row is _UNKNOWN:
                return None
        if row is not None and row.revoked_at is None:
            self._own[digest[:32]] = {k: getattr(row, k) for k in LIMITS}
            return digest[:32]
        required = self.required(lookup)
        if required is None:
            return None
        if required:
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)", field="authorization")
        return ""

    def own_limits(self, owner: str) -> dict:
        """The owner's key's own limits (None: the server's default); {} for `--api-key` keys and no key."""
        return self._own.get(owner, {})

    def _lookup(self, digest: str, lookup: bool = True):
        """The stored key of `digest` (None: no such key); _UNKNOWN where it is not cached and lookup=False."""
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now < hit[0]:
            return hit[1]
        if not lookup:
            return _UNKNOWN
        row = self.store.find_key(digest)
        with self._lock:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[digest] = (now + CACHE_SECONDS, row)
        return row


# Where KeyGate leaves the owner it checked, so the routes' Owner dependency does not check the key again.
OWNER_SCOPE_KEY = "whitney.owner"


class KeyGate:
    """ASGI middleware: with keys on, every path but OPEN_PATHS needs a valid key, before any routing. So
    the OpenAPI documents, /docs, the Tinker sub-app and unknown paths are covered as the routes are. The
    web console (CONSOLE) checks keys itself: its sign-in form and static files are open, its data is not.
    /metrics (METRICS_PATH) takes the operator's metrics key, never a tenant's key (http/metrics.py)."""

    def __init__(self, app, keys: KeyRing):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        if (scope["type"] != "http" or path in OPEN_PATHS or path.startswith(SIGNED_PREFIX) or path == METRICS_PATH
                or path == CONSOLE or path.startswith(CONSOLE + "/")):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
        try:
            owner = self.keys.cached_owner(key)
            if owner is None:  # a key not cached: its database lookup runs on a worker thread, not the event loop
                owner = await run_in_threadpool(self.keys.owner, key)
            scope[OWNER_SCOPE_KEY] = owner
        except Unauthorized as e:
            challenge = 'Bearer error="invalid_token"' if e.field == "token" else "Bearer"  # the SDK then re-exchanges
            response = JSONResponse(status_code=401, content=e.to_dict(), headers={"WWW-Authenticate": challenge})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
