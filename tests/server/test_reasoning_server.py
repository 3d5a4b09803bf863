"""--reasoning-parser end to end with the official openai client: the think block comes back as
reasoning_content beside content, whole and streamed (the same split), counted in
usage.completion_tokens_details.reasoning_tokens; a constraint binds only the answer after the
block, and reasoning_max_tokens forces the block closed. SmolLM2 is no reasoning model, but greedy
decoding makes it echo a think block on cue, and an ordinary answer is, for deepseek_r1 (whose
output starts inside the block), unfinished reasoning."""

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
def test_include_reasoning_false_drops_the_think_block(servers, stream):
    """vLLM's include_reasoning: false returns the answer only (reasoning_content null)."""
    reasoning, content, usage = _chat(servers["deepseek_r1"], ECHO, stream, extra_body={"include_reasoning": False})
    assert (reasoning, content) == (None, " yes") and usage.completion_tokens_details.reasoning_tokens > 0


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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_constraint_binds_the_answer_not_the_think_block(servers, stream):
    # The echoed think block is text no choice allows; the constraint starts after </think>.
    reasoning, content, _ = _chat(servers["deepseek_r1"], ECHO, stream, extra_body={"guided_choice": [" yes", " no"]})
    assert (reasoning, content) == ("Echo: <think>maybe", " yes")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_max_tokens_forces_the_block_closed(servers, smollm2_tokenizer, stream):
    raw = servers["plain"].chat.completions.create(model=MODEL, messages=PLAIN, temperature=0.0, max_tokens=5,
                                                   extra_body={"return_token_ids": True})
    ids = raw.choices[0].model_extra["token_ids"]
    reasoning, content, usage = _chat(servers["deepseek_r1"], PLAIN, stream, extra_body={"reasoning_max_tokens": 5})
    # Five tokens of the model's own answer as reasoning, then </think> spelled out by force (three
    # tokens in SmolLM2's vocabulary), then an answer.
    assert reasoning == smollm2_tokenizer.decode(ids) and content
    end = smollm2_tokenizer.encode("</think>", add_special_tokens=False)
    assert usage.completion_tokens_details.reasoning_tokens == 5 + len(end)


def test_bad_prompt_ids_are_refused_with_a_parser(servers):
    url = str(servers["deepseek_r1"].base_url).rstrip("/")
    # Token ids outside the vocabulary are refused before the parser decodes the prompt's tail.
    r = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": PLAIN, "prompt_token_ids": [10**10]},
                   timeout=60)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text


def test_responses_api_returns_a_reasoning_item(servers, smollm2_tokenizer):
    client = servers["deepseek_r1"]
    kwargs = dict(model=MODEL, input=ECHO[0]["content"], temperature=0, max_output_tokens=24, top_logprobs=1,
                  include=["message.output_text.logprobs"])
    r = client.responses.create(**kwargs)
    thought, message = r.output
    assert thought.type == "reasoning" and thought.status == "completed" and thought.summary == []
    assert [c.text for c in thought.content] == ["Echo: <think>maybe"]
    assert message.type == "message" and r.output_text == " yes" and r.status == "completed"
    raw = servers["plain"].chat.completions.create(model=MODEL, messages=ECHO, temperature=0.0, max_tokens=24,
                                                   extra_body={"return_token_ids": True})
    ids = raw.choices[0].model_extra["token_ids"]
    spent = _tokens_through(smollm2_tokenizer, ids, "</think>")
    assert r.usage.output_tokens_details.reasoning_tokens == spent
    # The message's logprobs are the answer's tokens'.
    assert len(message.content[0].logprobs) == r.usage.output_tokens - spent
    # Streamed: the reasoning item and its deltas first, then the message; the same texts.
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Echo: <think>maybe"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " yes"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1].response
    assert final.output_text == " yes" and final.output[0].content[0].text == "Echo: <think>maybe"
    # The next turn may send the reasoning item back; it goes to the template with the assistant turn.
    r = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": ECHO[0]["content"]},
        {"type": "reasoning", "id": thought.id, "summary": [],
         "content": [{"type": "reasoning_text", "text": "Echo: <think>maybe"}]},
        {"role": "assistant", "content": " yes"}, {"role": "user", "content": "And again?"}])
    assert r.status in ("completed", "incomplete")
