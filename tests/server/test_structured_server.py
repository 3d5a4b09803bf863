"""Structured output through the real server (SmolLM2, float32): every output of 30 JSON schemas
and 20 regexes at temperature 1.0 (5 seeded samples each) validates; the SGLang and vLLM
documentation examples work verbatim; invalid constraints get 400 and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest

from live_server import MODEL, wait_idle
from structured_cases import REGEXES, SCHEMAS

pytestmark = pytest.mark.slow

SAMPLES = 5
JSON_PROMPT = [{"role": "user", "content": "Describe something made up, as a short JSON value."}]


def _generate(server, body: dict) -> dict | list:
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_output_of_30_schemas_and_20_regexes_validates(server, client, async_engine):
    def schema_case(i: int) -> list[tuple[str, str]]:
        # Alternate the two OpenAI spellings; n samples from consecutive seeds.
        extra = ({"guided_json": SCHEMAS[i]} if i % 2 else
                 {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}})
        r = client.chat.completions.create(model=MODEL, messages=JSON_PROMPT, temperature=1.0, seed=1000 + i,
                                           n=SAMPLES, max_tokens=120, extra_body=extra)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    def regex_case(i: int) -> list[tuple[str, str]]:
        out = _generate(server, {"text": "Answer with one short item: ", "sampling_params": {
            "temperature": 1.0, "n": SAMPLES, "sampling_seed": 2000 + i, "max_new_tokens": 60,
            "regex": REGEXES[i]}})
        return [(o["text"], o["meta_info"]["finish_reason"]["type"]) for o in out]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        schema_results = list(pool.map(schema_case, range(len(SCHEMAS))))
        regex_results = list(pool.map(regex_case, range(len(REGEXES))))

    failures = []
    for schema, outputs in zip(SCHEMAS, schema_results):
        assert len(outputs) == SAMPLES
        for text, finish in outputs:
            try:
                assert finish == "stop", finish
                jsonschema.validate(json.loads(text), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                failures.append((schema, text, str(e)[:200]))
    for pattern, outputs in zip(REGEXES, regex_results):
        assert len(outputs) == SAMPLES
        for text, finish in outputs:
            if finish != "stop" or re.fullmatch(pattern, text) is None:
                failures.append((pattern, text, finish))
    assert not failures, failures
    # Not every sample alike: temperature 1.0 explores the grammar.
    assert sum(len({t for t, _ in outs}) > 1 for outs in schema_results + regex_results) >= 25
    wait_idle(async_engine)
    async_engine.engine.check_idle_integrity()


# ---- the documentation examples, verbatim ---------------------------------------------------------
def test_sglang_docs_json_schema(server):
    json_schema = json.dumps({
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[\\w]+$"},
            "population": {"type": "integer"},
        },
        "required": ["name", "population"],
    })
    out = _generate(server, {
        "text": "Here is the information of the capital of France in the JSON format.\n",
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "json_schema": json_schema},
    })
    # SmolLM2-135M, greedy, writes {"name": "Paris", "population": 1111... until max_new_tokens (the
    # schema bounds no digits); what it writes must still follow the schema up to the cut.
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        jsonschema.validate(json.loads(out["text"]), json.loads(json_schema))
    else:
        assert re.fullmatch(r'\{ ?"name" ?: ?"\w+" ?, ?"population" ?: ?-?[0-9]+', out["text"]), out["text"]


def test_sglang_docs_regex(server):
    out = _generate(server, {
        "text": "Paris is the capital of",
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "regex": "(France|England)"},
    })
    assert out["text"] in ("France", "England")


def test_sglang_docs_ebnf(server):
    ebnf_grammar = """
root ::= city | description
city ::= "London" | "Paris" | "Berlin" | "Rome"
description ::= city " is " status
status ::= "the capital of " country
country ::= "England" | "France" | "Germany" | "Italy"
"""
    outs = _generate(server, {
        "text": "Give me the information of the capital of France.",
        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "n": 3, "ebnf": ebnf_grammar},
    })
    city = "(London|Paris|Berlin|Rome)"
    for o in outs:
        assert re.fullmatch(f"{city}( is the capital of (England|France|Germany|Italy))?", o["text"]), o["text"]


def test_vllm_docs_guided_choice(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        extra_body={"guided_choice": ["positive", "negative"]},
    )
    assert completion.choices[0].message.content in ("positive", "negative")


def test_vllm_docs_guided_regex_with_stop(client):
    prompt = ("Generate an example email address for Alan Turing, who works in Enigma."
              "End in .com and new line. Example result:alan.turing@enigma.com\n")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        extra_body={"guided_regex": r"\w+@\w+\.com\n", "stop": ["\n"]},
        # Not in the documented request: SmolLM2-135M fills "\w+" without end at most seeds (3 of
        # seeds 12-29 end it under the sampler's hashed noise; 16 is one).
        seed=16, max_tokens=60,
    )
    choice = completion.choices[0]
    assert re.fullmatch(r"\w+@\w+\.com", choice.message.content), choice.message.content
    assert choice.finish_reason == "stop"


def test_vllm_docs_guided_grammar(client):
    simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Generate an SQL query to show the 'username' and 'email' "
                                              "from the 'users' table."}],
        extra_body={"guided_grammar": simplified_sql_grammar},
    )
    text = completion.choices[0].message.content
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text), text


def test_openai_json_object_and_completions_route(client):
    r = client.chat.completions.create(model=MODEL, messages=JSON_PROMPT, response_format={"type": "json_object"},
                                       temperature=1.0, seed=3, n=3, max_tokens=200)
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # cut by max_tokens: a prefix of an object, still
            assert c.finish_reason == "length" and c.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in r.choices)
    text = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8,
                                     extra_body={"guided_choice": ["A", "B", "C"]}).choices[0].text
    assert text in ("A", "B", "C")


def test_triton_parameters_take_constraints(server):
    r = httpx.post(server.url + f"/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "Is the sky blue? Answer:", "parameters": {"max_tokens": 8, "regex": "(Yes|No)"}})
    # Triton's vLLM backend returns the prompt and the output (exclude_input_in_output: false).
    assert r.status_code == 200 and r.json()["text_output"] in ("Is the sky blue? Answer:Yes",
                                                                 "Is the sky blue? Answer:No")
    r = httpx.post(server.url + f"/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "A number:", "parameters": {"max_tokens": 12, "exclude_input_in_output": True,
                                                  "json_schema": {"type": "integer", "minimum": 1, "maximum": 9}}})
    assert r.status_code == 200 and 1 <= int(r.json()["text_output"]) <= 9
    r = httpx.post(server.url + f"/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "A list:", "parameters": {"max_tokens": 40, "exclude_input_in_output": True, "temperature": 0,
                                                "json_schema": {"type": "array", "items": {"type": "integer"},
                                                                "minItems": 2, "maxItems": 3},
                                                "guided_whitespace_pattern": ""}})
    assert r.status_code == 200 and " " not in r.json()["text_output"] and len(json.loads(r.json()["text_output"])) >= 2


def test_streaming_n2_logprobs_and_stop_with_a_schema(client):
    schema = SCHEMAS[0]
    stream = client.chat.completions.create(model=MODEL, messages=JSON_PROMPT, stream=True, n=2, logprobs=True,
                                            top_logprobs=2, temperature=1.0, seed=9, max_tokens=60,
                                            extra_body={"guided_json": schema})
    texts, logprobs, finish = ["", ""], [0, 0], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            finish[c.index] = c.finish_reason or finish[c.index]
    for text, n_lp, reason in zip(texts, logprobs, finish):
        jsonschema.validate(json.loads(text), schema)
        assert n_lp > 0 and reason == "stop"
    # A stop string still cuts constrained output (the result is then a prefix, as everywhere).
    r = client.chat.completions.create(model=MODEL, messages=JSON_PROMPT, temperature=0, max_tokens=60,
                                       stop=['"age"'], extra_body={"guided_json": schema})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content.startswith("{") and '"age"' not in c.message.content


def test_length_limit_ends_constrained_output_with_length(client):
    r = client.completions.create(model=MODEL, prompt="Digits:", max_tokens=3, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{20}"})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[0-9]+", r.choices[0].text)


def test_json_whitespace_rules(client):
    """vLLM's structured_outputs.disable_any_whitespace (beside OpenAI's response_format, as vLLM
    takes it) gives compact JSON; guided_whitespace_pattern sets what each gap may hold."""
    schema = {"type": "object", "properties": {"count": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 3}},
              "required": ["count", "ok", "tags"]}
    r = client.chat.completions.create(
        model=MODEL, messages=JSON_PROMPT, temperature=1.0, seed=5, n=3, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True, "disable_fallback": True,
                                           "disable_additional_properties": True}})
    for c in r.choices:
        value = json.loads(c.message.content)
        jsonschema.validate(value, schema)
        assert c.finish_reason == "stop" and c.message.content == json.dumps(value, separators=(",", ":"))
    r = client.completions.create(model=MODEL, prompt="A JSON object:", temperature=1.0, seed=6, n=3, max_tokens=80,
                                  extra_body={"guided_json": schema, "guided_whitespace_pattern": "\n  "})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), schema)
        # Outside the strings (enum values without spaces), every gap is empty or a newline and two spaces.
        assert c.finish_reason == "stop" and " " not in c.text.replace("\n  ", ""), c.text


# ---- invalid constraints -------------------------------------------------------------------------
BAD = [
    ("/v1/chat/completions", {"guided_regex": "(abc"}, "guided_regex", "invalid regex"),
    ("/v1/chat/completions", {"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ("/v1/chat/completions", {"guided_json": {"type": "string", "not": {"const": "a"}}}, "guided_json", "not"),
    ("/v1/chat/completions", {"guided_json": {"type": "nope"}}, "guided_json", "invalid JSON schema"),
    ("/v1/chat/completions", {"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/chat/completions", {"guided_json": {}, "guided_regex": "a"}, "guided_regex", "one kind"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ("/v1/completions", {"guided_regex": "(abc"}, "guided_regex", "invalid regex"),
    ("/v1/completions", {"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "applies to JSON output only"),
    ("/v1/completions", {"guided_json": {}, "guided_whitespace_pattern": "[ "}, "guided_whitespace_pattern",
     "invalid regex"),
    ("/v1/chat/completions", {"structured_outputs": {"json_object": True, "whitespace_pattern": " ",
                                                     "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "give one whitespace rule"),
    ("/v1/chat/completions", {"structured_outputs": {"json": {}, "disable_additional_properties": False}},
     "structured_outputs.disable_additional_properties", "additionalProperties"),
    ("/v1/chat/completions", {"structured_outputs": {"json": {}, "disable_fallback": "yes"}},
     "structured_outputs.disable_fallback", "true or false"),
]


@pytest.mark.parametrize("route, extra, param, message", BAD)
def test_invalid_constraints_are_400_and_the_server_keeps_serving(server, route, extra, param, message):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"messages": JSON_PROMPT} if "chat" in route else {"prompt": "Hi"}
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                          "guided_choice": ["a", "b"]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a", "b")


def test_invalid_sglang_and_triton_constraints(server):
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"regex": "a", "json_schema": "{}"}})
    assert r.status_code == 400 and "one kind" in r.json()["error"]["message"]
    r = httpx.post(server.url + f"/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": "Hi", "parameters": {"regex": "(abc"}})
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]
    assert _generate(server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "regex": "(a|b)"}})["text"] in "ab"


# ---- forced tool calls (through the same constraints) --------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def test_named_tool_choice_returns_a_parsed_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=4,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert choice.message.content is None and choice.finish_reason == "stop"
    # Streaming: the official client accumulates the tool_calls delta.
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True, seed=4,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, names, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names.append(tc.function.name)
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and finish == "stop"
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_one_or_more_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=1.0, seed=11, n=3, max_tokens=120)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "no function named"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "must be 'none', 'auto', 'required'"),
    ({"tool_choice": "required", "tools": [WEATHER], "guided_regex": "a"}, "one kind"),
])
def test_bad_tool_choices_are_400(server, extra, message):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


CITY_ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STRUCTURAL_TAG = {"type": "structural_tag", "triggers": ["<function="],
                  "structures": [{"begin": "<function=get_weather>", "schema": CITY_ARGS, "end": "</function>"}]}


def test_structural_tag_binds_what_follows_a_trigger(client, server):
    """vLLM's response_format structural_tag (and SGLang's sampling_params.structural_tag): text
    is free, and the call the model writes after the trigger follows the structure."""
    prompt = ('Q: What is the weather in Rome?\nA: <function=get_weather>{"city": "Rome"}</function>\n'
              'Q: What is the weather in Oslo?\nA: <function=get_weather>{"city": "Oslo"}</function>\n'
              "Q: What is the weather in Paris?\nA:")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["\nQ:"],
                                  extra_body={"response_format": STRUCTURAL_TAG})
    text = r.choices[0].text
    calls = re.findall(r"<function=get_weather>(.*?)</function>", text)
    assert calls, text  # the model called it (the examples lead it there)
    for args in calls:
        jsonschema.validate(json.loads(args), CITY_ARGS)
    assert text.count("<function=") == len(calls)  # every trigger written began a whole structure
    tag = json.dumps({k: v for k, v in STRUCTURAL_TAG.items() if k != "type"})
    sglang = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop": ["\nQ:"], "structural_tag": tag}}, timeout=120).json()
    assert sglang["text"] == text
    # The same call as xgrammar's format tree, "force exactly one tool call", sampled: each output
    # is one whole call and nothing else.
    one_call = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<function=get_weather>",
                  "content": {"type": "json_schema", "json_schema": CITY_ARGS}, "end": "</function>"}]}}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.0, seed=4, n=3,
                                  extra_body={"response_format": one_call})
    for c in r.choices:
        call = re.fullmatch(r"<function=get_weather>(.*)</function>", c.text)
        assert c.finish_reason == "stop" and call, c.text
        jsonschema.validate(json.loads(call.group(1)), CITY_ARGS)
    bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "response_format": {"type": "structural_tag", "format": {
                                                               "type": "token", "token": 5}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.format"
