"""Constraints that compose: a reasoning model's think block left free (and cut at
`reasoning_max_tokens`), then the answer constrained by the request's structured output, a forced
tool call, or `tool_choice: "auto"` calls in the model's own syntax -- one llguidance grammar.

No peer does all of this in one place: a constraint applied from the first token binds the think
block too (JSON lands in reasoning_content, vllm#16182), and unconstrained auto tool calls do not
always parse. Here the think body is any text without `</think>` (so the model's own `</think>`
ends it), the answer is what the constraint
says, and tool calls are free text until the model writes a call's trigger, after which the
call's name and arguments follow the tool's schema (llguidance's lazy lexemes).

`reasoning_max_tokens` is not part of the grammar (llguidance ends a capped lexeme without
forcing what follows it): jaxserve.structured.reasoning_cap forces `</think>` token by token.

The result is a GuideSpec of kind "llguidance": a TopLevelGrammar JSON the structured-output
compiler validates and caches like any other constraint.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.structured import spec as specs
from jaxserve.structured import structural_tags
from jaxserve.structured.spec import GuideError, GuideSpec

THINK_START, THINK_END = "<think>", "</think>"
# After </think>, Qwen3 writes a blank line; a bound keeps a sampled model from padding forever.
_SEPARATOR = "/(\\r?\\n){0,2}/"
# The free-text terminals an answer may start with (a structural tag's outside its tags are
# ANSWER_TEXT_<n>; jaxserve.structured.structural_tags).
_FREE_TEXT = ("ANSWER_TEXT: ", "TOOL_TEXT: ", "ANSWER_TEXT_")
_NOT_THINKING = " & ~/[ \\t\\r\\n]*<think>(?s:.*)/"


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """Where the output's think block is."""

    opened: bool  # the output starts inside the block (the template opened it)
    may_open: bool  # the output may open a block with its own <think>


@dataclasses.dataclass(frozen=True)
class ToolRules:
    """`tool_choice: "auto"` calls: Lark rules defining `tools` (jaxserve.server.tool_parsers),
    free text with calls in it; or, when the answer has a format of its own (`otherwise`), `tools`
    as calls alone, and the answer is either those calls or the formatted answer."""

    lark: str
    otherwise: GuideSpec | None = None
    # Formats whose call is a bare JSON object (llama3_json): the schemas of one call to each tool.
    # Beside a JSON answer format they merge into one schema: two JSON rules that start alike
    # cannot both be open to llguidance's lexer.
    json_calls: tuple[dict[str, Any], ...] = ()


def json_rule(schema: dict[str, Any], whitespace: str | None = None) -> str:
    """A `%json` rule for a schema, enforced as the compiler enforces schemas on their own
    (`whitespace`: a GuideSpec's)."""
    return "%json " + json.dumps({**specs.close_objects(schema), "x-guidance": specs.json_layout(whitespace)})


def _answer(answer: GuideSpec | ToolRules | None) -> tuple[list[str], list[dict[str, Any]]]:
    """Lark lines defining `answer`, and side grammars it references."""
    if answer is None:
        return ["answer: ANSWER_TEXT", "ANSWER_TEXT: /(.|\\n)*/"], []
    if isinstance(answer, ToolRules):
        if answer.otherwise is None:
            return ["answer: tools", answer.lark], []
        spec = answer.otherwise
        if answer.json_calls and spec.kind in ("json_schema", "json_object"):
            schema = json.loads(spec.text) if spec.kind == "json_schema" else {"type": "object"}
            return ["answer: " + json_rule({"anyOf": [*answer.json_calls, schema]}, spec.whitespace)], []
        rules, side = _rule("formatted", spec)
        return ["answer: tools | formatted", answer.lark, *rules], side
    return _rule("answer", answer)


def _rule(name: str, spec: GuideSpec) -> tuple[list[str], list[dict[str, Any]]]:
    """Lark lines defining rule `name` as the constraint `spec`, and side grammars it references."""
    if spec.kind == "json_schema":
        return [f"{name}: " + json_rule(json.loads(spec.text), spec.whitespace)], []
    if spec.kind == "json_object":
        return [f"{name}: " + json_rule({"type": "object"}, spec.whitespace)], []
    if spec.kind == "choice":
        return [f"{name}: " + " | ".join(json.dumps(c) for c in json.loads(spec.text))], []
    if spec.kind == "structural_tag":
        return structural_tags.lark(json.loads(spec.text), name)
    terminal = name.upper() + "_RE"
    if spec.kind == "regex":
        return [f"{name}: {terminal}", f"{terminal}: /" + structural_tags.slashes_escaped(spec.text) + "/"], []
    if spec.kind == "grammar":
        user = specs.as_lark(spec.text, spec.param)
        return [f"{name}: @user_grammar"], [{"name": "user_grammar", "lark_grammar": user}]
    raise GuideError(spec.param, f"{spec.kind} cannot be composed with a think block or tool calls")


def compose(answer: GuideSpec | ToolRules | None, reasoning: Reasoning | None, param: str) -> GuideSpec:
    """One grammar: the think block (if any), then the answer. `param` is named in errors."""
    lines = ["%llguidance {}"]
    if reasoning is None:
        lines.append("start: answer")
    else:
        # One lexeme from the block's text through its first </think>: llguidance's lexer is
        # greedy, so a text lexeme followed by a "</think>" literal could never end.
        lines.append("THINK_BLOCK: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/")
        block = f"THINK_BLOCK {_SEPARATOR}"
        if reasoning.opened:
            lines.append(f"start: {json.dumps(THINK_START)}? {block} answer")
        elif reasoning.may_open:
            lines.append(f"start: ({json.dumps(THINK_START)} {block})? answer")
        else:
            lines.append("start: answer")
    rules, side = _answer(answer)
    if reasoning is not None and reasoning.may_open and not reasoning.opened:
        # Without this an answer that is free text could also be read as starting at the first
        # token, "<think>" and all: a second parse in which nothing after it is constrained.
        rules = [r + _NOT_THINKING if r.startswith(_FREE_TEXT) else r for r in "\n".join(rules).split("\n")]
    lines += rules
    top = {"name": "main", "lark_grammar": "\n".join(lines)}
    return GuideSpec("llguidance", json.dumps({"grammars": [top, *side]}), param)
