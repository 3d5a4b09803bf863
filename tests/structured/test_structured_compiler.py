"""Structured output on the host: token bytes, spec checks, compiling within budgets, the LRU,
and the matchers' masks (real SmolLM2 vocabulary, real outlines-core and llguidance)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxserve.structured import spec as S
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.matcher import LLGuidanceGrammar, OutlinesGrammar
from jaxserve.structured.spec import GuideError
from jaxserve.structured.vocabulary import token_vocabulary

EOS = 2  # <|im_end|>, SmolLM2-Instruct's end of turn


@pytest.fixture(scope="module")
def vocab(smollm2_tokenizer):
    return token_vocabulary(smollm2_tokenizer.hf, [EOS])


@pytest.fixture(scope="module")
def compiler(vocab, smollm2_tokenizer):
    c = GrammarCompiler(vocab, smollm2_tokenizer.hf, timeout_s=20.0, workers=2)
    yield c
    c.close()


def allowed(matcher, size: int) -> set[int]:
    mask = np.full((size + 31) // 32, 0xFFFFFFFF, np.uint32)  # stale bits must be overwritten
    matcher.fill_mask(mask)
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


def walk(matcher, tokenizer, text: str) -> None:
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.advance(t), (text, t)


# ---- vocabulary ---------------------------------------------------------------------------------
def test_token_bytes_decode_like_the_tokenizer(vocab, smollm2_tokenizer):
    hf = smollm2_tokenizer.hf
    assert vocab.size == len(hf)
    checked = 0
    for i, b in enumerate(vocab.tokens):
        if b is None:
            assert i in smollm2_tokenizer.special_ids
            continue
        try:
            text = b.decode()
        except UnicodeDecodeError:
            continue  # a partial UTF-8 sequence: only meaningful next to its neighbours
        assert hf.decode([i]) == text, i
        checked += 1
    assert checked > 45_000
    assert vocab.tokens[hf.convert_tokens_to_ids("Ġthe")] == b" the"
    assert vocab.tokens[EOS] is None  # special tokens never appear inside a match


def test_fingerprint_depends_on_eos(smollm2_tokenizer, vocab):
    assert token_vocabulary(smollm2_tokenizer.hf, [0, EOS]).fingerprint != vocab.fingerprint


# ---- spec checks --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, value, message", [
    (S.regex, "", "non-empty string"),
    (S.regex, 5, "non-empty string"),
    (S.choice, [], "non-empty list"),
    (S.choice, ["a", ""], "non-empty list"),
    (S.choice, "yes", "non-empty list"),
    (S.json_schema, "{not json", "not valid JSON"),
    (S.json_schema, "[1, 2]", "must be an object"),
    (S.json_schema, {"type": 5}, "invalid JSON schema at type"),
    (S.json_schema, {"properties": {"a": {"minLength": -1}}}, "invalid JSON schema at properties/a/minLength"),
    (S.grammar, None, "non-empty string"),
])
def test_bad_specs_name_parameter_and_reason(make, value, message):
    with pytest.raises(GuideError, match=message) as e:
        make(value, "p")
    assert e.value.param == "p"


def test_one_kind_per_request():
    with pytest.raises(GuideError, match="one kind of structured output per request, got guided_json and guided_regex"):
        S.only_one([S.json_schema({}, "guided_json"), None, S.regex("a", "guided_regex")])
    assert S.only_one([None, S.regex("a", "r")]).kind == "regex"
    assert S.only_one([None]) is None


def test_choice_regex_escapes_metacharacters(compiler, smollm2_tokenizer, vocab):
    grammar = compiler.get(S.choice(["a+b", "(c)", "d.e?"], "c"))
    m = grammar.matcher()
    walk(m, smollm2_tokenizer, "(c)")
    assert m.is_accepting()
    m = grammar.matcher()
    walk(m, smollm2_tokenizer, "a")
    assert not m.advance(smollm2_tokenizer.encode("a", add_special_tokens=False)[0])  # "aa" is no choice


def test_schema_routing(compiler):
    simple = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}
    assert isinstance(compiler.get(S.json_schema(simple, "s")), OutlinesGrammar)
    ranged = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    assert isinstance(compiler.get(S.json_schema(ranged, "s")), LLGuidanceGrammar)  # outlines ignores ranges
    assert isinstance(compiler.get(S.json_object("response_format")), LLGuidanceGrammar)
    # Non-recursive references stay with outlines-core; a schema that refers to itself does not.
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}}, "required": ["v", "kids"]}
    pt = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    assert isinstance(compiler.get(S.json_schema({"$defs": {"pt": pt}, "type": "object", "properties": {
        "a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}}, "s")), OutlinesGrammar)
    for recursive in ({"$defs": {"node": node}, "$ref": "#/$defs/node"},
                      {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
                      {"$defs": {"a": {"type": "array", "items": {"$ref": "#/definitions/b"}}},
                       "definitions": {"b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                       "$ref": "#/$defs/a"}):
        assert S.recursive_refs(recursive) and not S.outlines_honours(recursive)
        assert isinstance(compiler.get(S.json_schema(recursive, "s")), LLGuidanceGrammar)
    # outlines-core puts a pattern, and its email and uri regexes, between the quotes unescaped
    for string in ({"type": "string", "pattern": "^[^@]+$"}, {"type": "string", "format": "uri"},
                   {"type": "string", "format": "email"}):
        schema = {"type": "object", "properties": {"x": string}, "required": ["x"]}
        assert isinstance(compiler.get(S.json_schema(schema, "s")), LLGuidanceGrammar)


@pytest.mark.parametrize("make, value, message", [
    (S.regex, "(abc", "invalid regex: missing \\), unterminated subpattern"),
    (S.json_schema, {"not": {"type": "string"}}, 'unsupported or invalid JSON schema: .*"not"'),
    (S.json_schema, {"type": "array", "uniqueItems": True}, "uniqueItems"),
    (S.grammar, "start: foo", 'invalid grammar: .*unknown name: "foo"'),
    (S.grammar, "root ::= (", "invalid grammar"),
])
def test_compile_errors_are_guide_errors(compiler, make, value, message):
    with pytest.raises(GuideError, match=message):
        compiler.get(make(value, "p"))
    assert compiler.get(S.regex("[0-9]+", "p")) is not None  # still serving


# ---- budgets and cache --------------------------------------------------------------------------
SLOW_SCHEMA = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40} for i in range(12)},
               "required": [f"k{i}" for i in range(12)]}


def test_time_budget_kills_the_compile_and_the_next_one_works(vocab, smollm2_tokenizer):
    c = GrammarCompiler(vocab, smollm2_tokenizer.hf, timeout_s=0.05, workers=1)
    try:
        with pytest.raises(GuideError, match="longer than the 0.05s budget"):
            c.get(S.json_schema(SLOW_SCHEMA, "guided_json"))
        assert c.stats["timeouts"] == 1
        c.timeout_s = 20.0
        assert c.get(S.regex("(yes|no)", "r")) is not None  # a fresh worker took over
    finally:
        c.close()


def test_size_budget(vocab, smollm2_tokenizer):
    c = GrammarCompiler(vocab, smollm2_tokenizer.hf, max_index_bytes=1000, workers=1)
    try:
        with pytest.raises(GuideError, match="over the 0 MiB budget"):
            c.get(S.regex("[a-z]{1,30}", "guided_regex"))
    finally:
        c.close()


def test_lru_and_shared_compiles(vocab, smollm2_tokenizer):
    c = GrammarCompiler(vocab, smollm2_tokenizer.hf, cache_entries=2, workers=2)
    try:
        spec = S.regex("[a-c]{2,4}", "r")
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.get(spec))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(g) for g in results}) == 1 and c.stats["compiled"] == 1  # compiled once
        assert c.cached(spec) is results[0]
        c.get(S.regex("x", "r"))
        c.get(S.regex("y", "r"))  # the third entry evicts the least recently used
        assert c.cached(spec) is None
    finally:
        c.close()


# ---- matchers -------------------------------------------------------------------------------------
def _takes(matcher, tokenizer, text: str) -> bool:
    """Whether the matcher takes every token of `text` and then may end."""
    return all(matcher.advance(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_schemas_the_audit_broke_keep_their_outputs_valid(compiler, smollm2_tokenizer):
    """Outputs the server returned with finish_reason "stop" (black-box audit, twenty-fourth
    session) are refused now, and valid ones still taken."""
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
        "required": ["v", "kids"], "additionalProperties": False}
    tree = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    uri = {"type": "object", "properties": {"x": {"type": "string", "format": "uri"}}, "required": ["x"],
           "additionalProperties": False}
    pattern = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^[^@]+$"}}, "required": ["x"],
               "additionalProperties": False}
    cases = [
        (tree, '{"v": 1, "kids": [{"v": 2, "kids": []}]}',
         '{ "v": 1, "kids": [{ "v": 1, "kids": [{ "v": 1, "kids": [{ "v": 1, } ] } ]} ]}'),
        (uri, '{"x": "https://example.com/a"}', '{"x": "https://example.com/a","y":"b"}'),
        (uri, '{"x": "https://example.com/a"}', '{"x": "https://a.com/""}'),
        (pattern, '{"x": "world"}', '{"x":"world","y":"c"}'),
    ]
    for schema, good, bad in cases:
        grammar = compiler.get(S.json_schema(schema, "guided_json"))
        assert _takes(grammar.matcher(), smollm2_tokenizer, good), (schema, good)
        assert not _takes(grammar.matcher(), smollm2_tokenizer, bad), (schema, bad)


def test_outlines_matcher_allows_eos_only_on_a_full_match(compiler, smollm2_tokenizer, vocab):
    m = compiler.get(S.regex("(France|England)", "regex")).matcher()
    first = allowed(m, vocab.size)
    assert EOS not in first
    assert {smollm2_tokenizer.decode([t]) for t in first} >= {"France", "England"}
    walk(m, smollm2_tokenizer, "France")
    assert m.is_accepting() and allowed(m, vocab.size) == {EOS}
    assert m.advance(EOS)


def test_mask_wider_than_the_vocabulary_stays_closed(compiler, vocab):
    """Models whose embedding has padding rows past the tokenizer's vocabulary."""
    for spec in (S.regex("[0-9]+", "r"), S.grammar('start: "a"+', "g")):
        m = compiler.get(spec).matcher()
        mask = np.full((vocab.size + 64 + 31) // 32, 0xFFFFFFFF, np.uint32)
        m.fill_mask(mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        assert not bits[vocab.size:].any()


def test_llguidance_grammar_matcher(compiler, smollm2_tokenizer, vocab):
    g = compiler.get(S.grammar('start: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/', "guided_grammar"))
    m = g.matcher()
    assert EOS not in allowed(m, vocab.size)
    walk(m, smollm2_tokenizer, "12+7")
    assert m.is_accepting() and EOS in allowed(m, vocab.size)
    assert not m.advance(smollm2_tokenizer.encode("x", add_special_tokens=False)[0])
    assert m.error() is not None


def test_gbnf_grammar_is_translated(compiler, smollm2_tokenizer):
    m = compiler.get(S.grammar('root ::= "yes" | "no"', "sampling_params.ebnf")).matcher()
    walk(m, smollm2_tokenizer, "no")
    assert m.is_accepting()


def test_cache_hit_never_goes_back_to_a_worker(compiler):
    spec = S.json_schema({"type": "object", "properties": {"x": {"type": "boolean"}}}, "s")
    first = compiler.get(spec)
    before = compiler.stats["compiled"]
    assert compiler.get(spec) is first and compiler.cached(spec) is first
    assert compiler.stats["compiled"] == before


def test_objects_with_listed_properties_get_no_invented_ones():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "$defs": {"x": {"properties": {"y": {}}, "additionalProperties": True}},
              "anyOf": [{"properties": {"z": {}}}], "patternProperties": {"^p": {"type": "integer"}}}
    closed = S.close_objects(schema)
    assert "additionalProperties" not in closed  # patternProperties speak for the others
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["x"]["additionalProperties"] is True  # what the user said stands
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]  # a copy


def test_json_whitespace_rules_bind_both_engines(compiler, smollm2_tokenizer):
    """vLLM's whitespace_pattern / disable_any_whitespace: "" is compact JSON, a regex is what may
    stand around JSON's punctuation; on the outlines-core route and the llguidance one alike (the
    server's own layout, one space after each separator, otherwise)."""
    listed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
        "type": "integer"}}}, "required": ["a", "b"]}
    ranged = {**listed, "properties": {**listed["properties"], "a": {"type": "integer", "minimum": 0}}}
    texts = ['{"a":1,"b":[1,2]}', '{"a": 1, "b": [1, 2]}', '{\n  "a": 1,\n  "b": []\n}']
    for schema, engine in ((listed, OutlinesGrammar), (ranged, LLGuidanceGrammar)):
        spec = S.json_schema(schema, "s")
        for whitespace, takes in ((None, [engine is OutlinesGrammar, True, False]), ("", [True, False, False]),
                                  ("[\\n ]*", [True, True, True]), ("\\n  | ", [True, True, False])):
            grammar = compiler.get(spec if whitespace is None else S.with_whitespace(spec, whitespace, "w"))
            assert isinstance(grammar, engine)
            assert [_takes(grammar.matcher(), smollm2_tokenizer, t) for t in texts] == takes, (engine, whitespace)
    # The alternation stays inside its group: each gap is empty, one space, or a newline and two
    # spaces (vLLM's outlines backend asks the pattern of every gap; llguidance lets a gap be empty).
    for schema in (listed, ranged):
        grammar = compiler.get(S.with_whitespace(S.json_schema(schema, "s"), "\\n  | ", "w"))
        assert _takes(grammar.matcher(), smollm2_tokenizer, '{ "a" :\n  1 , "b" : [ 1 ] }')
        assert not _takes(grammar.matcher(), smollm2_tokenizer, '{ "a" :\n   1 , "b" : [ 1 ] }')
    compact = compiler.get(S.with_whitespace(S.json_object("response_format"), "", "w"))
    assert _takes(compact.matcher(), smollm2_tokenizer, '{"x":[1,{"y":null}]}')
    assert not _takes(compact.matcher(), smollm2_tokenizer, '{"x": 1}')


@pytest.mark.parametrize("spec, whitespace, message", [
    (S.regex("a+", "guided_regex"), "", "applies to JSON output only .* guided_regex"),
    (None, " ", "no structured output"),
    (S.json_object("j"), "(", "invalid regex"),
    (S.json_object("j"), 3, "expected a regex"),
])
def test_bad_whitespace_rules_name_their_parameter(spec, whitespace, message):
    with pytest.raises(GuideError, match=message) as e:
        S.with_whitespace(spec, whitespace, "guided_whitespace_pattern")
    assert e.value.param == "guided_whitespace_pattern"
