"""OpenAI chat completions (/v1/chat/completions, also under /v3): messages through the chat
template, reasoning split from the answer, tool calls (forced, or the model's own under
--tool-call-parser), constraints composed after the think block, and the stream of
chat.completion.chunk deltas. The shared pieces
(parsing, sampling fields, usage and logprob shapes) are jaxserve.server.openai's."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from quart import Response, jsonify

from jaxserve.server import reasoning, sse, tool_parsers
from jaxserve.server.errors import ApiError, error_event, not_supported
from jaxserve.server.generation import ServerState, attach_grammar, merged, new_id
from jaxserve.server.openai import (
    _Usage,
    _usage_options,
    chat_logprobs,
    chat_messages,
    chat_prompt,
    guide_spec,
    parse,
    sampling_params,
    usage,
    vllm_prompt_logprobs,
)
from jaxserve.server.openai_protocol import ChatCompletionRequest
from jaxserve.server.tools import ForcedTools, forced_tools, function_schemas
from jaxserve.structured import compose
from jaxserve.structured import spec as guide
from jaxserve.structured.reasoning_cap import ReasoningCapGrammar


# ---- /v1/chat/completions -------------------------------------------------------------------------
@dataclasses.dataclass
class _Plan:
    """How one request's outputs become messages: where the think block is, and whose tool calls
    are read (forced through a constraint, or the model's own syntax for tool_choice "auto")."""

    parser: str | None  # --reasoning-parser
    opened: bool  # the output starts inside the think block
    forced: ForcedTools | None
    tool_format: tool_parsers.ToolFormat | None  # tool_choice "auto" under --tool-call-parser
    schemas: dict[str, dict[str, Any]]


async def chat_completions(state: ServerState) -> Response:
    """OpenAI chat completions, with vLLM's sampling and chat-template extras."""
    req = await parse(ChatCompletionRequest)
    state.model_names.check(req.model)
    if req.continue_final_message:
        raise not_supported("continue_final_message", "continue_final_message")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs to be true", "top_logprobs")
    if req.reasoning_max_tokens is not None:
        if req.reasoning_max_tokens < 1:
            raise ApiError(400, f"reasoning_max_tokens: must be at least 1, got {req.reasoning_max_tokens}",
                           "reasoning_max_tokens")
        if state.reasoning_parser is None:
            raise ApiError(400, "reasoning_max_tokens: needs a reasoning model served with --reasoning-parser",
                           "reasoning_max_tokens")
    tools_on = bool(req.tools) and req.tool_choice != "none"
    schemas = function_schemas(req.tools) if req.tools else {}
    forced = forced_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    auto = tools_on and forced is None and state.tool_parser is not None
    token_messages = isinstance(req.messages[0], int)  # FastDeploy: the prompt's token ids as `messages`
    if token_messages and req.prompt_token_ids is not None:
        raise ApiError(400, "messages: token ids here are the prompt; do not also send prompt_token_ids",
                       "messages")
    if req.prompt_token_ids is not None or token_messages:
        prompt = list(req.prompt_token_ids if req.prompt_token_ids is not None else req.messages)  # type: ignore[arg-type]
    elif req.disable_chat_template:
        prompt = state.tokenizer.encode("".join(m["content"] for m in chat_messages(req.messages)
                                                if isinstance(m.get("content"), str)))
        if not prompt:
            raise ApiError(400, "messages: no text to prompt with (disable_chat_template joins their content)",
                           "messages")
    else:
        prompt = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template,
                             req.chat_template_kwargs, req.tools if tools_on else None)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    plan = _Plan(state.reasoning_parser, False, forced,
                 tool_parsers.FORMATS[state.tool_parser] if auto and state.tool_parser else None, schemas)
    think = None
    if plan.parser is not None:
        tail = _prompt_tail(state, prompt)
        plan.opened = reasoning.opens_in_reasoning(plan.parser, tail)
        if plan.opened or reasoning.may_open(plan.parser, tail):
            think = compose.Reasoning(opened=plan.opened, may_open=not plan.opened)
    constraint = _constraint(state, req, plan, think)
    if plan.tool_format is not None and plan.tool_format.keep_special_tokens:
        params.skip_special_tokens = False  # its trigger is a special token, written as it is
        params.spaces_between_special_tokens = False
    await attach_grammar(state, params, constraint)
    if req.reasoning_max_tokens is not None and think is not None:
        params.grammar = await _cap_reasoning(state, params.grammar, req.reasoning_max_tokens, plan.opened)
    request_id = new_id("chatcmpl")
    async with state.admit() as flight:
        await flight.submit(request_id, prompt, params, req.priority)
        if req.stream:
            return sse.sse_response(flight.respond(_chat_stream(state, req, request_id, prompt, flight.streams, plan)))
        (res,) = await flight.collect()
    choices = []
    for o in res.outputs:
        choice = {"index": o.index, "message": {"role": "assistant"} | _message(o.text, o.finish_reason, plan),
                  "logprobs": (chat_logprobs(state, o.logprobs, req.top_logprobs or 0)
                               if o.logprobs is not None else None),
                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        if choice["message"].get("tool_calls"):
            choice["finish_reason"] = _tool_finish(plan.forced, o.finish_reason)
        if req.return_token_ids:
            choice["token_ids"] = o.token_ids  # vLLM's place; the message carries both lists too
            choice["message"] |= {"prompt_token_ids": prompt, "completion_token_ids": o.token_ids}
        choices.append(choice)
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(len(prompt), sum(len(o.token_ids) for o in res.outputs),
                                              res.num_cached_tokens),
            "system_fingerprint": None}
    if plan.parser is not None:  # a few full decodes per output: off the event loop
        counts = await asyncio.to_thread(lambda: [reasoning.reasoning_tokens(o.token_ids, state.tokenizer.decode,
                                                                             plan.opened) for o in res.outputs])
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt
    if req.prompt_logprobs is not None and res.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(state, res.prompt_logprobs)  # vLLM: top level for chat
    return jsonify(body)


def _prompt_tail(state: ServerState, prompt: list[int]) -> str:
    """The prompt's last text (where a template opens or closes a think block). Ids outside the
    vocabulary are left to submit, which refuses them with a 400."""
    known = len(state.tokenizer.hf)  # not vocab_size: an embedding padded past the tokenizer
    return state.tokenizer.decode([t for t in prompt[-16:] if 0 <= t < known])


def _constraint(state: ServerState, req: ChatCompletionRequest, plan: _Plan,
                think: compose.Reasoning | None) -> guide.GuideSpec | None:
    """The request's one constraint on its answer, after the think block when there is one."""
    answer: guide.GuideSpec | compose.ToolRules | None = guide.only_one(
        [guide_spec(req), plan.forced.spec if plan.forced else None])
    if plan.tool_format is not None:
        # Free text with calls in it; with a format of its own, the answer is calls or that format.
        answer = compose.ToolRules(plan.tool_format.lark(plan.schemas, req.parallel_tool_calls is not False,
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
    compiler = state.grammars if state._grammars is not None else await asyncio.to_thread(lambda: state.grammars)
    vocabulary = compiler.vocabulary
    end_ids = state.tokenizer.encode(reasoning.END, add_special_tokens=False)
    return ReasoningCapGrammar(inner, vocabulary.tokens, end_ids, max_tokens, opened, vocabulary.size)


def _message(text: str, finish_reason: str | None, plan: _Plan) -> dict[str, Any]:
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


def _tool_finish(forced: ForcedTools | None, finish_reason: str | None) -> str | None:
    if forced is None:  # the model's own calls: "tool_calls" unless it was cut off
        return "tool_calls" if finish_reason == "stop" else finish_reason
    # vLLM's choice: a named function ends as an ordinary "stop"; "required" says "tool_calls".
    return "stop" if forced.function is not None else "tool_calls"


class _OutputStream:
    """One output's text, piece by piece, as a delta: reasoning_content, content, tool_calls."""

    def __init__(self, plan: _Plan):
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
        if text or not (finish_reason or thought or calls):
            body["content"] = text
        if calls:
            body["tool_calls"] = calls
        return body


async def _chat_stream(state: ServerState, req: ChatCompletionRequest, request_id: str, prompt: list[int],
                       streams: list, plan: _Plan) -> AsyncIterator[bytes]:
    """Each delta's text split into reasoning_content, content and tool_calls (_OutputStream); a
    piece of a tag or trigger is held back until the next token decides it."""
    created = int(time.time())
    include_usage, continuous = _usage_options(req)
    total = _Usage([prompt])
    outputs = {i: _OutputStream(plan) for i in range(req.n)}
    output_ids: dict[int, list[int]] = {i: [] for i in range(req.n)}  # with a parser: for reasoning_tokens
    closed_at: dict[int, int] = {}  # reasoning tokens of an output whose block has closed

    def reasoning_count(i: int) -> int:
        # From the tokens' own text, not the streamed text (which the detokenizer may still hold
        # back for a stop string): the same count as the whole reply's, and it never goes down.
        # Kept once the block has closed.
        if i not in closed_at:
            count, closed = reasoning.count_reasoning_tokens(output_ids[i], state.tokenizer.decode, plan.opened)
            if not closed:
                return count
            closed_at[i] = count
        return closed_at[i]

    def usage_body() -> dict[str, Any]:
        body = total.body()
        if plan.parser is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": sum(map(reasoning_count, range(req.n)))}
        return body

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "choices": choices, "system_fingerprint": None, **extra}
        if include_usage:
            body["usage"] = usage_body() if continuous else None
        return sse.event(body)

    try:
        # The role comes first, before any token, as OpenAI sends it.
        for index in range(req.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}],
                        **({"prompt_token_ids": prompt} if req.return_token_ids and index == 0 else {}))
        async for i, delta in merged(streams):
            total.add(i, delta)
            for o in delta.outputs:
                if plan.parser is not None:
                    output_ids[o.index].extend(o.token_ids)
                out = outputs[o.index]
                delta_body = out.delta(o.text, o.finish_reason)
                finish = o.finish_reason
                if finish is not None and out.called:
                    finish = _tool_finish(plan.forced, finish)
                choice = {"index": o.index, "delta": delta_body, "logprobs": None,
                          "finish_reason": finish, "stop_reason": o.stop_reason}
                if o.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(state, o.logprobs, req.top_logprobs or 0)
                if req.return_token_ids:
                    choice["token_ids"] = o.token_ids
                yield chunk([choice])
        if include_usage:
            yield sse.event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": state.model_name, "choices": [], "usage": usage_body()})
    except Exception as e:
        yield sse.event(error_event(e, "openai"))
    yield sse.DONE
