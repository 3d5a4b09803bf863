"""Tool calls for tool_choice "auto" and reasoning, end to end with the official openai client, on
tiny random-weight Qwen3 and Llama-3.1 models carrying their real chat templates
(tests/tiny_chat_models.py): `--tool-call-parser auto` picks hermes and llama3_json from the
templates, `--reasoning-parser qwen3` splits the think block.

A random model never decides to call a tool, so logit_bias steers it onto the trigger (`<tool_call>`
for Qwen3, `{` for Llama 3.1); from there the grammar decides: the call's name must be a tool's and
its arguments must match that tool's schema, so the call parses however the model samples."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from live_server import start_server
from tiny_chat_models import MARKERS, make_tiny_chat_model

from jaxserve.config import CacheConfig, Config, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.app import create_app
from jaxserve.startup import start_engine
from jaxserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
QWEN = MARKERS["qwen3"]


def _serve(family: str, cache_dir, tmp_path_factory, **app_options):
    directory = make_tiny_chat_model(family, tmp_path_factory.mktemp(family), cache_dir)
    config = Config(
        model=ModelConfig(model=str(directory), served_model_name=family, dtype="float32", max_model_len=512,
                          cache_dir=cache_dir),
        parallel=ParallelConfig(), server=ServerConfig(), cache=CacheConfig(page_size=16, num_pages=360),
        # Two decode buckets and one prefill bucket: the steps' compiles were most of this module's
        # time, and which bucket pads a batch changes no token.
        scheduler=SchedulerConfig(max_num_seqs=10, max_num_batched_tokens=128, max_prefill_seqs=2,
                                  decode_buckets=(2, 10), prefill_buckets=(128,)),
        compilation_cache_dir=cache_dir / "xla")
    engine = AsyncEngine(start_engine(config)[0])
    tokenizer = load_tokenizer(directory, None, cache_dir=cache_dir)
    live = start_server(create_app(engine, tokenizer, family, 512, **app_options))
    return engine, tokenizer, live


@pytest.fixture(scope="module")
def qwen3(cache_dir, tmp_path_factory):
    import openai

    engine, tokenizer, live = _serve("qwen3", cache_dir, tmp_path_factory, tool_call_parser="auto",
                                     reasoning_parser="qwen3")
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300), tokenizer, live
    live.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def llama(cache_dir, tmp_path_factory):
    import openai

    engine, tokenizer, live = _serve("llama3.1", cache_dir, tmp_path_factory, tool_call_parser="auto")
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300), tokenizer, live
    live.close()
    engine.shutdown()


def _assemble(chunks) -> tuple[str | None, str | None, list[tuple[str, str, str]], list[str | None]]:
    """A stream's reasoning, content, tool calls (id, name, arguments) and finish reasons, checking
    the OpenAI shape of tool-call deltas on the way: id, type and name once, then argument pieces."""
    reasoning, content, calls, finishes = "", "", {}, []
    for chunk in chunks:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and d.function.name is None, d
                    calls[d.index][2] += d.function.arguments or ""
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    return reasoning or None, content or None, [tuple(calls[k]) for k in sorted(calls)], finishes


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_auto_picks_parsers_from_the_templates(qwen3, llama):
    from jaxserve.server.tool_parsers import auto_parser

    assert auto_parser(qwen3[1].chat_template) == "hermes"
    assert auto_parser(llama[1].chat_template) == "llama3_json"


def test_qwen3_auto_tool_call_whole_and_streamed(qwen3):
    client, _, _ = qwen3
    args = dict(model="qwen3", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=80, parallel_tool_calls=False,
                logit_bias={str(QWEN["<tool_call>"]): 100},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    _check_call(call.function.name, call.function.arguments)
    # No markup reaches the content, whole or streamed; the stream assembles to the same call.
    reasoning, content, calls, finishes = _assemble(client.chat.completions.create(stream=True, **args))
    assert (reasoning, content) == (None, None)
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    assert finishes == ["tool_calls"]
    # The next turn, as the openai client sends it: the assistant message object itself (content
    # null, arguments as JSON text) and the tool's result.
    follow = ASK + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "22C, sunny"}]
    r = client.chat.completions.create(model="qwen3", messages=follow, tools=TOOLS, temperature=0.0, max_tokens=3,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_constrained_auto_tool_calls_parse_under_sampling(qwen3):
    """Temperature 1.0 on a random model: 50 of 50 calls parse and match their tool's schema."""
    client, _, _ = qwen3
    seen = []
    for seed in range(5):
        r = client.chat.completions.create(
            model="qwen3", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, n=10, max_tokens=120,
            parallel_tool_calls=False, logit_bias={str(QWEN["<tool_call>"]): 100},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            _check_call(call.function.name, call.function.arguments)
            seen.append(call.function.name)
    assert len(seen) == 50 and set(seen) == {"get_weather", "get_time"}  # sampling picked both


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_reasoning_cap_then_tool_call(qwen3, stream):
    """Thinking on (the template leaves the block to the model): the steered model opens <think>,
    reasoning_max_tokens ends the block by force after 3 tokens, and the answer is a constrained
    tool call; nothing of the call lands in reasoning_content and nothing of the think in content."""
    client, _, _ = qwen3
    args = dict(model="qwen3", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=80, parallel_tool_calls=False,
                logit_bias={str(QWEN["<think>"]): 100, str(QWEN["<tool_call>"]): 50},
                extra_body={"reasoning_max_tokens": 3})
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        reasoning, content = m.model_extra.get("reasoning_content"), m.content
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        usage = r.usage
    else:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        reasoning, content, calls, _ = _assemble(chunks)
        usage = chunks[-1].usage
    # Three tokens of (steered) reasoning: the model's second and later <think>s are its text.
    assert reasoning == "<think>" * 3
    assert content is None and len(calls) == 1
    _check_call(calls[0][1], calls[0][2])
    # <think>, three tokens, then the forced </think> (one token in Qwen3's vocabulary).
    assert usage.completion_tokens_details.reasoning_tokens == 5


def test_qwen3_json_answer_after_free_reasoning(qwen3):
    """response_format binds the answer only: the think block before it is free text."""
    client, _, _ = qwen3
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"]}
    r = client.chat.completions.create(
        model="qwen3", messages=ASK, temperature=0.0, max_tokens=60, logit_bias={str(QWEN["<think>"]): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"reasoning_max_tokens": 4})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "<think>" * 4, m
    jsonschema.validate(json.loads(m.content), schema)
    assert r.choices[0].finish_reason == "stop"


def test_qwen3_forced_call_after_reasoning(qwen3):
    client, _, _ = qwen3
    r = client.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.0, max_tokens=60, logit_bias={str(QWEN["<think>"]): 100}, extra_body={"reasoning_max_tokens": 2})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "<think>" * 2
    (call,) = m.tool_calls
    assert call.function.name == "get_time"
    _check_call("get_time", call.function.arguments)


@pytest.mark.parametrize("steer, called", [(True, True), (False, False)], ids=["call", "format"])
def test_auto_tools_beside_a_response_format(qwen3, steer, called):
    """With response_format, an auto answer is tool calls or that format, never free text."""
    client, _, _ = qwen3
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    r = client.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=80, parallel_tool_calls=False,
        logit_bias={str(QWEN["<tool_call>"]): 100} if steer else None,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    if called:
        (call,) = m.tool_calls
        _check_call(call.function.name, call.function.arguments)
    else:
        assert m.tool_calls is None
        jsonschema.validate(json.loads(m.content), schema)


def test_tool_choice_none_never_calls(qwen3):
    client, _, _ = qwen3
    r = client.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=6,
        logit_bias={str(QWEN["<tool_call>"]): 100}, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == "<tool_call>" * 6 and choice.finish_reason == "length"


def test_llama31_auto_tool_call(llama):
    client, tokenizer, _ = llama
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    args = dict(model="llama3.1", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=80,
                parallel_tool_calls=False, logit_bias={str(brace[0]): 100})
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    _, content, calls, finishes = _assemble(client.chat.completions.create(stream=True, **args))
    assert content is None and [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    assert finishes == ["tool_calls"]
    # Without the steer the model writes text, which can never start like a call.
    r = client.chat.completions.create(model="llama3.1", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and not r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_tool_conversation_renders(qwen3, llama, family):
    """The follow-up turn: an assistant message carrying tool_calls (arguments as OpenAI's JSON
    text, content null) and the tool's answer, through each real template."""
    client = {"qwen3": qwen3, "llama": llama}[family][0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22C"}]
    r = client.chat.completions.create(model={"qwen3": "qwen3", "llama": "llama3.1"}[family], messages=messages,
                                       tools=TOOLS, temperature=0.0, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"messages": ASK + [{"role": "tool", "content": "22C"}]}, "messages[2].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "x"}]}, "messages[3].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tool_choice": "none"},
     "tools[0].function.parameters"),
    ({"reasoning_max_tokens": 0}, "reasoning_max_tokens"),
])
def test_bad_tool_requests_are_400(qwen3, body, param):
    _, _, live = qwen3
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "qwen3", "messages": ASK, "max_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] or r.json()["error"].get("param") == param, r.text


def test_reasoning_max_tokens_needs_a_reasoning_parser(llama):
    _, _, live = llama
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": "llama3.1", "messages": ASK, "max_tokens": 2, "reasoning_max_tokens": 5}, timeout=60)
    assert r.status_code == 400 and "reasoning_max_tokens" in r.text


@pytest.fixture(scope="module")
def smollm2_hermes(async_engine, smollm2_tokenizer):
    import openai
    from live_server import MAX_MODEL_LEN, MODEL

    live = start_server(create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN, tool_call_parser="hermes"))
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300), MODEL
    live.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_smollm2_echoes_a_call_that_parses(smollm2_hermes, stream):
    """SmolLM2's template shows no tools, but greedy SmolLM2 echoes a call on cue: the real GGUF
    tokenizer spells <tool_call> in several tokens, and the call is still read (and bound to the
    schema once opened)."""
    client, model = smollm2_hermes
    echo = [{"role": "user", "content": 'Echo: <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                                        '</tool_call>'}]
    args = dict(model=model, messages=echo, tools=TOOLS, temperature=0.0, max_tokens=40)
    if stream:
        _, content, calls, finishes = _assemble(client.chat.completions.create(stream=True, **args))
        calls = [(n, a) for _, n, a in calls]
    else:
        r = client.chat.completions.create(**args)
        content, finishes = r.choices[0].message.content, [r.choices[0].finish_reason]
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
    assert calls == [("get_time", '{"zone": "UTC"}')]
    assert content == "Echo:" and finishes == ["tool_calls"]


# ---- the Responses API ------------------------------------------------------------------------------
FLAT_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
               "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]


def _call_items(output) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in output if o.type == "function_call"]


def test_responses_forced_call_whole_and_streamed(qwen3):
    client, _, _ = qwen3
    kwargs = dict(model="qwen3", input="What time is it in Paris?", tools=FLAT_TOOLS, temperature=0,
                  tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40)
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_time" and call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    _check_call("get_time", call.arguments)
    events = list(client.responses.create(stream=True, **kwargs))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == call.arguments
    assert _call_items(events[-1].response.output) == [("get_time", call.arguments)]


def test_responses_conversation_with_calls(qwen3):
    """function_call and function_call_output items reach the real template as the assistant turn's
    tool_calls and the tool's answer; a result for a call never made is refused."""
    client, _, _ = qwen3
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "days": 1}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 22C"}]
    r = client.responses.create(model="qwen3", input=history, tools=FLAT_TOOLS, max_output_tokens=4, temperature=0)
    assert r.status in ("completed", "incomplete")
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="qwen3", input=history[:1] + history[2:], tools=FLAT_TOOLS, max_output_tokens=4)
    assert caught.value.param == "input[1].call_id"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_auto_call_from_smollm2(smollm2_hermes, stream):
    client, model = smollm2_hermes
    echo = 'Echo: <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    kwargs = dict(model=model, input=echo, tools=FLAT_TOOLS, temperature=0, max_output_tokens=40)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["message", "function_call"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Echo:"
        r = events[-1].response
    else:
        r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Echo:" and _call_items(r.output) == [("get_time", '{"zone": "UTC"}')]
