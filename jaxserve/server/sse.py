"""Server-sent events framed exactly as OpenAI and SGLang send them: `data: <json>\n\n`."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from quart import Response

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_response(body: AsyncIterator[bytes]) -> Response:
    response = Response(body, content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # proxies must not buffer a token stream
    response.timeout = None  # a long generation is no reason to cut the stream
    return response
