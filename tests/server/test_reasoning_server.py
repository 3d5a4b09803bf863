"""--reasoning-parser end to end with the official openai client: the think block comes back as
reasoning_content beside content, whole and streamed (the same split), counted in
usage.completion_tokens_details.reasoning_tokens; constraints that would bind the think block are
refused. SmolLM2 is no reasoning model, but greedy decoding makes it echo a think block on cue, and
an ordinary answer is, for deepseek_r1 (whose output starts inside the block), unfinished reasoning."""

from __future__ import annotations

import httpx
import pytest
from live_server import MAX_MODEL_LEN, MODEL, start_server

from jaxserve.server.app import create_app

pytestmark = pytest.mark.slow

ECHO = [{"role": "user", "content": "Echo: <think>maybe</think> yes"}]  # greedy SmolLM2 echoes it
PLAIN = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(async_engine, smollm2_tokenizer, server):
    """The shared plain server and two more over the same engine, one per parser."""
    import openai

    lives = {name: start_server(create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN,
                                           reasoning_parser=name)) for name in ("deepseek_r1", "qwen3")}
    clients = {name: openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
               for name, live in {**lives, "plain": server}.items()}
    yield clients
    for live in lives.values():
        live.close()


def _chat(client, messages, stream=False, **kw):
    args = dict(model=MODEL, messages=messages, temperature=0.0, max_tokens=24, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        return m.model_extra.get("reasoning_content"), m.content, r.usage
    reasoning, content, usage = "", "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    return reasoning or None, content or None, usage


def _tokens_through(tokenizer, ids, tag):
    return next(k for k in range(1, len(ids) + 1) if tag in tokenizer.decode(ids[:k]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_deepseek_r1_splits_an_echoed_think_block(servers, smollm2_tokenizer, stream):
    raw = servers["plain"].chat.completions.create(model=MODEL, messages=ECHO, temperature=0.0, max_tokens=24,
                                                   extra_body={"return_token_ids": True})
    assert raw.choices[0].message.content == "Echo: <think>maybe</think> yes"
    reasoning, content, usage = _chat(servers["deepseek_r1"], ECHO, stream)
    # The output starts inside the block (R1's templates open it), so the block is everything before
    # </think>, and the answer what follows it.
    assert (reasoning, content) == ("Echo: <think>maybe", " yes")
    ids = raw.choices[0].model_extra["token_ids"]
    assert usage.completion_tokens == len(ids)
    assert usage.completion_tokens_details.reasoning_tokens == _tokens_through(smollm2_tokenizer, ids, "</think>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_unfinished_reasoning_and_no_reasoning(servers, stream):
    raw = servers["plain"].chat.completions.create(model=MODEL, messages=PLAIN, temperature=0.0, max_tokens=24)
    text = raw.choices[0].message.content
    reasoning, content, usage = _chat(servers["deepseek_r1"], PLAIN, stream)
    assert (reasoning, content) == (text, None)  # the output ended with the block still open
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == raw.usage.completion_tokens
    # qwen3 reasons only inside a block the output (or the template) opens: this echo opens none.
    reasoning, content, usage = _chat(servers["qwen3"], ECHO, stream)
    assert (reasoning, content) == (None, "Echo: <think>maybe</think> yes")
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_constraints_and_reasoning_max_tokens_are_refused_with_a_parser(servers):
    url = str(servers["deepseek_r1"].base_url).rstrip("/")
    for body, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"guided_regex": "[ab]+"}, "guided_regex"),
                        ({"reasoning_max_tokens": 10}, "reasoning_max_tokens")]:
        r = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": PLAIN, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # Token ids outside the vocabulary are refused before the parser decodes the prompt's tail.
    r = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": PLAIN, "prompt_token_ids": [10**10]},
                   timeout=60)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text
