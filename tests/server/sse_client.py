"""Read a server-sent-events response as raw `data:` payloads, checking the framing exactly."""

from __future__ import annotations

import json
from typing import Any

import httpx


def sse_events(response: httpx.Response) -> list[Any]:
    """Every event's payload (JSON-decoded, or the string "[DONE]"); asserts `data: ...\\n\\n` framing."""
    raw = response.read().decode()
    assert raw.endswith("\n\n"), raw[-50:]
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def post_stream(url: str, body: dict[str, Any], **kwargs: Any) -> list[Any]:
    with httpx.stream("POST", url, json=body, timeout=120, **kwargs) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)
