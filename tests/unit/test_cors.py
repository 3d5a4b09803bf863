"""CORS policy (jaxserve.server.cors): Starlette's CORSMiddleware rules, which vLLM and SGLang serve."""

from __future__ import annotations

import pytest

from jaxserve.server.cors import ALL_METHODS, CorsPolicy


def _pre(policy: CorsPolicy, origin: str = "https://a.example", method: str = "POST", headers: str = "") -> tuple:
    return policy.preflight({"Origin": origin, "Access-Control-Request-Method": method,
                             **({"Access-Control-Request-Headers": headers} if headers else {})})


def test_the_default_allows_every_origin_method_and_header():
    status, headers, _ = _pre(CorsPolicy(), headers="X-Custom, Authorization")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in headers
    assert headers["Access-Control-Allow-Methods"] == ", ".join(ALL_METHODS)
    assert headers["Access-Control-Allow-Headers"] == "X-Custom, Authorization"
    assert headers["Access-Control-Max-Age"] == "600"
    assert CorsPolicy().response_headers("https://b.example") == {"Access-Control-Allow-Origin": "*"}
    assert CorsPolicy().response_headers(None) == {}


def test_listed_origins_methods_and_headers():
    policy = CorsPolicy(origins=("https://a.example",), methods=("get", "POST"), headers=("Authorization",))
    status, headers, _ = _pre(policy, headers="authorization, content-type")  # content-type is safelisted
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://a.example"
    assert headers["Vary"] == "Origin" and headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert _pre(policy, origin="https://b.example")[::2] == (400, "Disallowed CORS origin")
    assert _pre(policy, method="PUT", headers="x-other")[::2] == (400, "Disallowed CORS method, headers")
    assert policy.response_headers("https://b.example") == {}


def test_credentials_echo_the_origin_even_for_a_wildcard():
    policy = CorsPolicy(credentials=True)
    assert policy.response_headers("https://a.example") == {"Access-Control-Allow-Origin": "https://a.example",
                                                            "Vary": "Origin",
                                                            "Access-Control-Allow-Credentials": "true"}


@pytest.mark.parametrize("bad", [{"methods": ("FETCH",)}, {"origins": ()}, {"headers": (" x",)}])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        CorsPolicy(**bad)
