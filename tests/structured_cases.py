"""Structured-output cases shared by the tests and benchmarks/structured.py.

Every string, array and number is bounded, so that at temperature 1.0 an output always completes
well within max_tokens: the tests then check that *every* output validates, not just most.
"""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 12}
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[dict] = [
    # flat objects
    {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]},
    {"type": "object", "properties": {"capital": SHORT, "country": SHORT}, "required": ["capital", "country"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"value": {"type": "null"}}, "required": ["value"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "fruit"}, "name": SHORT}, "required": ["kind", "name"]},
    # optional properties
    {"type": "object", "properties": {"title": SHORT, "subtitle": SHORT}, "required": ["title"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}},
    # numbers and ranges
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"temp": {"type": "integer", "minimum": -40, "maximum": 50}}, "required": ["temp"]},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["year"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
     "required": ["p"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["n"]},
    # arrays
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 5},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "array", "items": AGE, "maxItems": 2}}},
     "required": ["matrix"]},
    # nesting
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": AGE},
                                                 "required": ["name", "age"]}}, "required": ["person"]},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": SHORT, "location": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}},
        "required": ["name", "location"]}}, "required": ["city"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": AGE, "label": SHORT}, "required": ["id", "label"]}}},
     "required": ["items"]},
    # string patterns and formats
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["word"]},
    # combinators and references
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "boolean"}, AGE]}}, "required": ["v"]},
    {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"circle": AGE}, "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": AGE}, "required": ["square"], "additionalProperties": False}]}},
     "required": ["shape"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": AGE, "y": AGE}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 8}}, "required": ["maybe"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]}, "count": AGE,
                                      "note": SHORT}, "required": ["status", "count"], "additionalProperties": False},
]

REGEXES: list[str] = [
    r"(France|England)",
    r"[0-9]{3}-[0-9]{4}",
    r"[A-Z][a-z]{2,8}",
    r"(yes|no|maybe)",
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(true|false)",
    r"-?[0-9]{1,4}\.[0-9]{2}",
    r"[A-Z]{2}[0-9]{2} [A-Z]{3}",
    r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day",
    r"\((\d{1,2}), (\d{1,2})\)",
    r"[a-z]{1,8}( [a-z]{1,8}){2}",
    r"(0|[1-9][0-9]{0,2})(\.[0-9])?%",
    r"https://[a-z]{2,10}\.com/[a-z]{1,8}",
    r"[A-Z]{3}-\d{3}",
    r"(red|green|blue)( and (red|green|blue))?",
    r"\d{1,2}:\d{2} (AM|PM)",
    r"v\d\.\d{1,2}\.\d{1,2}",
    r"[A-Za-z]{1,10}, [A-Za-z]{1,10}!",
]
