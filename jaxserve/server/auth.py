"""Bearer API keys. Every route but /health needs one when keys are configured (default deny)."""

from __future__ import annotations

import hmac

from jaxserve.server.errors import ApiError

PUBLIC_PATHS = frozenset({"/health"})


def check_bearer(path: str, authorization: str | None, keys: tuple[bytes, ...]) -> None:
    """Raise a 401 ApiError unless the Authorization header carries one of `keys`."""
    if not keys or path in PUBLIC_PATHS:
        return
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    # Compare against every key, without stopping early, so timing says nothing about which matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    if not ok:
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       kind="authentication_error", code="invalid_api_key")
