"""POST /v1/responses: the live server driven by the official `openai` client (slow), and the
refusals and the mid-stream failure on the model-free app (fast)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from live_server import MODEL
from test_app_unit import FailingEngine, FakeTokenizer

from jaxserve.server.app import create_app

QUESTION = "What is 2 + 2?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                          "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


def _chat(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


# ---- live server --------------------------------------------------------------------------------
@pytest.mark.slow
def test_string_input_is_the_chat_completion_of_one_user_message(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0,
                                metadata={"run": "t1"}, store=True, user="u1")
    chat = _chat(client, [{"role": "user", "content": QUESTION}], 20)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    (item,) = r.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.output_text == chat.choices[0].message.content  # greedy, same template: the same tokens
    assert "4" in r.output_text
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0
    assert (r.metadata, r.user, r.temperature, r.tools, r.tool_choice) == ({"run": "t1"}, "u1", 0, [], "auto")


@pytest.mark.slow
def test_items_and_instructions_are_the_chat_messages(client):
    items = [{"role": "user", "content": "Name a colour."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}]
    r = client.responses.create(model=MODEL, instructions="You are terse.", input=items, max_output_tokens=12,
                                temperature=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    chat = _chat(client, messages, 12)
    assert r.output_text == chat.choices[0].message.content and r.instructions == "You are terse."
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_stream_events_in_order_and_equal_to_the_whole_response(client):
    kwargs = {"model": MODEL, "input": QUESTION, "max_output_tokens": 20, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == events[-3].part.text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.output[0].content[0].text == whole.output_text and final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The message opens empty: its text comes only in the deltas (the first delta opens it).
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert events[3].part.text == "" and deltas[0].delta
    # The client's own accumulator checks identities and item order as it goes, and adds each
    # delta to the part it was announced with.
    with client.responses.stream(**kwargs) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        assert snapshots[-1] == whole.output_text
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.slow
def test_json_schema_format_and_the_clients_parse(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(model=MODEL, input="Give a city and its population as JSON.", text={"format": fmt},
                                max_output_tokens=60, temperature=0)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)

    class City(pydantic.BaseModel):
        city: str
        population: int

    parsed = client.responses.parse(model=MODEL, input="Give a city and its population.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.slow
def test_max_output_tokens_ends_incomplete(client):
    kwargs = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0}
    r = client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.max_output_tokens == 3
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete" and events[-2].item.content[0].text == r.output_text


@pytest.mark.slow
def test_openapi_documents_the_route(server):
    body = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/responses"]["post"]["requestBody"]
    assert {"input", "instructions", "text"} <= set(body["content"]["application/json"]["schema"]["properties"])


@pytest.mark.slow
def test_logprobs_when_included(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and "".join(t.token for t in lps) == r.output_text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)


@pytest.mark.slow
def test_stored_responses_continue_read_and_delete(client):
    """store (OpenAI's default): previous_response_id puts the stored conversation before the
    input (the same greedy tokens as the whole conversation sent at once); retrieve, input_items
    and delete read and forget it; store false keeps nothing."""
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0,
                                    instructions="Answer in one word.")
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model=MODEL, input="And another one?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    # The earlier instructions do not carry over (OpenAI's rule); its input and output do.
    whole = _chat(client, [{"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "And another one?"}], 8)
    assert second.output_text == whole.choices[0].message.content
    assert second.previous_response_id == first.id and second.usage.input_tokens == whole.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And another one?")]
    # Streamed responses are stored too, once they finish.
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0,
                                          previous_response_id=second.id, stream=True))
    streamed = events[-1].response
    assert events[-1].type == "response.incomplete" and events[0].response.store is streamed.store is True
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:  # OpenAI's code, on which clients resend everything
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert caught.value.param == "previous_response_id" and caught.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(second.id, stream=True)  # no stream to resume here
    assert caught.value.param == "stream"
    # The second holds the whole conversation, so it still continues with the first gone.
    third = client.responses.create(model=MODEL, input="One more?", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_background_responses_are_polled_and_cancelled(client):
    """background: the request returns while the response runs; GET polls it to the same answer
    as a foreground run; cancel stops one running (status "cancelled"); a finished one cannot be."""
    import time

    started = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0,
                                      background=True)
    assert started.background is True and started.status in ("in_progress", "completed")
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(started.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    foreground = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0)
    assert polled.status == foreground.status and polled.output_text == foreground.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(started.id)  # finished
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", background=True, store=False, max_output_tokens=2)
    assert caught.value.param == "background"
    long = client.responses.create(model=MODEL, input="Count from 1 to 500, one number per line.",
                                   max_output_tokens=400, temperature=0, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 400 and cancelled.error is None
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # again: the same answer
    # Deleted while it runs: it stops, and is not stored again when it ends.
    doomed = client.responses.create(model=MODEL, input="Count from 1 to 500, one number per line.",
                                     max_output_tokens=400, temperature=0, background=True)
    client.responses.delete(doomed.id)
    time.sleep(0.5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)


@pytest.mark.slow
def test_a_streamed_background_response_is_resumed_after_any_event(client):
    """background + stream: the events of a foreground stream, numbered from 0; a reader that
    drops the connection stops nothing and resumes after the last event it read, while the
    response runs and once it has finished; a cancelled one's stream ends without a closing event."""
    args = dict(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0)
    foreground = list(client.responses.create(**args, stream=True))
    stream = client.responses.create(**args, stream=True, background=True)
    read = iter(stream)
    first = [next(read) for _ in range(3)]
    stream.close()  # the connection drops after three events
    resumed = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=2))
    events = first + resumed
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [e.type for e in foreground]
    final = events[-1].response
    assert final.background is True and final.output_text == foreground[-1].response.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # Finished: the whole stream again, from the start or after any event.
    again = list(client.responses.retrieve(final.id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    assert [e.sequence_number for e in client.responses.retrieve(final.id, stream=True,
                                                                 starting_after=len(events) - 2)] == [len(events) - 1]
    for bad in (len(events), -2):  # (the last event's own number is fine: nothing follows it)
        with pytest.raises(openai.BadRequestError) as caught:
            list(client.responses.retrieve(final.id, stream=True, starting_after=bad))
        assert caught.value.param == "starting_after"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(final.id, starting_after=3)  # without stream
    assert caught.value.param == "starting_after"
    # Cancelled while it streams: the items close, and no closing lifecycle event follows.
    long = client.responses.create(model=MODEL, input="Count from 1 to 500, one number per line.",
                                   max_output_tokens=400, temperature=0, background=True, stream=True)
    events = iter(long)
    started = [next(events) for _ in range(6)]
    client.responses.cancel(started[0].response.id)
    rest = list(events)
    assert rest and rest[-1].type == "response.output_item.done" and rest[-1].item.status == "incomplete"
    assert client.responses.retrieve(started[0].response.id).status == "cancelled"


@pytest.mark.slow
def test_a_conversation_is_read_before_the_input_and_extended_by_each_response(client):
    """The Conversations API: a response with `conversation` answers as the whole conversation sent
    at once (the same greedy tokens), and its input and output join the conversation's items."""
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Name a colour."},
                                              {"type": "message", "role": "assistant", "content": "Blue."}],
                                       metadata={"topic": "colours"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "colours"}
    first = client.responses.create(model=MODEL, input="And another one?", conversation=conv.id,
                                    max_output_tokens=8, temperature=0)
    whole = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "And another one?"}]
    assert first.output_text == _chat(client, whole, 8).choices[0].message.content
    assert first.conversation.id == conv.id
    second = client.responses.create(model=MODEL, input="One more?", conversation={"id": conv.id},
                                     max_output_tokens=6, temperature=0)
    whole += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "One more?"}]
    assert second.output_text == _chat(client, whole, 6).choices[0].message.content
    items = client.conversations.items.list(conv.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in items.data]
    assert texts == [(m["role"], m["content"]) for m in whole] + [("assistant", second.output_text)]
    assert items.data[-1].id == second.output[0].id and not items.has_more
    # Items: read one, delete one (the conversation answers), add some, page through them.
    assert client.conversations.items.retrieve(items.data[0].id, conversation_id=conv.id).content[0].text == \
        "Name a colour."
    client.conversations.items.delete(items.data[0].id, conversation_id=conv.id)
    added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Thanks."}])
    assert [i.content[0].text for i in added.data] == ["Thanks."]
    newest = client.conversations.items.list(conv.id, limit=2)  # OpenAI's default order: newest first
    assert [i.content[0].text for i in newest.data] == ["Thanks.", second.output_text] and newest.has_more
    assert client.conversations.update(conv.id, metadata={"topic": "paint"}).metadata == {"topic": "paint"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", conversation=conv.id, previous_response_id=first.id,
                                max_output_tokens=2)
    assert caught.value.param == "conversation"
    with pytest.raises(openai.BadRequestError) as caught:  # a function call's output answers an earlier call
        client.conversations.items.create(conv.id, items=[{"type": "function_call_output", "call_id": "c1",
                                                           "output": "4"}])
    assert caught.value.param == "items[0].call_id"
    assert client.conversations.delete(conv.id).deleted
    for call in (lambda: client.conversations.retrieve(conv.id),
                 lambda: client.responses.create(model=MODEL, input="x", conversation=conv.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.slow
def test_a_stored_function_call_is_answered_by_its_output(client):
    """The function_call a stored response made is what a function_call_output continuing it answers."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}]
    call = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=30,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (item,) = call.output
    assert item.type == "function_call"
    answer = client.responses.create(model=MODEL, previous_response_id=call.id, tools=tools, max_output_tokens=6,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": item.call_id,
                                                            "output": "sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, param, words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": "word " * 600}, "input", "context limit of 512"),
    ({"input": QUESTION, "max_output_tokens": 600}, "max_output_tokens", "max_output_tokens is 600"),
])
def test_bad_requests_are_400_naming_the_parameter(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, **kwargs)
    assert caught.value.param == param and words in caught.value.message


# ---- the model-free app -------------------------------------------------------------------------
def _post(body: dict) -> tuple[int, bytes]:
    app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100)  # type: ignore[arg-type]

    async def go() -> tuple[int, bytes]:
        response = await app.test_client().post("/v1/responses", json=body)
        return response.status_code, await response.get_data()

    return asyncio.run(go())


@pytest.mark.parametrize("extra, param", [
    ({"background": True, "stream": True, "store": False}, "background"),  # nowhere to resume it from
    ({"conversation": {"id": "conv_1", "name": "x"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tool_choice": "required"}, "tools"),  # forcing a call needs tools
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format.schema"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"seed": 1}, "seed"),  # not a Responses field: refused, not ignored
    ({"max_output_tokens": 101}, "max_output_tokens"),  # the engine's limit, in this API's words
    ({"input": None}, "input"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
])
def test_refusals_name_the_parameter(extra, param):
    status, data = _post({"input": "x", **extra})
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == param and err["message"].startswith(param), err


def test_accepted_hints_and_a_failure_mid_stream():
    status, data = _post({"input": "x", "stream": True, "store": True, "tool_choice": "none",
                          "reasoning": {"effort": None}, "truncation": "disabled", "service_tier": "auto",
                          "parallel_tool_calls": False, "safety_identifier": "s", "prompt_cache_key": "k",
                          "max_tool_calls": 2, "text": {"format": {"type": "text"}, "verbosity": "medium"}})
    # OpenAI's framing: an `event:` line, then the `data:` line.
    lines = [block.split("\n") for block in data.decode().split("\n\n")[:-1]]
    events = [json.loads(data_line.removeprefix("data: ")) for _, data_line in lines]
    assert [event_line for event_line, _ in lines] == [f"event: {e['type']}" for e in events]
    assert status == 200 and [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error", "response.failed"]
    assert events[4]["delta"] == "Hi" and "device lost" in events[5]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "device lost" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "Hi" and failed["parallel_tool_calls"] is False


def test_a_stored_output_is_continued_without_logprobs_or_a_cut_off_call():
    from jaxserve.server.openai_responses import _continuable

    output = [{"type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": "<tool_call>", "annotations": [], "logprobs": [{"x": 1}]}]},
              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"city": "Pa'},
              {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"city": "Rome"}'}]
    kept = _continuable(output)
    assert kept[0]["content"] == [{"type": "output_text", "text": "<tool_call>", "annotations": []}]
    assert [i.get("call_id") for i in kept] == [None, "c2"]


def test_conversation_routes_refuse_what_they_cannot_keep():
    """The Conversations API on the model-free app: each bad input is a 4xx naming the parameter."""
    async def go(app) -> list[tuple[int, str | None]]:
        c = app.test_client()
        conv = await (await c.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]})).get_json()
        items = f"/v1/conversations/{conv['id']}/items"
        first = (await (await c.get(items)).get_json())["data"][0]["id"]
        tools = await (await c.post("/v1/conversations", json={"items": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "4"}]})).get_json()
        call, answer = [i["id"] for i in (await (await c.get(f"/v1/conversations/{tools['id']}/items?order=asc"))
                                          .get_json())["data"]]
        calls = [
            c.post("/v1/conversations", json={"items": [{"role": "user", "content": "x"}] * 21}),
            c.post("/v1/conversations", json={"items": [{"type": "computer_call_output"}]}),
            c.post("/v1/conversations", json={"metadata": {f"k{i}": "v" for i in range(17)}}),
            c.post("/v1/conversations", json={"title": "x"}),
            c.post(f"/v1/conversations/{conv['id']}", json={}),  # update: metadata is required
            c.get("/v1/conversations/conv_nope"),
            c.get(f"/v1/conversations/{conv['id']}/items?limit=0"),
            c.get(f"/v1/conversations/{conv['id']}/items?after=msg_nope"),
            c.get(f"/v1/conversations/{conv['id']}/items?include=message.output_text.logprobs"),
            c.get(f"/v1/conversations/{conv['id']}/items/msg_nope"),
            c.delete(f"/v1/conversations/{conv['id']}/items/msg_nope"),
            c.post("/v1/responses", json={"input": "x", "conversation": "conv_nope"}),
            c.post(items, json={"items": [{"role": "user", "content": "y", "id": "m1"},
                                          {"role": "user", "content": "z", "id": "m1"}]}),
            c.post(items, json={"items": [{"role": "user", "content": "y", "id": 7}]}),
            c.post("/v1/responses", json={"input": [{"role": "user", "content": "y", "id": first}],
                                          "conversation": conv["id"]}),  # already in the conversation
            c.delete(f"/v1/conversations/{tools['id']}/items/{call}"),  # its output would answer nothing
            c.post("/v1/responses", json={"input": "x", "conversation": conv["id"], "previous_response_id": "r"}),
        ]
        out = []
        for request in calls:
            response = await request
            out.append((response.status_code, (await response.get_json())["error"]["param"]))
        # The output first, then its call: both go.
        for item in (answer, call):
            out.append(((await c.delete(f"/v1/conversations/{tools['id']}/items/{item}")).status_code, None))
        return out

    app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100)  # type: ignore[arg-type]
    assert asyncio.run(go(app)) == [
        (400, "items"), (400, "items[0].type"), (400, "metadata"), (400, "title"), (400, "metadata"),
        (404, "conversation_id"), (400, "limit"), (400, "after"), (400, "include"), (404, "item_id"),
        (404, "item_id"), (404, "conversation"), (400, "items[1].id"), (400, "items[0].id"), (400, "input[0].id"),
        (400, "item_id"), (400, "conversation"), (200, None), (200, None)]
    unkept = create_app(FailingEngine(), FakeTokenizer(), "fake", 100, max_stored_responses=0)  # type: ignore[arg-type]

    async def refused() -> tuple[int, str]:
        response = await unkept.test_client().post("/v1/conversations", json={})
        return response.status_code, (await response.get_json())["error"]["param"]

    assert asyncio.run(refused()) == (400, "conversation")


@pytest.mark.parametrize("room", ["whole", "without events"])
def test_a_streamed_background_response_is_kept_with_its_events_or_without(room):
    """background + stream on the model-free app (a delta, then the device fails): the POST streams
    every event; a GET with stream=true replays those after starting_after from the store. A store
    too small for the events keeps the response without them (still read, not streamed again)."""
    from jaxserve.server.app import state_of
    from jaxserve.server.response_store import ResponseStore

    async def go() -> tuple[list[dict], dict, tuple[int, bytes]]:
        app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100)  # type: ignore[arg-type]
        if room == "without events":
            state_of(app).responses = ResponseStore(10, max_bytes=4000)  # a response's JSON, not its events
        c = app.test_client()
        posted = await (await c.post("/v1/responses", json={"input": "x", "background": True, "stream": True})
                        ).get_data()
        events = [json.loads(block.split("\n")[1].removeprefix("data: "))
                  for block in posted.decode().split("\n\n")[:-1]]
        rid = events[0]["response"]["id"]
        kept = await (await c.get(f"/v1/responses/{rid}")).get_json()
        again = await c.get(f"/v1/responses/{rid}?stream=true&starting_after=4")
        return events, kept, (again.status_code, await again.get_data())

    events, kept, (status, replayed) = asyncio.run(go())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(7)) and events[0]["response"]["background"] is True
    assert kept["status"] == "failed" and kept["output"][0]["content"][0]["text"] == "Hi"
    if room == "whole":
        again = [json.loads(block.split("\n")[1].removeprefix("data: "))
                 for block in replayed.decode().split("\n\n")[:-1]]
        assert status == 200 and again == events[5:]
    else:
        assert status == 400 and json.loads(replayed)["error"]["param"] == "stream"
