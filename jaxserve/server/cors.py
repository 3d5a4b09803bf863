"""Cross-origin resource sharing, as vLLM and SGLang serve it (Starlette's CORSMiddleware, every
origin allowed by default), so a browser page on another origin can call the API.

`CorsPolicy` answers a preflight (OPTIONS with Origin and Access-Control-Request-Method) before
authentication (browsers send no Authorization on a preflight) and adds the allow headers to
every other response to a request that names an allowed Origin. Host bookkeeping only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# Headers a browser may always send (the Fetch standard's CORS-safelisted request headers).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer (Starlette's default)


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """vLLM's --allowed-origins / --allowed-methods / --allowed-headers ("*": any) and
    --allowed-credentials."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            if not getattr(self, name) or any(not v or v != v.strip() for v in getattr(self, name)):
                raise ValueError(f"allowed {name} must be non-empty names without surrounding spaces, "
                                 f"got {list(getattr(self, name))}")
        bad = [m for m in self.methods if m != "*" and m.upper() not in ALL_METHODS]
        if bad:
            raise ValueError(f"allowed methods must be among {', '.join(ALL_METHODS)} or *, got {bad}")

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    def allows_origin(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def _allowed_methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else tuple(m.upper() for m in self.methods)

    def _origin_headers(self, origin: str) -> dict[str, str]:
        # A wildcard cannot go with credentials (browsers refuse it), so the origin is echoed then,
        # and caches must key on it (Vary).
        if self.any_origin and not self.credentials:
            out = {"Access-Control-Allow-Origin": "*"}
        else:
            out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight(self, request_headers: Mapping[str, str]) -> tuple[int, dict[str, str], str]:
        """(status, headers, body) answering a preflight: 200 with what is allowed, or 400 naming
        what is not (the origin, the method or a header)."""
        origin = request_headers.get("Origin", "")
        method = request_headers.get("Access-Control-Request-Method", "").upper()
        asked = [h.strip() for h in request_headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = []
        if not self.allows_origin(origin):
            refused.append("origin")
        if method not in self._allowed_methods():
            refused.append("method")
        allowed = {a.lower() for a in self.headers} | SAFELISTED_HEADERS
        if "*" not in self.headers and any(h.lower() not in allowed for h in asked):
            refused.append("headers")
        headers = self._origin_headers(origin) if "origin" not in refused else {}
        if refused:
            return 400, headers, f"Disallowed CORS {', '.join(refused)}"
        headers |= {"Access-Control-Allow-Methods": ", ".join(self._allowed_methods()),
                    "Access-Control-Max-Age": str(MAX_AGE_S)}
        allowed_headers = asked if "*" in self.headers else list(self.headers) + sorted(SAFELISTED_HEADERS)
        if allowed_headers:
            headers["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        return 200, headers, "OK"

    def response_headers(self, origin: str | None) -> dict[str, str]:
        """The headers an ordinary response to a request from `origin` carries (none when the
        request named no origin, or one that is not allowed: the browser then withholds it)."""
        if not origin or not self.allows_origin(origin):
            return {}
        return self._origin_headers(origin)


def cors_policy(server: Any) -> CorsPolicy:
    """The policy a jaxserve.config.ServerConfig's allowed_* fields set."""
    return CorsPolicy(tuple(server.allowed_origins), tuple(server.allowed_methods), tuple(server.allowed_headers),
                      server.allowed_credentials)


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers
