"""What a request asks its output to match, checked at the boundary.

A `GuideSpec` is the user's constraint in a canonical text form (a regex, a JSON schema, a list of
choices, a grammar); `compiler.GrammarCompiler` turns it into something that masks tokens. Every
problem a user can fix is raised here or by the compiler as `GuideError`, which the API layers
answer with 400 naming the parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from jaxserve.errors import InvalidRequestError

KINDS = ("regex", "choice", "json_schema", "json_object", "grammar", "structural_tag", "llguidance")
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of regex / schema / grammar text


class GuideError(InvalidRequestError):
    """The constraint is invalid, unsupported, or too expensive to compile."""


@dataclasses.dataclass(frozen=True)
class GuideSpec:
    kind: str  # one of KINDS
    # regex | schema JSON | choices JSON list | grammar source ("" for json_object) | an llguidance
    # TopLevelGrammar JSON built by the server (jaxserve.structured.compose), never by a user
    text: str
    param: str  # the request parameter it came from (named in errors)
    # JSON kinds only: a regex for the whitespace each gap around JSON's punctuation may hold
    # (or nothing; "": compact JSON); None: the server's layout (see json_layout). Set by
    # with_whitespace.
    whitespace: str | None = None

    def cache_key(self, vocabulary_fingerprint: str) -> str:
        h = hashlib.sha256()
        parts = (self.kind, self.text, vocabulary_fingerprint) + (() if self.whitespace is None else (self.whitespace,))
        for part in parts:
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()


# The server's JSON layout: `{"a": 1, "b": [1, 2]}`, one space after each separator and nowhere
# else. Flexible whitespace would let a sampled model pad forever (and at temperature 1 it does);
# fixed separators keep every output finite.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_WHITESPACE_CHARS = 256


def json_layout(whitespace: str | None) -> dict[str, Any]:
    """llguidance's JSON options (x-guidance) for a spec's `whitespace`."""
    return dict(JSON_LAYOUT) if whitespace is None else {"whitespace_pattern": whitespace}


def with_whitespace(spec: GuideSpec | None, whitespace: Any, param: str) -> GuideSpec | None:
    """`spec` with its JSON whitespace set: vLLM's guided_whitespace_pattern and
    structured_outputs.whitespace_pattern (a regex, "" for none) or disable_any_whitespace ("").
    400 when the request's constraint is not JSON (nothing to apply it to) or the regex is bad."""
    if whitespace is None:
        return spec
    if spec is None or spec.kind not in ("json_schema", "json_object"):
        raise GuideError(param, "applies to JSON output only (a JSON schema or json_object); this request has "
                         + ("no structured output" if spec is None else f"{spec.param}"))
    if not isinstance(whitespace, str) or len(whitespace) > MAX_WHITESPACE_CHARS:
        raise GuideError(param, f"expected a regex of at most {MAX_WHITESPACE_CHARS} characters")
    import re

    try:  # both engines' regex dialects are Rust's; Python's catches what a user gets wrong
        re.compile(whitespace)
    except re.error as e:
        raise GuideError(param, f"invalid regex: {e}") from None
    return dataclasses.replace(spec, whitespace=whitespace)


def regex(value: Any, param: str) -> GuideSpec:
    return GuideSpec("regex", _text(value, param), param)


def choice(value: Any, param: str) -> GuideSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise GuideError(param, "expected a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise GuideError(param, f"at most {MAX_CHOICES} choices, got {len(value)}")
    return GuideSpec("choice", json.dumps(value), param)


def json_schema(value: Any, param: str) -> GuideSpec:
    """A schema given as an object or as JSON text; checked against the JSON Schema meta-schema."""
    value = _loaded(value, param, "the schema")
    if not isinstance(value, dict):
        raise GuideError(param, f"a JSON schema must be an object, got {type(value).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GuideError(param, f"invalid JSON schema at {where}: {e.message}") from None
    return GuideSpec("json_schema", json.dumps(value), param)


def json_object(param: str) -> GuideSpec:
    return GuideSpec("json_object", "", param)


def grammar(value: Any, param: str) -> GuideSpec:
    return GuideSpec("grammar", _text(value, param), param)


def structural_tag(value: Any, param: str) -> GuideSpec:
    """vLLM's and SGLang's structural tag (xgrammar's): free text with structures after triggers,
    `{"structures": [{begin, schema, end}], "triggers"}`, or a format tree, `{"format": {...}}`
    (jaxserve.structured.structural_tags). Given as an object or as JSON text (SGLang's
    sampling_params.structural_tag); canonical text {"format": ...}."""
    from jaxserve.structured import structural_tags

    value = _loaded(value, param, "the structural tag")
    if not isinstance(value, dict):
        raise GuideError(param, "expected an object with a format, or with structures and triggers")
    return GuideSpec("structural_tag", json.dumps(structural_tags.check(value, param)), param)


def as_lark(grammar: str, param: str) -> str:
    """A user's grammar as Lark for llguidance: GBNF (llama.cpp's, SGLang's ebnf) translated, Lark
    passed through; GuideError naming `param` when it is neither."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as e:
        raise GuideError(param, f"invalid grammar: {' '.join(str(e).split())}") from None


def _loaded(value: Any, param: str, what: str) -> Any:
    """A constraint given as an object, or as JSON text (SGLang sends its schemas and tags so)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(_text(value, param))
    except json.JSONDecodeError as e:
        raise GuideError(param, f"{what} is not valid JSON: {e}") from None


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise GuideError(param, "expected a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise GuideError(param, f"at most {MAX_SPEC_CHARS} characters, got {len(value)}")
    return value


def only_one(specs: list[GuideSpec | None]) -> GuideSpec | None:
    """Requests may carry one constraint; two at once are ambiguous and refused."""
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        names = " and ".join(s.param for s in given)
        raise GuideError(given[1].param, f"give one kind of structured output per request, got {names}")
    return given[0] if given else None


# ---- which engine honours a schema ---------------------------------------------------------------

# Keywords outlines-core turns into its regex, faithfully. Anything else it would silently ignore
# (minimum, multipleOf, uniqueItems, ...), so such schemas go to llguidance, which enforces more
# and reports what it cannot. Not `pattern`: outlines-core (0.2) splices the pattern between the
# string's quotes as it is, so a pattern that admits `"` or `\` (`^[^@]+$`) let the model close
# the string early and write keys the schema forbids, or no JSON at all.
OUTLINES_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "format", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
})
# Formats whose outlines-core regex cannot contain `"` or `\` (its email and uri regexes can,
# with the same escape as a pattern's).
OUTLINES_FORMATS = frozenset({"date", "date-time", "time", "uuid"})
ANNOTATIONS = frozenset({
    "title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
    "readOnly", "writeOnly",
})
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def schema_keywords(schema: Any) -> set[str]:
    """Every keyword used anywhere in the schema (annotations left out)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key in ANNOTATIONS:
                continue
            found.add(key if key != "format" else f"format:{value}")
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    walk(sub)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                for sub in value:
                    walk(sub)
            elif key in _SCHEMA_VALUES:
                for sub in value if isinstance(value, list) else [value]:
                    walk(sub)

    walk(schema)
    return found


def outlines_honours(schema: dict[str, Any]) -> bool:
    for keyword in schema_keywords(schema):
        if keyword.startswith("format:"):
            if keyword[len("format:"):] not in OUTLINES_FORMATS:
                return False
        elif keyword not in OUTLINES_KEYWORDS:
            return False
    if schema.get("type") == "object" and not schema.get("properties"):
        return False  # outlines-core's "any object" automaton is huge (22 s, 26 MB for SmolLM2)
    return not recursive_refs(schema)


_DEFINITIONS = ("$defs", "definitions")


def recursive_refs(schema: dict[str, Any]) -> bool:
    """Whether a `$ref` can reach itself (a tree's node, or the root "#"), or is one this check
    cannot follow. outlines-core unrolls a recursive schema to a fixed depth and, where it stops,
    writes an object with a dangling comma and without its required keys; llguidance recurses."""
    targets = {"#": schema}
    for key in _DEFINITIONS:
        for name, sub in (schema.get(key) or {}).items():
            targets[f"#/{key}/{name}"] = sub

    def refs(node: Any) -> set[str]:
        found: set[str] = set()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    found.add(value)
                elif key not in _DEFINITIONS:  # definitions are reached through their refs
                    found |= refs(value)
        elif isinstance(node, list):
            for value in node:
                found |= refs(value)
        return found

    edges = {name: refs(sub) for name, sub in targets.items()}
    if any(ref not in targets for out in edges.values() for ref in out):
        return True
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle(name: str) -> bool:
        state[name] = 1
        for ref in edges[name]:
            if state.get(ref) == 1 or (ref not in state and cycle(ref)):
                return True
        state[name] = 2
        return False

    return cycle("#")


def close_objects(schema: Any) -> Any:
    """A copy where objects that list properties but say nothing of others allow no others.

    JSON Schema allows unlisted properties by default, and a model sampled at temperature 1 will
    invent them without end. outlines-core never generates unlisted properties; applying the same
    rule before llguidance makes both engines generate the same shape for the same schema. The
    outputs still validate against the user's schema (they are a subset of what it allows)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: close_objects(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_VALUES:
            out[key] = close_objects(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def choice_regex(choices: list[str]) -> str:
    """An alternation matching exactly one of the strings."""
    return "(" + "|".join(escape(c) for c in choices) + ")"


_META = set("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """Escape for the Rust regex syntax outlines-core parses (the regex-syntax crate's escape set)."""
    return "".join("\\" + c if c in _META else c for c in text)
