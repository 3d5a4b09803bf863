"""One streaming request per call, timed: OpenAI completions, OpenAI chat, SGLang /generate.

Each function sends one request and returns a RequestResult; it never raises for a server or
network error (the error is recorded on the result, so failures are counted and listed).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from benchmarks.serving_metrics import RequestResult
from benchmarks.serving_workloads import BenchTokenizer, Prompt

_ERROR_BODY_CHARS = 500


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """Everything a backend needs to send one request."""

    url: str
    model: str | None
    prompt: Prompt
    use_token_ids: bool = True      # send prompt token ids rather than text, where the API allows
    ignore_eos: bool = True         # ask for exactly prompt.output_len tokens
    temperature: float = 0.0
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
    # How to count output tokens: auto = the server's usage, else re-encode the text (vLLM's
    # way); tokenizer or chunks (one streamed chunk with text = one token) force a method.
    output_token_count: str = "auto"


class _Timeline:
    """Arrival times of the content chunks of one response."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft = 0.0
        self.itl: list[float] = []
        self._last: float | None = None
        self.chunks = 0

    def content(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.chunks += 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-events stream, as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def _error_of(payload: dict[str, Any]) -> str | None:
    err = payload.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        return f"error event in the stream: {err.get('message') or json.dumps(err)}"
    return f"error event in the stream: {err}"


def _finish(result: RequestResult, timeline: _Timeline, text: str, usage: dict[str, Any] | None,
            tokenizer: BenchTokenizer | None, count: str = "auto") -> RequestResult:
    """Fill in lengths and timings once a stream has ended normally."""
    result.latency = timeline.elapsed()
    result.generated_text = text
    if timeline.chunks == 0:
        result.error = f"the stream ended without any generated text (finish_reason {result.finish_reason})"
        return result
    result.success = True
    result.ttft, result.itl = timeline.ttft, timeline.itl
    if usage and isinstance(usage.get("prompt_tokens"), int):
        result.prompt_len = usage["prompt_tokens"]
    if count == "chunks":
        result.output_tokens, result.output_tokens_source = timeline.chunks, "chunks"
    elif count == "auto" and usage and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens, result.output_tokens_source = usage["completion_tokens"], "usage"
    elif tokenizer is not None:
        # vLLM's fallback: re-encode the text (may differ from the true count by a few tokens).
        result.output_tokens, result.output_tokens_source = len(tokenizer.encode(text)), "tokenizer"
    else:
        result.output_tokens, result.output_tokens_source = timeline.chunks, "chunks"
    return result


async def _post(client: httpx.AsyncClient, spec: RequestSpec, body: dict[str, Any],
                read: Callable[[httpx.Response, _Timeline, RequestResult], Awaitable[RequestResult]]) -> RequestResult:
    body.update(spec.extra_body)
    result = RequestResult(prompt_len=spec.prompt.input_len, expected_output_len=spec.prompt.output_len)
    timeline = _Timeline()
    try:
        async with client.stream("POST", spec.url, json=body) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {raw[:_ERROR_BODY_CHARS]}"
                result.latency = timeline.elapsed()
                return result
            return await read(response, timeline, result)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {str(e) or 'no message'}"
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        result.error = f"malformed stream: {type(e).__name__}: {e}"
    result.latency = timeline.elapsed()
    return result


def _sampling(spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": spec.prompt.output_len, "temperature": spec.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if spec.model:
        body["model"] = spec.model
    if spec.ignore_eos:
        # vLLM's extras (jaxserve, vLLM, SGLang's OpenAI API): no early end at EOS or stop tokens.
        body |= {"ignore_eos": True, "min_tokens": spec.prompt.output_len}
    return body


async def _read_openai(response: httpx.Response, timeline: _Timeline, result: RequestResult, spec: RequestSpec,
                       text_of: Callable[[dict[str, Any]], str | None],
                       tokenizer: BenchTokenizer | None) -> RequestResult:
    text, usage, done = "", None, False
    async for data in _sse_data(response):
        if data == "[DONE]":
            done = True
            break
        payload = json.loads(data)
        if (err := _error_of(payload)) is not None:
            result.error, result.latency = err, timeline.elapsed()
            return result
        if payload.get("usage"):
            usage = payload["usage"]
        for choice in payload.get("choices") or []:
            piece = text_of(choice)
            if piece:
                timeline.content()
                text += piece
            if choice.get("finish_reason") is not None:
                result.finish_reason = str(choice["finish_reason"])
    if not (done or result.finish_reason):
        result.error, result.latency = "the stream ended before [DONE] or a finish_reason", timeline.elapsed()
        return result
    return _finish(result, timeline, text, usage, tokenizer, spec.output_token_count)


async def openai_completions(client: httpx.AsyncClient, spec: RequestSpec,
                             tokenizer: BenchTokenizer | None = None) -> RequestResult:
    """POST /v1/completions with stream=true; the prompt as token ids (or text)."""
    body = _sampling(spec) | {"prompt": spec.prompt.token_ids if spec.use_token_ids else spec.prompt.text}
    return await _post(client, spec, body,
                       lambda r, t, res: _read_openai(r, t, res, spec, lambda c: c.get("text"), tokenizer))


async def openai_chat(client: httpx.AsyncClient, spec: RequestSpec,
                      tokenizer: BenchTokenizer | None = None) -> RequestResult:
    """POST /v1/chat/completions with stream=true; the prompt as one user message (the server's
    chat template adds its own tokens, which the server's usage count includes)."""
    body = _sampling(spec) | {"messages": [{"role": "user", "content": spec.prompt.text}]}

    def text_of(choice: dict[str, Any]) -> str | None:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content")

    return await _post(client, spec, body, lambda r, t, res: _read_openai(r, t, res, spec, text_of, tokenizer))


async def sglang_generate(client: httpx.AsyncClient, spec: RequestSpec,
                          tokenizer: BenchTokenizer | None = None) -> RequestResult:
    """POST /generate (SGLang's native API) with stream=true; events carry the cumulative text."""
    params: dict[str, Any] = {"max_new_tokens": spec.prompt.output_len, "temperature": spec.temperature}
    if spec.ignore_eos:
        params |= {"ignore_eos": True, "min_new_tokens": spec.prompt.output_len}
    body: dict[str, Any] = {"sampling_params": params, "stream": True}
    body |= {"input_ids": spec.prompt.token_ids} if spec.use_token_ids else {"text": spec.prompt.text}

    async def read(response: httpx.Response, timeline: _Timeline, result: RequestResult) -> RequestResult:
        text, meta = "", None
        async for data in _sse_data(response):
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if (err := _error_of(payload)) is not None:
                result.error, result.latency = err, timeline.elapsed()
                return result
            cumulative = payload.get("text") or ""
            if len(cumulative) > len(text):
                timeline.content()
            text = cumulative
            meta = payload.get("meta_info") or meta
        usage = {"completion_tokens": meta.get("completion_tokens"), "prompt_tokens": meta.get("prompt_tokens")} \
            if meta else None
        finish = (meta or {}).get("finish_reason")
        result.finish_reason = finish.get("type") if isinstance(finish, dict) else finish
        return _finish(result, timeline, text, usage, tokenizer, spec.output_token_count)

    return await _post(client, spec, body, read)


RequestFunc = Callable[[httpx.AsyncClient, RequestSpec, "BenchTokenizer | None"], Awaitable[RequestResult]]

# backend name -> (request function, default endpoint, whether the API takes prompt token ids)
BACKENDS: dict[str, tuple[RequestFunc, str, bool]] = {
    "openai": (openai_completions, "/v1/completions", True),
    "openai-chat": (openai_chat, "/v1/chat/completions", False),
    "sglang": (sglang_generate, "/generate", True),
}
