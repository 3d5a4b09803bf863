"""Composed constraints, walked token by token with the real SmolLM2 vocabulary through the
structured-output compiler: tool calls in each format are free until their trigger and then bound
to the tool's schema; a think block is free and the constraint starts after it; the
reasoning_max_tokens matcher forces </think> at its cap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.server import tool_parsers as T
from jaxserve.structured import compose as C
from jaxserve.structured import spec as S
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.reasoning_cap import ReasoningCapGrammar
from jaxserve.structured.vocabulary import token_vocabulary

EOS = 2
FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}}, "required": ["city"]},
    "noargs": {"type": "object", "properties": {}},
}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(token_vocabulary(smollm2_tokenizer.hf, [EOS]), smollm2_tokenizer.hf, workers=1)
    yield c
    c.close()


def walk(compiler, tokenizer, spec, text: str) -> tuple[bool, bool]:
    """(every token of text was allowed, the grammar accepts there)."""
    m = compiler.get(spec).matcher()
    mask = np.zeros((compiler.vocabulary.size + 31) // 32, np.uint32)
    for t in tokenizer.hf.encode(text, add_special_tokens=False):
        m.fill_mask(mask)
        if not (mask[t >> 5] >> np.uint32(t & 31)) & 1 or not m.advance(t):
            return False, False
    return True, m.is_accepting()


def tools_spec(fmt: str, parallel: bool = True, reasoning: C.Reasoning | None = None) -> S.GuideSpec:
    return C.compose(C.ToolRules(T.FORMATS[fmt].lark(FUNCTIONS, parallel, lambda _: None)), reasoning, "tools")


GOOD_AND_BAD = {
    "hermes": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
               'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noargs", "parameters": {}}',
                    '{"name": "get_time"'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"days": 1}}]'),
    "qwen3_coder": (("ok\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
                    "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree"),
    "pythonic": ('[get_weather(city="Paris", metric=True), noargs()]', "[get_weather(days=3)]"),
}


@pytest.mark.parametrize("fmt", list(GOOD_AND_BAD))
def test_calls_follow_their_schema_and_text_is_free(compiler, smollm2_tokenizer, fmt):
    good, bad = GOOD_AND_BAD[fmt]
    spec = tools_spec(fmt)
    assert walk(compiler, smollm2_tokenizer, spec, good) == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, "Just an answer, no tools.") == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, bad)[0] is False
    # The grammar's calls are what the parser reads.
    _, calls = T.parse(T.FORMATS[fmt], good, FUNCTIONS)
    assert calls and all(c.name in FUNCTIONS for c in calls)


def test_one_call_when_parallel_calls_are_off(compiler, smollm2_tokenizer):
    call = '<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>'
    spec = tools_spec("hermes", parallel=False)
    assert walk(compiler, smollm2_tokenizer, spec, call) == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, call + "\n" + call)[0] is False


def test_a_trigger_inside_the_think_block_is_only_text(compiler, smollm2_tokenizer):
    spec = tools_spec("hermes", reasoning=C.Reasoning(opened=False, may_open=True))
    text = ('<think>maybe <tool_call> with {"bad": json</think>\n\n'
            '<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>')
    assert walk(compiler, smollm2_tokenizer, spec, text) == (True, True)
    bad_after = '<think>x</think>\n\n<tool_call>\n{"name": "nope"'
    assert walk(compiler, smollm2_tokenizer, spec, bad_after)[0] is False


@pytest.mark.parametrize("answer, good, bad", [
    (S.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "rf"),
     '{"a": 5}', '{"b": 5}'),
    # The request's whitespace rule holds after the block too.
    (S.with_whitespace(S.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "rf"), "", "w"),
     '{"a":5}', '{"a": 5}'),
    (S.regex("[0-9]+/x", "guided_regex"), "12/x", "12x"),
    (S.choice(["yes", "no"], "guided_choice"), "no", "maybe"),
    (S.grammar('start: "A" "B"', "guided_grammar"), "AB", "BA"),
])
def test_the_constraint_starts_after_the_think_block(compiler, smollm2_tokenizer, answer, good, bad):
    for reasoning, head in [(C.Reasoning(opened=True, may_open=False), "free {text</think>\n\n"),
                            (C.Reasoning(opened=False, may_open=True), "<think>free {text</think>\n\n")]:
        spec = C.compose(answer, reasoning, answer.param)
        assert walk(compiler, smollm2_tokenizer, spec, head + good) == (True, True)
        assert walk(compiler, smollm2_tokenizer, spec, head + bad)[0] is False
    # Thinking may also be skipped, when the template leaves it to the model (qwen3).
    spec = C.compose(answer, C.Reasoning(opened=False, may_open=True), answer.param)
    assert walk(compiler, smollm2_tokenizer, spec, good) == (True, True)


def test_a_free_answer_may_not_pretend_to_skip_thinking(compiler, smollm2_tokenizer):
    # Otherwise "<think>..." could be read as an answer with no block, and nothing after it bound.
    spec = tools_spec("llama3_json", reasoning=C.Reasoning(opened=False, may_open=True))
    assert walk(compiler, smollm2_tokenizer, spec, '<think>x</think>\n\n{"name": "bad"')[0] is False


def test_reasoning_cap_forces_the_end_of_the_block(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer.hf
    vocabulary = compiler.vocabulary
    end = tok.encode("</think>", add_special_tokens=False)
    mask = np.zeros((vocabulary.size + 31) // 32, np.uint32)

    def allowed(m) -> list[int]:
        m.fill_mask(mask)
        return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()

    for opened, head in [(True, ""), (False, "<think>")]:
        m = ReasoningCapGrammar(None, vocabulary.tokens, end, 4, opened, vocabulary.size).matcher()
        for t in tok.encode(head + " one two three four five", add_special_tokens=False)[:len(tok.encode(head)) + 4]:
            assert len(allowed(m)) == vocabulary.size  # free until the cap
            assert m.advance(t)
        for t in end:  # then only </think>, one token at a time, and no EOS until it is out
            assert allowed(m) == [t] and not m.is_accepting()
            assert m.advance(t)
        assert len(allowed(m)) == vocabulary.size and m.is_accepting()
    # A block the model closes itself is never forced; an answer without a block is never counted.
    m = ReasoningCapGrammar(None, vocabulary.tokens, end, 4, False, vocabulary.size).matcher()
    for t in tok.encode("<think>a</think> b c d e f g", add_special_tokens=False):
        assert len(allowed(m)) == vocabulary.size and m.advance(t)
    m = ReasoningCapGrammar(None, vocabulary.tokens, end, 2, False, vocabulary.size).matcher()
    for t in tok.encode("plain answer, long enough to pass any cap", add_special_tokens=False):
        assert len(allowed(m)) == vocabulary.size and m.advance(t)


def test_reasoning_cap_wraps_a_constraint(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer.hf
    vocabulary = compiler.vocabulary
    end = tok.encode("</think>", add_special_tokens=False)
    answer = S.choice(["yes", "no"], "guided_choice")
    inner = compiler.get(C.compose(answer, C.Reasoning(opened=True, may_open=False), "guided_choice"))
    m = ReasoningCapGrammar(inner, vocabulary.tokens, end, 3, True, vocabulary.size).matcher()
    for t in tok.encode("a b c", add_special_tokens=False) + end + tok.encode("\n\nyes", add_special_tokens=False):
        assert m.advance(t)
    assert m.is_accepting()


@pytest.mark.parametrize("v11", [False, True], ids=["v3-list", "v11-args"])
def test_special_token_triggers(compiler, smollm2_tokenizer, v11):
    """Mistral's [TOOL_CALLS] (and v11's [ARGS]) are special tokens, never text: the grammar names
    them by id. SmolLM2's <|im_start|> (1) and <repo_name> (3) stand in for them here."""
    tok = smollm2_tokenizer.hf
    ids = {"[TOOL_CALLS]": 1, "[ARGS]": 3 if v11 else None}
    spec = C.compose(C.ToolRules(T.FORMATS["mistral"].lark(FUNCTIONS, True, ids.get)), None, "tools")
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    if v11:
        good = enc("Sure.") + [1] + enc("get_weather") + [3] + enc('{"city": "Rome"}') + [1] + enc("noargs") + [3] + enc("{}")
        bad = enc("Sure.") + [1] + enc("get_weather") + [3] + enc('{"days": 2}')
    else:
        good = enc("Sure.") + [1] + enc(' [{"name": "noargs", "arguments": {}}]')
        bad = enc("Sure.") + [1] + enc(' [{"name": "get_weather", "arguments": {}}]')
    m = compiler.get(spec).matcher()
    assert all(m.advance(t) for t in good) and m.is_accepting()
    m = compiler.get(spec).matcher()
    assert not all(m.advance(t) for t in bad)


@pytest.mark.parametrize("fmt, call", [
    ("hermes", '<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "noargs", "parameters": {}}'),
    ("pythonic", "[noargs()]"),
    ("qwen3_coder", "<tool_call>\n<function=noargs>\n</function>\n</tool_call>"),
])
def test_calls_or_the_answer_format(compiler, smollm2_tokenizer, fmt, call):
    """tool_choice auto with response_format: the answer is tool calls, or the format; no free text."""
    answer = S.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "rf")
    rules = C.ToolRules(T.FORMATS[fmt].lark(FUNCTIONS, True, lambda _: None, text=False), answer,
                        T.FORMATS[fmt].json_calls(FUNCTIONS))
    spec = C.compose(rules, None, "rf")
    assert walk(compiler, smollm2_tokenizer, spec, call) == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, '{"a": 7}') == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, "free text")[0] is False
    assert walk(compiler, smollm2_tokenizer, spec, '{"b": 7}')[0] is False
    content, calls = T.parse(T.FORMATS[fmt], '{"a": 7}', FUNCTIONS)
    assert content == '{"a": 7}' and calls == []


def test_qwen3_coder_string_parameters(compiler, smollm2_tokenizer):
    """Bare text for plain strings and enums (one of the enum's values), JSON for constrained
    strings; what the grammar lets through, the parser reads back as the same string."""
    fns = {"f": {"type": "object", "properties": {"u": {"type": "string", "enum": ["c", "f"]},
                                                  "code": {"type": "string", "maxLength": 3}},
                 "required": ["u", "code"]}}
    spec = C.compose(C.ToolRules(T.FORMATS["qwen3_coder"].lark(fns, True, lambda _: None)), None, "tools")
    head = "<tool_call>\n<function=f>\n<parameter=u>\n"
    good = head + 'c\n</parameter>\n<parameter=code>\n"XY"\n</parameter>\n</function>\n</tool_call>'
    assert walk(compiler, smollm2_tokenizer, spec, good) == (True, True)
    assert walk(compiler, smollm2_tokenizer, spec, head + '"c"')[0] is False
    assert walk(compiler, smollm2_tokenizer, spec, head + "k")[0] is False
    assert walk(compiler, smollm2_tokenizer, spec, good.replace('"XY"', '"WXYZ"'))[0] is False
    _, calls = T.parse(T.FORMATS["qwen3_coder"], good, fns)
    assert [c.arguments for c in calls] == ['{"u": "c", "code": "XY"}']


# vLLM's example of a structural tag: calls written as <function=NAME>{args}</function> in free text.
TAG = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": "<function=get_weather>", "schema": FUNCTIONS["get_weather"], "end": "</function>"},
                      {"begin": "<function=noargs>", "schema": FUNCTIONS["noargs"], "end": "</function>"}]}


@pytest.mark.parametrize("text, allowed, accepting", [
    ("Let me check.", True, True),
    ('Let me check. <function=get_weather>{"city": "Paris"}</function> Done.', True, True),
    ('<function=noargs>{}</function><function=get_weather>{"city": "Rome", "days": 2}</function>', True, True),
    ('Checking <function=get_weather>{"city": "Paris"', True, False),  # inside a structure: not yet complete
    ('Checking <function=get_time>{}</function>', False, False),  # no structure begins so
    ('Checking <function=get_weather>{"town": "Paris"}</function>', False, False),  # the schema binds
    ('<function=get_weather>{"city": "Paris"} and more', False, False),  # the end must follow the JSON
])
def test_structural_tags_bind_only_after_a_trigger(compiler, smollm2_tokenizer, text, allowed, accepting):
    spec = S.structural_tag(TAG, "response_format")
    ok, accepts = walk(compiler, smollm2_tokenizer, spec, text)
    assert (ok, accepts) == (allowed, accepting)


@pytest.mark.parametrize("bad, message", [
    ({"triggers": [], "structures": TAG["structures"]}, "triggers: expected a non-empty list"),
    ({"triggers": ["<tool>"], "structures": TAG["structures"]}, "starts with none of the triggers"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "nope"}, "end": ""}]},
     "invalid JSON schema"),
    ("{not json", "not valid JSON"),
])
def test_bad_structural_tags_are_refused_naming_why(bad, message):
    with pytest.raises(S.GuideError, match=message):
        S.structural_tag(bad, "response_format")


# xgrammar's format tree (vLLM's response_format {"type": "structural_tag", "format": ...}).
def _tag(begin, content, end):
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _const(value):
    return {"type": "const_string", "value": value}


WEATHER_CALL = _tag("<function=get_weather>", {"type": "json_schema", "json_schema": FUNCTIONS["get_weather"]},
                    "</function>")
NOARGS_CALL = _tag("<function=noargs>", {"type": "json_schema", "json_schema": FUNCTIONS["noargs"]}, "</function>")
CALLS = {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER_CALL, NOARGS_CALL]}
FORMATS = {
    # xgrammar's recipe "mix reasoning, free text and tool calls"
    "think_then_calls": {"type": "sequence", "elements": [_tag("<think>", {"type": "any_text"}, "</think>"), CALLS]},
    # "force exactly one tool call"
    "one_call": {**CALLS, "at_least_one": True, "stop_after_first": True},
    "at_least_one": {**CALLS, "at_least_one": True},
    "items": {"type": "tags_with_separator", "separator": ",",
              "tags": [_tag("<item>", {"type": "json_schema", "json_schema": {"type": "object"}}, "</item>")]},
    "pieces": {"type": "sequence", "elements": [
        _const("Code: "), {"type": "regex", "pattern": "[A-Z]{3}"}, {"type": "optional", "content": _const("!")},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "or", "elements": [_const("a"), _const("b")]}}]},
    "sql": _tag("<sql>", {"type": "grammar", "grammar": 'root ::= "SELECT " [a-z]+'}, ["</sql>", "</q>"]),
    "excludes": {"type": "any_text", "excludes": ["BAD"]},
    "one_in_tag": _tag("<r>", {**CALLS, "stop_after_first": True}, "</r>"),
    # Alternatives and options ending where the output or their tag does.
    "or_at_end": {"type": "or", "elements": [_const("none"), {"type": "any_text", "excludes": ["x"]}]},
    "optional_in_tag": _tag("<r>", {"type": "optional", "content": {"type": "any_text"}}, "</r>"),
    "or_in_tag": _tag("<r>", {"type": "or", "elements": [_const("A"), {"type": "any_text", "excludes": ["B"]}]},
                      "</r>"),
}


@pytest.mark.parametrize("fmt, text, allowed, accepting", [
    ("think_then_calls", '<think>hmm, weather</think>Sure. <function=get_weather>{"city": "Paris"}</function> ok',
     True, True),
    ("think_then_calls", "<think>hmm</think>No calls needed.", True, True),
    ("think_then_calls", "<think>a <function=x> inside thinking is text</think>", True, True),
    ("think_then_calls", "No thinking first", False, False),
    ("think_then_calls", "<think>a</think>x <function=get_time>{}</function>", False, False),
    ("one_call", '<function=get_weather>{"city": "Paris"}</function>', True, True),
    ("one_call", '<function=noargs>{}</function> and more', False, False),
    ("one_call", 'Sure <function=noargs>{}</function>', False, False),
    ("at_least_one", '<function=noargs>{}</function> then text <function=noargs>{}</function>', True, True),
    ("at_least_one", "text first", False, False),
    ("items", '<item>{"a": 1}</item>,<item>{}</item>', True, True),
    ("items", "", True, True),
    ("items", '<item>{}</item><item>{}</item>', False, False),
    ("pieces", "Code: ABC!ab", True, True),
    ("pieces", "Code: XYZb", True, True),
    ("pieces", "Code: ABCabb", False, False),
    ("pieces", "Code: AB", True, False),
    ("sql", "<sql>SELECT name</q>", True, True),
    ("sql", "<sql>DROP</sql>", False, False),
    ("excludes", "fine text", True, True),
    ("excludes", "this is BAD", False, False),
    ("one_in_tag", "<r>hi <function=noargs>{}</function></r>", True, True),
    ("one_in_tag", "<r>just text</r>", True, True),
    ("one_in_tag", "<r>hi <function=noargs>{}</function> more</r>", False, False),
    ("one_in_tag", "<r>text</r> after the tag", False, False),
    ("or_at_end", "none", True, True),
    ("or_at_end", "any words", True, True),
    ("or_at_end", "an x", False, False),
    ("optional_in_tag", "<r></r>", True, True),
    ("optional_in_tag", "<r>free</r>", True, True),
    ("optional_in_tag", "<r>free</r>more", False, False),
    ("or_in_tag", "<r>A</r>", True, True),
    ("or_in_tag", "<r>zz</r>", True, True),
    ("or_in_tag", "<r>zBz</r>", False, False),
])
def test_structural_tag_formats_bind_as_xgrammar_says(compiler, smollm2_tokenizer, fmt, text, allowed, accepting):
    spec = S.structural_tag({"type": "structural_tag", "format": FORMATS[fmt]}, "response_format")
    assert walk(compiler, smollm2_tokenizer, spec, text) == (allowed, accepting)


def test_a_reasoning_answer_may_not_open_a_think_block_outside_a_tag(compiler, smollm2_tokenizer):
    """Under a reasoning model that may open its own think block, a structural tag's free text
    outside its tags cannot start with <think> (that would be a second, unconstrained reading of
    the block); inside a tag it may."""
    fmt = {"type": "sequence", "elements": [_const("A:"), _tag("<r>", {"type": "any_text"}, "</r>")]}
    spec = C.compose(S.structural_tag({"format": fmt}, "rf"), C.Reasoning(opened=False, may_open=True), "rf")
    assert walk(compiler, smollm2_tokenizer, spec, "<think>hm</think>A:<r><think>x</r>") == (True, True)
    free = C.compose(S.structural_tag({"format": CALLS}, "rf"), C.Reasoning(opened=False, may_open=True), "rf")
    assert walk(compiler, smollm2_tokenizer, free, "<think>hm</think>plain") == (True, True)
    assert walk(compiler, smollm2_tokenizer, free, "<think>never closed") == (True, False)


def test_the_first_form_is_a_triggered_tags_format():
    first = S.structural_tag(TAG, "response_format")
    tags = [_tag(s["begin"], {"type": "json_schema", "json_schema": s["schema"]}, [s["end"]])
            for s in TAG["structures"]]
    assert json.loads(first.text) == {"format": {"type": "triggered_tags", "triggers": ["<function="], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": False, "excludes": []}}


@pytest.mark.parametrize("fmt, param, message", [
    ({"type": "token", "token": 1}, "response_format.format", "'token' format is not supported yet"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, _const("x")]}, "response_format.format.elements[0]",
     "any_text has no end of its own"),
    ({"type": "sequence", "elements": [{"type": "or", "elements": [CALLS, _const("x")]}, _const("y")]},
     "response_format.format.elements[0].elements[0]", "triggered_tags has no end"),
    ({"type": "star", "content": {"type": "any_text"}}, "response_format.format.content", "any_text has no end"),
    ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "response_format.format.style", 'only "json"'),
    ({"type": "repeat", "min": 3, "max": 2, "content": _const("a")}, "response_format.format", "min and max"),
    (_tag("<a>", {"type": "any_text", "max_tokens": 5}, "</a>"), "response_format.format.content.max_tokens",
     "not supported yet"),
    ({**CALLS, "tags": [_tag("<g>", _const("x"), "</g>")]}, "response_format.format.tags[0].begin",
     "starts with none of the triggers"),
    ({"type": "nope"}, "response_format.format", "unknown format type 'nope'"),
    ({"type": "tag", "begin": "<a>", "content": _const("x")}, "response_format.format", "missing \\['end'\\]"),
    ({"type": "regex", "pattern": "(a"}, "response_format.format.pattern", "invalid regex"),
    (_tag("<a>", {"type": "any_text"}, ""), "response_format.format.content", "any_text has no end"),
])
def test_bad_structural_tag_formats_name_where(fmt, param, message):
    with pytest.raises(S.GuideError, match=message) as e:
        S.structural_tag({"type": "structural_tag", "format": fmt}, "response_format")
    assert e.value.param == param
