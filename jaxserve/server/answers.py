"""How a request's output becomes an answer: where the think block is, whose tool calls are read
(forced through a constraint, or the model's own syntax for tool_choice "auto" under
--tool-call-parser), the one constraint that binds the answer after the think block, and the split
of the text -- whole, or piece by piece as it streams -- into reasoning, content and tool calls.
Chat completions and the Responses API share it, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.engine.request import SamplingParams
from jaxserve.server import reasoning, tool_parsers
from jaxserve.server.generation import ServerState, attach_grammar, grammar_compiler
from jaxserve.server.tools import ForcedTools
from jaxserve.structured import compose
from jaxserve.structured import spec as guide
from jaxserve.structured.reasoning_cap import ReasoningCapGrammar


@dataclasses.dataclass
class OutputPlan:
    """How one request's outputs become messages: where the think block is, and whose tool calls
    are read (forced through a constraint, or the model's own syntax for tool_choice "auto")."""

    parser: str | None  # --reasoning-parser
    opened: bool  # the output starts inside the think block
    forced: ForcedTools | None
    tool_format: tool_parsers.ToolFormat | None  # tool_choice "auto" under --tool-call-parser
    schemas: dict[str, dict[str, Any]]
    think: compose.Reasoning | None = None  # where the grammar's think block is, if the output may have one


def plan(state: ServerState, prompt: list[int], forced: ForcedTools | None, auto: bool,
         schemas: dict[str, dict[str, Any]]) -> OutputPlan:
    """The plan for a prompt: `auto` reads the model's own calls (when the server has a parser)."""
    fmt = tool_parsers.FORMATS[state.tool_parser] if auto and state.tool_parser else None
    out = OutputPlan(state.reasoning_parser, False, forced, fmt, schemas)
    if out.parser is not None:
        tail = _prompt_tail(state, prompt)
        out.opened = reasoning.opens_in_reasoning(out.parser, tail)
        if out.opened or reasoning.may_open(out.parser, tail):
            out.think = compose.Reasoning(opened=out.opened, may_open=not out.opened)
    return out


async def constrain(state: ServerState, params: SamplingParams, plan: OutputPlan, user: guide.GuideSpec | None,
                    parallel: bool, reasoning_max_tokens: int | None = None) -> None:
    """Attach the request's constraint (its own structured output `user`, forced or auto tool
    calls, after the think block) and the reasoning cap to params."""
    if plan.tool_format is not None and plan.tool_format.keep_special_tokens:
        params.skip_special_tokens = False  # its trigger is a special token, written as it is
        params.spaces_between_special_tokens = False
    await attach_grammar(state, params, _constraint(state, user, plan, parallel))
    if reasoning_max_tokens is not None and plan.think is not None:
        params.grammar = await _cap_reasoning(state, params.grammar, reasoning_max_tokens, plan.opened)


def _prompt_tail(state: ServerState, prompt: list[int]) -> str:
    """The prompt's last text (where a template opens or closes a think block). Ids outside the
    vocabulary are left to submit, which refuses them with a 400."""
    known = len(state.tokenizer.hf)  # not vocab_size: an embedding padded past the tokenizer
    return state.tokenizer.decode([t for t in prompt[-16:] if 0 <= t < known])


def _constraint(state: ServerState, user: guide.GuideSpec | None, plan: OutputPlan,
                parallel: bool) -> guide.GuideSpec | None:
    """The request's one constraint on its answer, after the think block when there is one."""
    think = plan.think
    answer: guide.GuideSpec | compose.ToolRules | None = guide.only_one(
        [user, plan.forced.spec if plan.forced else None])
    if plan.tool_format is not None:
        # Free text with calls in it; with a format of its own, the answer is calls or that format.
        answer = compose.ToolRules(plan.tool_format.lark(plan.schemas, parallel,
                                                         lambda text: _special_id(state, text), text=answer is None),
                                   otherwise=answer, json_calls=plan.tool_format.json_calls(plan.schemas))
    if answer is None:
        return None
    if think is None and isinstance(answer, guide.GuideSpec):
        return answer
    return compose.compose(answer, think, answer.param if isinstance(answer, guide.GuideSpec) else "tools")


def _special_id(state: ServerState, text: str) -> int | None:
    """The id of the special token spelled `text`, if the tokenizer has one."""
    hf = state.tokenizer.hf
    i = hf.convert_tokens_to_ids(text)
    return i if isinstance(i, int) and i in state.tokenizer.special_ids and hf.convert_ids_to_tokens(i) == text else None


async def _cap_reasoning(state: ServerState, inner: Any, max_tokens: int, opened: bool) -> ReasoningCapGrammar:
    vocabulary = (await grammar_compiler(state)).vocabulary
    end_ids = state.tokenizer.encode(reasoning.END, add_special_tokens=False)
    return ReasoningCapGrammar(inner, vocabulary.tokens, end_ids, max_tokens, opened, vocabulary.size)


def message(text: str, finish_reason: str | None, plan: OutputPlan) -> dict[str, Any]:
    """A whole output as the message's content, reasoning_content and tool_calls."""
    message: dict[str, Any] = {"content": text}
    answer: str | None = text
    if plan.parser is not None:
        thought, answer = reasoning.parse(text, plan.opened)
        message = {"content": answer, "reasoning_content": thought}
    if plan.forced is not None:
        if finish_reason == "stop":  # complete, so it parses
            message |= {"content": None, "tool_calls": plan.forced.calls(answer or "")}
    elif plan.tool_format is not None:
        content, calls = tool_parsers.parse(plan.tool_format, answer or "", plan.schemas)
        message["content"] = content
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
    return message


def tool_finish(forced: ForcedTools | None, finish_reason: str | None) -> str | None:
    if forced is None:  # the model's own calls: "tool_calls" unless it was cut off
        return "tool_calls" if finish_reason == "stop" else finish_reason
    # vLLM's choice: a named function ends as an ordinary "stop"; "required" says "tool_calls".
    return "stop" if forced.function is not None else "tool_calls"


class OutputStream:
    """One output's text, piece by piece, as a delta: reasoning_content, content, tool_calls."""

    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self.thinking = reasoning.ReasoningStream(plan.opened) if plan.parser is not None else None
        self.tools = tool_parsers.ToolCallStream(plan.tool_format, plan.schemas) if plan.tool_format else None
        self.held = ""  # a forced call's text, sent as one tool_calls delta once complete
        self.called = False

    def delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
            if finish_reason is not None:
                more_thought, more_text = self.thinking.finish()
                thought, text = thought + more_thought, text + more_text
        calls: list[dict[str, Any]] = []
        if self.plan.forced is not None:
            self.held += text
            text = ""
            if finish_reason == "stop":
                calls = [{"index": k, **c} for k, c in enumerate(self.plan.forced.calls(self.held))]
            elif finish_reason is not None:
                text = self.held  # cut off: what there is, as text
        elif self.tools is not None:
            text, calls = self.tools.feed(text)
            if finish_reason is not None:
                more_text, more_calls = self.tools.finish()
                text, calls = text + more_text, calls + more_calls
        self.called = self.called or bool(calls)
        body: dict[str, Any] = {"reasoning_content": thought} if thought else {}
        # A forced call's held text says nothing until the call is whole: an empty delta (the
        # stream skips it), not content "" that a client would add up to "" instead of null.
        if text or not (finish_reason or thought or calls or self.plan.forced is not None):
            body["content"] = text
        if calls:
            body["tool_calls"] = one_entry_per_call(calls)
        return body


def one_entry_per_call(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`delta.tool_calls` with the entries of one index merged (the name and the first arguments
    came as two): OpenAI and vLLM send one entry per call per chunk, and a client that keys a
    chunk's entries by index would keep only the last."""
    merged: dict[int, dict[str, Any]] = {}
    for entry in calls:
        into = merged.get(entry["index"])
        if into is None:
            merged[entry["index"]] = {**entry, "function": dict(entry.get("function", {}))}
            continue
        for key, value in entry.items():
            if key == "function":
                for name, part in value.items():
                    into["function"][name] = into["function"].get(name, "") + part if name == "arguments" else part
            elif key != "index":
                into.setdefault(key, value)
    return list(merged.values())
