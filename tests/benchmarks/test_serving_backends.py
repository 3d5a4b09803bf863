"""The request functions against scripted SSE streams (httpx.MockTransport, no server): what they
send, how they time chunks, and how every kind of failure is recorded rather than raised.

Chunk timing runs on a virtual clock: a scripted delay advances the clock the request functions
read instead of sleeping, so the timeline is exact however busy the machine is (real sleeps on a
loaded CI box once stretched a 0.15 s TTFT to 0.92 s)."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import httpx
import pytest
from toy_tokenizer import ToyTokenizer

from benchmarks import serving_backends
from benchmarks.serving_backends import RequestSpec, openai_chat, openai_completions, sglang_generate
from benchmarks.serving_workloads import Prompt

PROMPT = Prompt(text="the cat", token_ids=[5, 6, 7], output_len=3)


class VirtualClock:
    """The request functions' perf_counter: it moves only when a scripted stream says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = VirtualClock()


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch):
    monkeypatch.setattr(serving_backends, "time", types.SimpleNamespace(perf_counter=CLOCK.perf_counter))


class TimedStream(httpx.AsyncByteStream):
    """Sends each (delay, bytes) once delay seconds have passed on the virtual clock."""

    def __init__(self, parts: list[tuple[float, bytes]], clock: VirtualClock):
        self.parts, self.clock = parts, clock

    async def __aiter__(self):
        for delay, data in self.parts:
            self.clock.now += delay
            await asyncio.sleep(0)  # still hand the loop over between chunks, as a network would
            yield data


def sse(*payloads: Any) -> list[bytes]:
    return [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads]


def run(func, parts: list[tuple[float, bytes]] | None = None, status: int = 200, body: bytes = b"",
        error: Exception | None = None, tokenizer=None, **spec: Any):
    sent: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent["url"], sent["body"] = str(request.url), json.loads(request.content)
        if error is not None:
            raise error
        if status != 200:
            return httpx.Response(status, content=body)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=TimedStream(parts or [], CLOCK))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await func(client, RequestSpec(url="http://server/x", model="m", prompt=PROMPT, **spec), tokenizer)

    return asyncio.run(go()), sent


def about(value: float, expected: float) -> bool:
    return value == pytest.approx(expected, abs=1e-9)


def completion_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}


def test_completions_request_body_asks_for_exact_lengths():
    events = sse(completion_chunk("a"), completion_chunk("b"), completion_chunk("c", "length"), USAGE, "[DONE]")
    result, sent = run(openai_completions, [(0, e) for e in events])
    body = sent["body"]
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m" and body["stream"] is True
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["min_tokens"] == 3
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    assert result.success and result.generated_text == "abc"


def test_completions_timeline_and_server_counts():
    parts = [(0.15, sse(completion_chunk("a"))[0]), (0.05, sse(completion_chunk("b"))[0]),
             (0.10, sse(completion_chunk("c", "length"))[0]), (0.0, sse(USAGE)[0]), (0.0, sse("[DONE]")[0])]
    result, _ = run(openai_completions, parts)
    assert result.success, result.error
    assert about(result.ttft, 0.15)
    assert len(result.itl) == 2 and about(result.itl[0], 0.05) and about(result.itl[1], 0.10)
    assert about(result.latency, 0.30) and result.latency >= result.ttft + sum(result.itl)
    # Lengths come from the server's usage.
    assert (result.output_tokens, result.prompt_len, result.output_tokens_source) == (3, 4, "usage")
    assert result.tpot == pytest.approx((result.latency - result.ttft) / 2)


def test_text_prompts_extra_body_and_no_ignore_eos():
    events = sse(completion_chunk("a", "stop"), "[DONE]")
    _, sent = run(openai_completions, [(0, e) for e in events], use_token_ids=False, ignore_eos=False,
                  extra_body={"top_k": 1, "temperature": 0.5})
    body = sent["body"]
    assert body["prompt"] == "the cat" and "ignore_eos" not in body and "min_tokens" not in body
    assert body["top_k"] == 1 and body["temperature"] == 0.5


def test_empty_chunks_are_not_tokens():
    # A chunk with empty text (a held-back partial character) arrives first: TTFT waits for text.
    parts = [(0.0, sse(completion_chunk(""))[0]), (0.1, sse(completion_chunk("a"))[0]),
             (0.0, sse(completion_chunk("", "length"))[0]), (0.0, sse("[DONE]")[0])]
    result, _ = run(openai_completions, parts)
    assert about(result.ttft, 0.1) and result.itl == []


def test_without_usage_the_tokenizer_counts_then_the_chunks():
    events = [(0, e) for e in sse(completion_chunk("th"), completion_chunk("e", "length"), "[DONE]")]
    with_tok, _ = run(openai_completions, events, tokenizer=ToyTokenizer())
    assert (with_tok.output_tokens, with_tok.output_tokens_source) == (1, "tokenizer")  # "the" is one token
    without, _ = run(openai_completions, events)
    assert (without.output_tokens, without.output_tokens_source) == (2, "chunks")
    assert without.prompt_len == 3  # the workload's count when the server reports none


def test_http_errors_are_recorded():
    result, _ = run(openai_completions, status=400, body=b'{"error": {"message": "max_tokens too large"}}')
    assert not result.success
    assert result.error.startswith("HTTP 400") and "max_tokens too large" in result.error


def test_error_events_in_the_stream_fail_the_request():
    events = sse(completion_chunk("a"), {"error": {"message": "engine died", "type": "internal"}}, "[DONE]")
    result, _ = run(openai_completions, [(0, e) for e in events])
    assert not result.success and "engine died" in result.error


def test_a_truncated_stream_fails():
    result, _ = run(openai_completions, [(0, e) for e in sse(completion_chunk("a"))])
    assert not result.success and "ended before" in result.error


def test_a_stream_without_text_fails():
    result, _ = run(openai_completions, [(0, e) for e in sse(completion_chunk("", "stop"), "[DONE]")])
    assert not result.success and "without any generated text" in result.error


def test_malformed_json_fails():
    result, _ = run(openai_completions, [(0, b"data: {not json\n\n")])
    assert not result.success and result.error.startswith("malformed stream")


def test_connection_errors_are_recorded():
    result, _ = run(openai_completions, error=httpx.ConnectError("Connection refused"))
    assert not result.success and result.error == "ConnectError: Connection refused"
    result, _ = run(openai_completions, error=httpx.ReadTimeout(""))
    assert result.error == "ReadTimeout: no message"


def test_chat_sends_a_user_message_and_skips_the_role_chunk():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}

    def delta(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}

    parts = [(0.0, sse(role)[0]), (0.1, sse(delta("Hi"))[0]), (0.05, sse(delta("!", "length"))[0]),
             (0.0, sse(USAGE)[0]), (0.0, sse("[DONE]")[0])]
    result, sent = run(openai_chat, parts)
    assert sent["body"]["messages"] == [{"role": "user", "content": "the cat"}]
    assert "prompt" not in sent["body"]
    assert result.success and result.generated_text == "Hi!"
    assert about(result.ttft, 0.1) and len(result.itl) == 1


def test_sglang_generate_reads_cumulative_text():
    def event(text: str, tokens: int, finish: Any = None) -> dict[str, Any]:
        return {"text": text, "output_ids": list(range(tokens)),
                "meta_info": {"prompt_tokens": 3, "completion_tokens": tokens, "finish_reason": finish}}

    parts = [(0.1, sse(event("a", 1))[0]), (0.05, sse(event("ab", 2))[0]),
             (0.05, sse(event("abc", 3, {"type": "length", "length": 3}))[0]), (0.0, sse("[DONE]")[0])]
    result, sent = run(sglang_generate, parts)
    assert sent["body"]["input_ids"] == [5, 6, 7] and sent["body"]["stream"] is True
    assert sent["body"]["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                               "min_new_tokens": 3}
    assert result.success and result.generated_text == "abc"
    assert (result.output_tokens, result.prompt_len) == (3, 3)
    assert about(result.ttft, 0.1) and len(result.itl) == 2


def test_finish_reason_and_forced_chunk_counting():
    events = [(0, e) for e in sse(completion_chunk("a"), completion_chunk("b"), completion_chunk("", "length"),
                                  USAGE, "[DONE]")]
    auto, _ = run(openai_completions, events)
    assert auto.finish_reason == "length" and (auto.output_tokens, auto.output_tokens_source) == (3, "usage")
    # A server streaming one token per chunk: count the chunks with text, whatever else it says.
    chunks, _ = run(openai_completions, events, output_token_count="chunks")
    assert (chunks.output_tokens, chunks.output_tokens_source, chunks.prompt_len) == (2, "chunks", 4)
    retok, _ = run(openai_completions, events, output_token_count="tokenizer", tokenizer=ToyTokenizer())
    assert retok.output_tokens_source == "tokenizer"
