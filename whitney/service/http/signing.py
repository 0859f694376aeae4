"""What the server signs: download URLs anyone holding them may GET until they expire, and the short-lived
JWTs the Tinker SDK exchanges its API key for (which carry the key's identity, so `whoami` can read it).

One HMAC-SHA256 secret per server process, made at start: a restart invalidates what it signed (a URL is
asked for again; the SDK exchanges its key for a new JWT when one is refused as invalid_token). A JWT
carries the sha256 of the key it was exchanged for, so every request made with it is checked against the
key ring as the key itself would be (a revoked key's JWTs stop working within the ring's cache time).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

_SECRET = secrets.token_bytes(32)
JWT_SECONDS = 3600  # the SDK refreshes at about half of this
ISSUER = "whitney"


def sign(message: str) -> str:
    return hmac.new(_SECRET, message.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def verify(message: str, signature: str) -> bool:
    """Whether `signature` is sign(message); any string is an answer (bytes are compared: a non-ASCII
    signature is simply wrong)."""
    return hmac.compare_digest(sign(message).encode(), signature.encode("utf-8", "surrogatepass"))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def is_jwt(credential: str | None) -> bool:
    return bool(credential) and credential.startswith("eyJ") and credential.count(".") == 2


def mint_jwt(claims: dict, seconds: int = JWT_SECONDS) -> str:
    """An HS256 JWT of `claims` plus iss, iat and exp."""
    now = int(time.time())
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps({**claims, "iss": ISSUER, "iat": now, "exp": now + seconds}).encode())
    mac = hmac.new(_SECRET, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


def read_jwt(token: str) -> dict | None:
    """The claims of a JWT this process signed and that has not expired; None for any other."""
    try:
        head, body, mac = token.split(".")
        good = hmac.new(_SECRET, f"{head}.{body}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(good, _unb64(mac)):
            return None
        claims = json.loads(_unb64(body))
    except (ValueError, TypeError):
        return None
    if claims.get("iss") != ISSUER or not isinstance(claims.get("exp"), int) or claims["exp"] <= time.time():
        return None
    return claims
