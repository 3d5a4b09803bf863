"""Tool-call parsers (`--tool-call-parser`): a model's own tool-call syntax turned into OpenAI
`tool_calls`, in whole messages and as streamed `delta.tool_calls`, for `tool_choice: "auto"`.

  hermes       Qwen2.5, Qwen3, Hermes, SmolLM3: `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`
               anywhere in the text, as many as it likes.
  llama3_json  Llama 3.1/3.2/3.3: the whole answer is `{"name": .., "parameters": {..}}`, several
               separated by `;`, optionally after `<|python_tag|>`.
  mistral      `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v3 tokenizers) or
               `name[ARGS]{..}` (v11 and later); `[TOOL_CALLS]` is a special token, so requests
               keep special tokens in the text this parser reads.
  qwen3_coder  Qwen3-Coder's XML: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>
               ...</function>\\n</tool_call>`; VALUEs are typed by the tool's JSON schema.
  pythonic     Llama 3.2/4, SmolLM-style: the whole answer is a Python list of calls `[f(a=1), g()]`.

One incremental parser (`ToolCallStream`) serves both routes: a whole message is the stream fed in
one piece, so the two agree. The stream never shows markup as content: text that could still become
a trigger is held back, and a call's name is sent once it is complete, its arguments in pieces as
they become certain (the pieces concatenate to exactly the whole message's `arguments`).
Whitespace around calls is not content. A call the output leaves unfinished, or whose syntax is
broken, is returned as content in a whole message; a stream may already have sent its name.

Each format also writes the Lark grammar (llguidance) that constrains its calls: once the model
opens a call, the name must be one of the tools and the arguments must match that tool's schema
(`lark`; composed with reasoning and other constraints in jaxserve.structured.compose).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from typing import Any

from jaxserve.server.reasoning import held_suffix
from jaxserve.structured.compose import json_rule

PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic")
WS = " \t\r\n"


class _Bad(Exception):
    """The text is not (the start of) a tool call in this format."""


@dataclasses.dataclass
class _Partial:
    name: str | None = None
    args: str = ""  # the certain prefix of the arguments' JSON text (all of it once done)
    done: bool = False


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---- JSON scanning (tolerant of a text that stops anywhere) ---------------------------------------
_LITERAL = re.compile(r"[-+0-9.eEa-z]+")


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """End of the JSON string starting at s[i] == '"', None if the text stops inside it."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _bracketed_end(s: str, i: int, memo: dict | None, key: Any, quotes: str, python: bool) -> int | None:
    """Scan from s[i], counting brackets outside strings: a JSON container ends after its closing
    bracket; a Python argument value (python=True) ends before a top-level `,` or `)`. None if the
    text stops first; `memo[key]` then keeps where the scan stopped, to resume from next time."""
    j, depth, quote = memo.get(key, (i, 0, "")) if memo is not None else (i, 0, "")
    n = len(s)
    while j < n:
        c = s[j]
        if quote:
            if c == "\\":
                if j + 1 == n:
                    break  # what it escapes has not arrived: resume at the backslash
                j += 2
                continue
            if c == quote:
                quote = ""
        elif c in quotes:
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j
            depth -= 1
            if depth == 0 and not python:
                return j + 1
        elif c == "," and depth == 0 and python:
            return j
        j += 1
    if memo is not None:
        memo[key] = (j, depth, quote)
    return None


def _value_end(s: str, i: int, memo: dict[int, tuple[int, int, bool]] | None = None) -> int | None:
    """End of the JSON value starting at s[i], None if the text stops inside it (brackets are only
    counted; json.loads checks the finished value). `memo` keeps where an open object's scan
    stopped, so a stream that only grows is scanned once, not once per piece."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        return _bracketed_end(s, i, memo, i, '"', python=False)
    m = _LITERAL.match(s, i)
    if not m:
        raise _Bad
    return None if m.end() == len(s) else m.end()


def _json_call(s: str, i: int, arg_keys: tuple[str, ...], name_first: bool = False,
               memo: dict | None = None) -> tuple[_Partial, int | None]:
    """A call object `{"name": .., "arguments": {..}}` at s[i] (after whitespace): the call so far
    and the index after the object (None while open)."""
    call = _Partial()
    i = _ws(s, i)
    if i == len(s):
        return call, None
    if s[i] != "{":
        raise _Bad
    j, first, seen_args = i + 1, True, False
    while True:
        j = _ws(s, j)
        if j == len(s):
            return call, None
        if s[j] == "}":
            if call.name is None:
                raise _Bad
            if not seen_args:
                call.args = "{}"
            call.done = True
            return call, j + 1
        if s[j] == "," and not first:
            j = _ws(s, j + 1)
            if j == len(s):
                return call, None
        if s[j] != '"':
            raise _Bad
        key_end = _string_end(s, j)
        if key_end is None:
            return call, None
        key = json.loads(s[j:key_end])
        if first and name_first and key != "name":
            raise _Bad
        first = False
        j = _ws(s, key_end)
        if j == len(s):
            return call, None
        if s[j] != ":":
            raise _Bad
        j = _ws(s, j + 1)
        end = _value_end(s, j, memo)
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(s[j:end])
            if not isinstance(name, str) or not name:
                raise _Bad
            call.name = name
        elif key in arg_keys:
            seen_args = True
            if end is None:
                if j < len(s) and s[j] == "{":
                    call.args = s[j:]  # an open object: all of it so far is its text
                return call, None
            text = s[j:end]
            if text.startswith('"'):  # arguments sent as a JSON string holding the object
                text = json.loads(text)
            call.args = text
        elif end is None:
            return call, None
        j = end


def _resume(memo: dict | None, key: Any, start: Any) -> Any:
    """Where a scan of a growing region left off (its finished parts), or `start`."""
    return memo.get(key, start) if memo is not None else start


def _keep(memo: dict | None, key: Any, value: Any) -> None:
    if memo is not None:
        memo[key] = value


def _checked(args: str) -> str:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        raise _Bad from None
    if not isinstance(value, dict):
        raise _Bad
    return args


def _prefix_or_bad(rest: str, token: str) -> bool:
    """True if `rest` starts with `token`; False if it may still become it; _Bad otherwise."""
    if rest.startswith(token):
        return True
    if token.startswith(rest):
        return False
    raise _Bad


# ---- formats ------------------------------------------------------------------------------------
class ToolFormat:
    """A model family's tool-call syntax."""

    name: str
    trigger: str = ""  # marker-delimited formats: the text that opens a call region
    whole_output = False  # the answer is either all calls or all text
    keep_special_tokens = False  # the trigger is a special token the detokenizer would drop

    def opens(self, text: str) -> tuple[str, int]:
        """Whole-output formats: ("call", offset of the calls) | ("wait", 0) | ("text", 0)."""
        raise NotImplementedError

    def scan(self, region: str, schemas: dict[str, dict[str, Any]],
             memo: dict | None = None) -> tuple[list[_Partial], int | None]:
        """The calls in a region (the text after its trigger) and the region's end (None: open).
        `memo` is the stream's scratch for this region (it only grows between calls)."""
        raise NotImplementedError

    def json_calls(self, functions: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        """For formats whose call is a bare JSON object: one call's schema per tool."""
        return ()

    def lark(self, functions: dict[str, dict[str, Any]], parallel: bool, special: Callable[[str], int | None],
             text: bool = True) -> str:
        """Lark rules defining `tools`: free text with calls in this syntax, each constrained (or,
        with text False, one or more calls and nothing else). `special(s)` is the id of the
        special token spelled s, if the tokenizer has one."""
        raise NotImplementedError


def _lit(text: str) -> str:
    return json.dumps(text)


def _calls_rule(prefix: str, functions: dict[str, dict[str, Any]], open_: Callable[[str], str], close: str) -> str:
    """`{prefix}_fn: {prefix}_0 | ...`, one alternative per function: open(name) args close."""
    rules = [f"{prefix}_fn: " + " | ".join(f"{prefix}_{k}" for k in range(len(functions)))]
    for k, (name, schema) in enumerate(functions.items()):
        rules.append(f"{prefix}_{k}: {_lit(open_(name))} {json_rule(schema)} {_lit(close)}")
    return "\n".join(rules)


_FREE = "TOOL_TEXT: /(.|\\n)*/"
_AFTER = "/[ \\t\\r\\n]{0,2}/"  # after a call: a bound keeps a sampled model from padding forever


def _marked_calls(trigger: str, parallel: bool, text: bool) -> list[str]:
    """`tools` for formats whose calls start with a text trigger: text is free until the trigger
    (a lazy lexeme: it ends at the first trigger), then `tool_call` follows, which the format
    defines after `tool_head`."""
    if not text:
        return [f"tools: (tool_call {_AFTER})" + ("+" if parallel else ""), f"tool_head: {_lit(trigger)}"]
    many = "tool_call* TOOL_TEXT" if parallel else f"tool_call {_AFTER} | TOOL_TEXT"
    return [f"tools: {many}", _FREE, f"tool_head[lazy]: TOOL_TEXT {_lit(trigger)}"]


class Hermes(ToolFormat):
    name = "hermes"
    trigger, close = "<tool_call>", "</tool_call>"

    def scan(self, region, schemas, memo=None):
        call, end = _json_call(region, 0, ("arguments", "parameters"), memo=memo)
        if end is None:
            return [call], None
        j = _ws(region, end)
        return [call], (j + len(self.close) if _prefix_or_bad(region[j:], self.close) else None)

    def lark(self, functions, parallel, special, text=True):
        return "\n".join([
            *_marked_calls(self.trigger, parallel, text),
            f"tool_call: tool_head \"\\n\" call_fn {_lit(chr(10) + self.close)}",
            _calls_rule("call", functions, lambda n: f'{{"name": {json.dumps(n)}, "arguments": ', "}"),
        ])


class Llama3Json(ToolFormat):
    name = "llama3_json"
    whole_output = True
    tag = "<|python_tag|>"

    def opens(self, text):
        t = text.lstrip(WS)
        skip = len(text) - len(t)
        if t.startswith(self.tag):
            return "call", skip + len(self.tag)
        if t.startswith("{"):
            return "call", skip
        return ("wait", 0) if not t or self.tag.startswith(t) else ("text", 0)

    def scan(self, region, schemas, memo=None):
        done, j = _resume(memo, "calls", ((), 0))
        calls = list(done)
        while True:
            call, end = _json_call(region, j, ("parameters", "arguments"), name_first=True, memo=memo)
            calls.append(call)
            if end is None:
                return calls, None
            j = _ws(region, end)
            if j == len(region):
                return calls, None  # more may follow ("; {...}")
            if region[j] != ";":
                raise _Bad
            j += 1
            _keep(memo, "calls", (tuple(calls), j))  # finished calls are not scanned again

    def json_calls(self, functions):
        return tuple({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, schema in functions.items())

    def lark(self, functions, parallel, special, text=True):
        tag = special(self.tag)
        lead = f"<[{tag}]>? " if tag is not None else ""
        many = ' ("; " call_fn)*' if parallel else ""
        lines = [f"tools: {lead}call_fn{many}"]
        if text:  # an answer that is no call must not look like one
            lines = [f"tools: TOOL_TEXT | {lead}call_fn{many}", "TOOL_TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{(?s:.*)/"]
        return "\n".join([*lines,
                          _calls_rule("call", functions, lambda n: f'{{"name": {json.dumps(n)}, "parameters": ', "}")])


class Mistral(ToolFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    args_tag = "[ARGS]"
    keep_special_tokens = True

    def scan(self, region, schemas, memo=None):
        j = _ws(region, 0)
        if j == len(region):
            return [], None
        if region[j] == "{":  # one object
            call, end = _json_call(region, j, ("arguments", "parameters"), memo=memo)
            return [call], end
        if region[j] == "[":  # v3: a JSON list of objects
            done, j = _resume(memo, "calls", ((), j + 1))
            calls = list(done)
            while True:
                call, end = _json_call(region, j, ("arguments", "parameters"), memo=memo)
                if end is None:
                    return calls + ([call] if call.name is not None else []), None
                calls.append(call)
                j = _ws(region, end)
                if j == len(region):
                    return calls, None
                if region[j] == "]":
                    return calls, j + 1
                if region[j] != ",":
                    raise _Bad
                j += 1
                _keep(memo, "calls", (tuple(calls), j))
        at = region.find(self.args_tag, j)  # v11: name[ARGS]{...}
        name = region[j:at] if at >= 0 else region[j:len(region) - held_suffix(region, self.args_tag)]
        name = name.rstrip(WS)  # a detokenizer may space special tokens apart
        if not re.fullmatch(r"[A-Za-z0-9_.\-]*", name) or (at < 0 and len(name) > 256):
            raise _Bad
        if at < 0:
            return [_Partial()], None
        k = _ws(region, at + len(self.args_tag))
        end = _value_end(region, k, memo)
        if end is None:
            return [_Partial(name, region[k:] if region[k:k + 1] == "{" else "")], None
        return [_Partial(name, region[k:end], True)], end

    def lark(self, functions, parallel, special, text=True):
        trig, args_tag = special(self.trigger), special(self.args_tag)
        lines = [_FREE] if text else []
        if trig is None and text:  # a text trigger (a tokenizer without the special token): lazy, as hermes
            lines.append(f"tool_trig[lazy]: TOOL_TEXT {_lit(self.trigger)}")
            head = "tool_trig"
        else:
            head = (f"<[{trig}]>" if trig is not None else _lit(self.trigger))
            head = f"TOOL_TEXT {head}" if text else head
        if args_tag is not None:  # v11: [TOOL_CALLS]name[ARGS]{...}, one marker per call
            lines.append("tool_call: " + " | ".join(f"tool_{k}" for k in range(len(functions))))
            for k, (name, schema) in enumerate(functions.items()):
                lines.append(f"tool_{k}: {head} {_lit(name)} <[{args_tag}]> {json_rule(schema)}")
            body = "tool_call+" if parallel else "tool_call"
        else:  # v3: [TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]
            many = ' (", " call_fn)*' if parallel else ""
            lines.append(f'tool_call: {head} " "? "[" call_fn{many} "]"')
            lines.append(_calls_rule("call", functions, lambda n: f'{{"name": {json.dumps(n)}, "arguments": ', "}"))
            body = "tool_call"
        return "\n".join([f"tools: TOOL_TEXT | {body} {_AFTER}" if text else f"tools: {body} {_AFTER}"] + lines)


_RAW_STRING_KEYS = {"type", "description", "title", "default", "examples", "enum"}


def _raw_string(schema: dict[str, Any] | None) -> bool:
    """A parameter Qwen3-Coder writes as bare text: a string with no constraint beyond an enum.
    Others are JSON (a constrained string is written quoted, so its grammar can check it)."""
    schema = schema or {}
    return schema.get("type") in ("string", ["string"]) and not set(schema) - _RAW_STRING_KEYS and all(
        isinstance(v, str) for v in schema.get("enum", []))


def _convert(value: str, schema: dict[str, Any] | None) -> str:
    """A textual parameter value as JSON, typed by its schema: bare strings stay strings, anything
    else is read as JSON when it parses (Qwen3-Coder writes `5`, `true`, `{"a": 1}` bare)."""
    if _raw_string(schema):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except json.JSONDecodeError:
        return json.dumps(value, ensure_ascii=False)


def _object_prefix(items: list[tuple[str, str]], done: bool) -> str:
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in items)
    return "{" + body + ("}" if done else "")


def _parameter_end(region: str, i: int) -> int | None:
    """Where the parameter value after region[i] ends: the first `</parameter>` followed by the next
    parameter or `</function>` (a value may itself contain the tag); None until that is known."""
    at = region.find("</parameter>", i)
    while at >= 0:
        k = _ws(region, at + len("</parameter>"))
        rest = region[k:]
        if rest.startswith(("<parameter=", "</function>")):
            return at
        if "<parameter=".startswith(rest) or "</function>".startswith(rest):
            return None  # what follows is still arriving
        at = region.find("</parameter>", at + 1)
    return None


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    trigger, close = "<tool_call>", "</tool_call>"

    def scan(self, region, schemas, memo=None):
        j = _ws(region, 0)
        if not _prefix_or_bad(region[j:], "<function="):
            return [], None
        j += len("<function=")
        gt = region.find(">", j)
        if gt < 0:
            return [_Partial()], None
        call = _Partial(region[j:gt])
        props = (schemas.get(call.name) or {}).get("properties") or {}
        done, j = _resume(memo, "params", ((), gt + 1))
        items: list[tuple[str, str]] = list(done)
        while True:
            call.args = _object_prefix(items, False)
            j = _ws(region, j)
            rest = region[j:]
            if rest.startswith("<parameter="):
                gt = region.find(">", j)
                if gt < 0:
                    return [call], None
                key = region[j + len("<parameter="):gt]
                stop = _parameter_end(region, gt)
                if stop is None:
                    return [call], None
                value = region[gt + 1:stop]
                value = value.removeprefix("\n").removesuffix("\n")
                items.append((key, _convert(value, props.get(key))))
                j = stop + len("</parameter>")
                _keep(memo, "params", (tuple(items), j))  # finished parameters are not read again
            elif rest.startswith("</function>"):
                call.args, call.done = _object_prefix(items, True), True
                j = _ws(region, j + len("</function>"))
                return [call], (j + len(self.close) if _prefix_or_bad(region[j:], self.close) else None)
            elif ("<parameter=".startswith(rest) or "</function>".startswith(rest)):
                return [call], None
            else:
                raise _Bad

    def lark(self, functions, parallel, special, text=True):
        lines = [*_marked_calls(self.trigger, parallel, text),
                 "tool_call: tool_head \"\\n\" (" + " | ".join(f"fn_{k}" for k in range(len(functions))) + ")"
                 + f" {_lit('</function>' + chr(10) + self.close)}",
                 # A string value and its closing tag are one lexeme (llguidance's lexer is greedy:
                 # free text followed by a literal could never end).
                 "QC_STRING: /(?s:.*)\\n<\\/parameter>/ & ~/(?s:.*)\\n<\\/parameter>(?s:.+)/"]
        for k, (name, schema) in enumerate(functions.items()):
            params = []
            for p, sub in (schema.get("properties") or {}).items():
                head = _lit(f"<parameter={p}>" + chr(10))
                if _raw_string(sub) and "enum" in sub:
                    choices = " | ".join(_lit(v + chr(10) + "</parameter>") for v in sub["enum"])
                    params.append((p, f"{head} ({choices}) \"\\n\""))
                elif _raw_string(sub):
                    params.append((p, f"{head} QC_STRING \"\\n\""))
                else:
                    params.append((p, f"{head} {json_rule(sub)} {_lit(chr(10) + '</parameter>' + chr(10))}"))
            required = set(schema.get("required") or [])
            lines.append(f"fn_{k}: {_lit(f'<function={name}>' + chr(10))} "
                         + " ".join(f"({rule})" + ("" if p in required else "?") for p, rule in params))
        return "\n".join(lines)


# Names as OpenAI allows them (letters, digits, _ . -), not only Python identifiers.
_PY_CALL = re.compile(r"\[\s*[\w.\-]+\s*\(")
_PY_CALL_PREFIX = re.compile(r"\[?|\[\s*([\w.\-]+\s*)?")
_PY_NAME = re.compile(r"[\w.\-]+")


def _py_value_end(s: str, i: int, memo: dict | None = None) -> int | None:
    """End of a Python literal at s[i] (before a top-level `,` or `)`), None if the text stops first."""
    return _bracketed_end(s, i, memo, ("py", i), "'\"", python=True)


def _py_json(text: str) -> str:
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:  # JSON inside a Python call (true/false/null) is what a JSON-constrained value gives
            value = json.loads(text)
        except json.JSONDecodeError:
            raise _Bad from None
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:  # bytes, sets, complex: no JSON for them
        raise _Bad from None


class Pythonic(ToolFormat):
    name = "pythonic"
    whole_output = True
    tag, end_tag = "<|python_start|>", "<|python_end|>"

    def opens(self, text):
        t = text.lstrip(WS)
        skip = len(text) - len(t)
        if t.startswith(self.tag):
            rest = t[len(self.tag):].lstrip(WS)
            skip, t = len(text) - len(rest), rest
        elif self.tag.startswith(t):
            return "wait", 0
        if _PY_CALL.match(t):
            return "call", skip
        return ("wait", 0) if _PY_CALL_PREFIX.fullmatch(t) else ("text", 0)

    def scan(self, region, schemas, memo=None):
        done, j = _resume(memo, "calls", ((), 1))  # after "[" and any finished calls
        calls: list[_Partial] = list(done)
        while True:
            j = _ws(region, j)
            m = _PY_NAME.match(region, j)
            if m is None or m.end() == len(region):
                if j < len(region) and m is None:
                    raise _Bad
                return calls + [_Partial()], None
            call, items = _Partial(m.group()), []
            calls.append(call)
            j = _ws(region, m.end())
            if j == len(region):
                return calls, None
            if region[j] != "(":
                raise _Bad
            finished, j = _resume(memo, ("args", m.start()), ((), j + 1))
            items = list(finished)
            while True:
                call.args = _object_prefix(items, False)
                j = _ws(region, j)
                if j == len(region):
                    return calls, None
                if region[j] == ")":
                    call.args, call.done = _object_prefix(items, True), True
                    j += 1
                    break
                km = _PY_NAME.match(region, j)
                if km is None or km.end() == len(region):
                    if km is None:
                        raise _Bad
                    return calls, None
                eq = _ws(region, km.end())
                if eq == len(region):
                    return calls, None
                if region[eq] != "=":
                    raise _Bad
                end = _py_value_end(region, eq + 1, memo)
                if end is None:
                    return calls, None
                items.append((km.group(), _py_json(region[eq + 1:end])))
                j = end + 1 if region[end] == "," else end
                _keep(memo, ("args", m.start()), (tuple(items), j))
            j = _ws(region, j)
            if j == len(region):
                return calls, None
            if region[j] == "]":
                end = _ws(region, j + 1)
                rest = region[end:]  # the end tag is text only when special tokens are kept
                if rest.startswith(self.end_tag):
                    return calls, end + len(self.end_tag)
                return calls, (None if self.end_tag.startswith(rest) else j + 1)
            if region[j] != ",":
                raise _Bad
            j += 1
            _keep(memo, "calls", (tuple(calls), j))

    def lark(self, functions, parallel, special, text=True):
        calls = "\"[\" py_fn" + (' (", " py_fn)*' if parallel else "") + " \"]\""
        lines = [f"tools: {calls}"]
        if text:  # an answer that is no call must not look like one
            lines = [f"tools: TOOL_TEXT | {calls}", "TOOL_TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\[(?s:.*)/"]
        lines.append("py_fn: " + " | ".join(f"py_{k}" for k in range(len(functions))))
        for k, (name, schema) in enumerate(functions.items()):
            props = list((schema.get("properties") or {}).items())
            required = set(schema.get("required") or [])
            # Keyword arguments in the schema's order, optional ones optional, commas between.
            values = []
            for p, sub in props:
                if sub.get("type") == "boolean" and not set(sub) - {"type", "description"}:
                    value = '("True" | "False")'
                else:  # a JSON value is a Python literal (strings, numbers); objects are read back as JSON
                    value = json_rule(sub)
                values.append(f"{_lit(p + '=')} {value}")
            n = len(props)
            lines.append(f"py_{k}_rest_{n}: \"\"")
            lines.append(f"py_{k}_first_{n}: \"\"")
            for i in range(n - 1, -1, -1):
                p = props[i][0]
                with_it = f"{values[i]} py_{k}_rest_{i + 1}"
                rest = f'", " {with_it}'
                if p in required:
                    lines.append(f"py_{k}_rest_{i}: {rest}")
                    lines.append(f"py_{k}_first_{i}: {with_it}")
                else:
                    lines.append(f"py_{k}_rest_{i}: {rest} | py_{k}_rest_{i + 1}")
                    lines.append(f"py_{k}_first_{i}: {with_it} | py_{k}_first_{i + 1}")
            lines.append(f"py_{k}: {_lit(name + '(')} py_{k}_first_0 \")\"")
        return "\n".join(lines)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Qwen3Coder(), Pythonic())}


def check_parser(name: str | None) -> str | None:
    """`name` if it is a tool-call parser or "auto" (None: no parsing); ValueError naming the choices."""
    if name is not None and name != "auto" and name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be auto or one of {', '.join(PARSERS)}, got {name!r}")
    return name


def resolve(name: str | None, chat_template: str | None, architecture: str | None) -> str | None:
    """The parser to use for --tool-call-parser `name`: "auto" chosen from the model (ValueError
    when nothing fits: a server that cannot parse calls must say so at start-up)."""
    name = check_parser(name)
    if name != "auto":
        return name
    found = auto_parser(chat_template, architecture)
    if found is None:
        raise ValueError("--tool-call-parser auto: neither the chat template nor the architecture "
                         f"({architecture}) names a tool-call syntax; pick one of {', '.join(PARSERS)}")
    return found


def auto_parser(chat_template: str | None, architecture: str | None = None) -> str | None:
    """The parser a model's chat template implies (the template is what taught it its syntax)."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return "llama3_json"
    if "<|python_start|>" in t or re.search(r"\[func_name1\(", t):
        return "pythonic"
    arch = (architecture or "").lower()
    if arch.startswith(("qwen", "hermes")):
        return "hermes"
    if arch.startswith(("mistral", "mixtral")):
        return "mistral"
    if arch.startswith("llama"):
        return "llama3_json"
    return None


def new_call_id(fmt: ToolFormat) -> str:
    if fmt.name == "mistral":  # Mistral's templates require 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---- the stream -----------------------------------------------------------------------------------
class ToolCallStream:
    """Splits one output's text (its answer, after any reasoning), piece by piece, into content
    and `delta.tool_calls` entries; `calls` holds the finished calls."""

    def __init__(self, fmt: ToolFormat, schemas: dict[str, dict[str, Any]] | None = None):
        self.fmt = fmt
        self.schemas = schemas or {}
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._mode = "start" if fmt.whole_output else "text"  # start | text | plain (whole: no calls)
        self._region: str | None = None  # text of the open call region, after its head
        self._head = ""  # the region's trigger text (given back as content if the region breaks)
        self._sent: list[tuple[str, str, str]] = []  # (id, name, arguments sent) per call of the region
        self._pending_ws = ""  # trailing whitespace of the content, until what follows decides it
        self._gap = ""  # the whitespace between content and the call(s) after it
        self._after_call = False  # a call closed and no content came since
        self._content_seen = False
        self._memo: dict = {}  # scan state of the open region (tool_parsers._value_end)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._step(out, deltas):
            pass
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: an open region is complete if its calls are, else text."""
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        if self._region is not None:
            try:
                calls, _ = self.fmt.scan(self._region, self.schemas, self._memo)
                if not calls or not all(c.done for c in calls):
                    raise _Bad
                self._close_region(calls, deltas)
            except _Bad:
                region, self._region = self._region, None
                self._give_back(out)
                self._text(out, region)
        self._text(out, self._buf)
        self._buf = ""
        if not self.calls:
            out.append(self._pending_ws)
        self._pending_ws = ""
        return "".join(out), deltas

    # ---- internals ---------------------------------------------------------------------------------
    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move; True while there is more to do with the buffer."""
        fmt = self.fmt
        if self._region is None:
            if self._mode == "plain" or (self._mode == "text" and fmt.whole_output):
                self._text(out, self._buf)  # no calls in this answer, or text after its call list
                self._buf = ""
                return False
            if self._mode == "start":
                kind, at = fmt.opens(self._buf)
                if kind == "wait":
                    return False
                if kind == "text":
                    self._mode = "plain"
                    return True
                self._head, self._region, self._buf = self._buf[:at], "", self._buf[at:]
                self._memo = {}
                self._mode = "text"
            else:
                at = self._buf.find(fmt.trigger)
                if at < 0:
                    keep = held_suffix(self._buf, fmt.trigger)
                    self._text(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return False
                self._text(out, self._buf[:at])
                if not self._after_call:  # the whitespace that led up to the call is not content
                    self._gap = self._pending_ws
                self._pending_ws = ""
                self._head, self._region = fmt.trigger, ""
                self._memo = {}
                self._buf = self._buf[at + len(fmt.trigger):]
        self._region += self._buf
        self._buf = ""
        try:
            calls, end = fmt.scan(self._region, self.schemas, self._memo)
            if end is None:
                self._send(calls, deltas)
                return False
            if not calls or not all(c.done for c in calls):
                raise _Bad
            rest = self._region[end:]
            self._close_region(calls, deltas)
            self._buf = rest
            return bool(rest)
        except _Bad:  # not a call after all: its head is content, and the rest is read again
            self._buf, self._region = self._region + self._buf, None
            self._give_back(out)
            if fmt.whole_output:
                self._mode = "plain"
            return True

    def _give_back(self, out: list[str]) -> None:
        """A broken region's head as content, with the whitespace that led up to it."""
        self._sent = []
        if not self._after_call:
            self._pending_ws = self._gap
        self._text(out, self._head)
        self._head = ""

    def _send(self, calls: list[_Partial], deltas: list[dict[str, Any]]) -> None:
        base = len(self.calls)
        for k, call in enumerate(calls):
            if call.name is None:
                return
            if k == len(self._sent):
                call_id = new_call_id(self.fmt)
                self._sent.append((call_id, call.name, ""))
                deltas.append({"index": base + k, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call_id, name, sent = self._sent[k]
            if len(call.args) > len(sent) and call.args.startswith(sent):
                deltas.append({"index": base + k, "function": {"arguments": call.args[len(sent):]}})
                self._sent[k] = (call_id, name, call.args)

    def _close_region(self, calls: list[_Partial], deltas: list[dict[str, Any]]) -> None:
        for c in calls:
            _checked(c.args)  # raises _Bad before anything of this region is final
        self._send(calls, deltas)
        for k, call in enumerate(calls):
            call_id, _, sent = self._sent[k]
            self.calls.append(ToolCall(call_id, call.name or "", call.args if call.args.startswith(sent) else sent))
        self._region, self._sent, self._head = None, [], ""
        self._after_call = True

    def _text(self, out: list[str], text: str) -> None:
        """Content, without whitespace that only surrounds calls: trailing whitespace waits for what
        follows; text after calls is separated from text before them by the first call's gap."""
        if self._after_call:
            text = text.lstrip(WS)
            if not text:
                return
            self._after_call = False
            if self._content_seen:
                text = self._gap + text
        text = self._pending_ws + text
        body = text.rstrip(WS)
        self._pending_ws = text[len(body):]
        self._content_seen = self._content_seen or bool(body)
        out.append(body)


def parse(fmt: ToolFormat, text: str, schemas: dict[str, dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: (content or None, tool calls)."""
    stream = ToolCallStream(fmt, schemas)
    c1, _ = stream.feed(text)
    c2, _ = stream.finish()
    return (c1 + c2) or None, stream.calls
