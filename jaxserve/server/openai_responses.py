"""OpenAI's Responses API (POST /v1/responses): one assistant message generated through the chat
template, answered whole or as the Responses event stream, in the shapes the official client's
`client.responses.create(...)` reads. Parsing, structured output and logprob entries are chat
completions' (jaxserve.server.openai).

Honoured: `input` (a string, or message items with role user/system/developer/assistant whose
content is a string or input_text/output_text parts, joined as chat completions joins text
parts), `instructions` (a system message placed first), `max_output_tokens` (an output it cuts
ends with status "incomplete", incomplete_details.reason "max_output_tokens"), `temperature`,
`top_p`, `text.format` (text, json_object, json_schema; `strict: false` gets the strict
constraint, which any output it allows also satisfies), `include:
["message.output_text.logprobs"]` with `top_logprobs`, `stream`. A generation aborted or cut by
--request-timeout ends with status "failed" and the reason in `error`. Echoed back and otherwise
changing nothing here: `metadata`, `user`, `safety_identifier`, `prompt_cache_key` (the prefix
cache is automatic) and `max_tool_calls` (jaxserve.server.accepted_fields.RESPONSES says why).

Responses are stored (`store`, true by default as in OpenAI's API) in memory, the last
--max-stored-responses of them (jaxserve.server.response_store): `previous_response_id` continues
one (its input and output come before the request's own input; its `instructions` do not carry
over, as in OpenAI's), and `GET` / `DELETE /v1/responses/{id}` and `GET .../input_items` read and
forget them. With `store: false`, or --max-stored-responses 0, nothing is kept. `background: true`
(stored responses only) answers once the request is admitted, status "in_progress", and the
generation runs on: `GET` polls it, `POST /v1/responses/{id}/cancel` stops it ("cancelled", and
a stream of it ends without a closing event: OpenAI's have none for that). With `stream: true`
too, its events are streamed as they happen and kept (jaxserve.server.event_log): the generation
goes on if the connection drops, and `GET /v1/responses/{id}?stream=true&starting_after=N`
resumes after event N, while it runs and after it has finished. `conversation` (an id from the
Conversations API, jaxserve.server.conversations) puts the conversation's items before the input
and adds the input and output to it once the response has completed or reached
max_output_tokens; it cannot be combined with `previous_response_id`. What needs more than that is
refused with a 400 naming it: `prompt` (stored prompt templates) and `item_reference` input
items. Refused too, as they would otherwise be ignored: hosted tools (web search, file search,
MCP, ...), input items other than messages, function calls and their outputs
(and reasoning under a reasoning parser), image/file/audio parts, `reasoning` asking for effort or summaries
(the amount of thinking is the model's own), `text.verbosity` other than "medium", `truncation: "auto"` (an
input that does not fit is refused, never cut), a `service_tier` other than "auto"/"default",
`stream_options.include_obfuscation: true`. Unknown fields are refused rather than ignored, as on
every route (accepted_fields): every field a Responses client sends is either honoured or named in
a 400.

Under --reasoning-parser the think block is a `reasoning` output item (its text as `reasoning_text`
content, no summary) before the message, streamed as `response.reasoning_text.delta` events; its
tokens are counted in `output_tokens_details.reasoning_tokens`, `text.format` binds only the answer
after it, and the message's logprobs are the answer's tokens'. Reasoning items sent back in `input`
become the next assistant message's `reasoning_content` (what chat templates read).

Function tools (`tools` of type function, `tool_choice`, `parallel_tool_calls`) work as on chat
completions (jaxserve.server.answers): a named function or "required" constrains the output to the
call; "auto" reads the model's own calls under --tool-call-parser. Calls come back as
`function_call` items (streamed as `response.function_call_arguments.delta`), and `function_call` /
`function_call_output` input items carry the conversation's earlier calls and results to the
template (jaxserve.server.responses_tools).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field
from quart import Response, jsonify, request

from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.server import accepted_fields, answers, conversations, reasoning, responses_tools, sampling, sse
from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.conversation_store import Conversation
from jaxserve.server.errors import ApiError, error_event
from jaxserve.server.event_log import EventLog
from jaxserve.server.generation import Flight, ServerState
from jaxserve.server.openai import chat_logprobs, draft_counts, parse, prediction_details
from jaxserve.server.response_store import StoredResponse, with_ids
from jaxserve.server.tools import forced_tools, function_schemas
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec
from jaxserve.tokenizer import ChatTemplateError

logger = logging.getLogger("jaxserve.server")

LOGPROBS = "message.output_text.logprobs"  # the one `include` value we can fill


# ---- request ------------------------------------------------------------------------------------
class _Forbid(KnownFields):
    model_config = ConfigDict(strict=True)


class TextConfig(_Forbid):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(_Forbid):
    include_obfuscation: bool = False


class ResponsesRequest(_Forbid):
    """The body `client.responses.create` sends; a field not declared here is refused (400)."""

    IGNORED = accepted_fields.RESPONSES  # all declared: type-checked and echoed, otherwise unused

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # kept for previous_response_id and GET (jaxserve.server.response_store)
    # Accepted and echoed; they change nothing here (module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Refused unless absent or off (_REFUSED).
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None


def _obfuscation(r: ResponsesRequest) -> bool:
    return r.stream_options is not None and r.stream_options.include_obfuscation


# (parameter, is it set to something we cannot honour, why): validation as data.
_REFUSED: tuple[tuple[str, Callable[[ResponsesRequest], bool], str], ...] = (
    ("prompt", lambda r: r.prompt is not None, "stored prompt templates are not available; send instructions"),
    ("reasoning", lambda r: any(v not in (None, "none") for v in (r.reasoning or {}).values()),
     "neither the amount of reasoning nor summaries can be asked for; only effort 'none' (or null) is accepted"),
    ("text.verbosity", lambda r: r.text is not None and r.text.verbosity not in (None, "medium"),
     "only 'medium' is accepted: the served model has no verbosity control"),
    ("truncation", lambda r: r.truncation == "auto",
     "an input that does not fit is refused, never cut; use 'disabled'"),
    ("service_tier", lambda r: r.service_tier not in (None, "auto", "default"),
     "there is one tier: 'auto' or 'default'"),
    ("stream_options", lambda r: r.stream_options is not None and not r.stream, "only with stream: true"),
    ("stream_options.include_obfuscation", _obfuscation, "no obfuscation padding is sent; set it to false"),
    ("include", lambda r: any(i != LOGPROBS for i in r.include or ()), f"only {LOGPROBS!r} is available"),
    ("top_logprobs", lambda r: bool(r.top_logprobs) and LOGPROBS not in (r.include or ()),
     f"needs include: [{LOGPROBS!r}]"),
    ("metadata", lambda r: conversations.metadata_refused(r.metadata), conversations.METADATA_LIMITS),
)


def refuse_unhonoured(req: ResponsesRequest) -> None:
    for param, refused, why in _REFUSED:
        if refused(req):
            raise ApiError(400, f"{param}: {why}", param)


# ---- input items -> chat messages ---------------------------------------------------------------
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_WHY = {
    "item_reference": "items are not referred to by id here; continue a stored response with previous_response_id",
    "reasoning": "the served model is not served with --reasoning-parser",
}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as items (a string is one user message)."""
    if req.input is None:
        raise ApiError(400, "input: required", "input")
    if not req.input:
        raise ApiError(400, "input: must not be empty", "input")
    return [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def chat_messages(req: ResponsesRequest, reasons: bool = False, previous: list[dict[str, Any]] | None = None,
                  previous_name: str = "previous_response_id") -> list[dict[str, str]]:
    """The conversation as the chat template takes it, `instructions` first as a system message,
    then `previous` (a stored response's conversation, or a conversation's items: errors name them
    `previous_name[i]`) and the request's input; with a reasoning model, reasoning items go to the
    next assistant message."""
    named = [(f"{previous_name}[{i}]", item) for i, item in enumerate(previous or [])]
    named += [(f"input[{i}]", item) for i, item in enumerate(input_items(req))]
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    return system + items_to_chat(named, reasons)


def items_to_chat(named: list[tuple[str, Any]], reasons: bool) -> list[dict[str, str]]:
    """Responses items, each with the name its errors give it (400s), as chat messages; a function
    call's output must answer a call made before it."""
    out: list[dict[str, str]] = []
    thought: list[str] = []
    for where, item in named:
        kind = item.get("type") if isinstance(item, dict) else None
        if reasons and kind == "reasoning":
            thought.append(_reasoning_text(item, where))
            continue
        if kind == "function_call":
            if thought:  # the thinking before these calls belongs to their turn
                out.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(thought)})
                thought = []
            responses_tools.add_call(out, item, where)
            continue
        if kind == "function_call_output":
            out.append(responses_tools.call_output(out, item, where))
            continue
        message = _message(item, where)
        if thought and message["role"] == "assistant":
            message["reasoning_content"] = "\n".join(thought)
            thought = []
        out.append(message)
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "reasoning_text"
                                              and isinstance(p.get("text"), str) for p in parts):
        raise ApiError(400, f"{where}.content: expected reasoning_text parts", f"{where}.content")
    return "".join(p["text"] for p in parts)


def _message(item: dict[str, Any], where: str) -> dict[str, str]:
    kind = item.get("type", "message")  # EasyInputMessage leaves the type out
    if kind != "message":
        why = _ITEM_WHY.get(kind, "only message items are")
        raise ApiError(400, f"{where}.type: {kind!r} items are not supported ({why})", f"{where}.type")
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise ApiError(400, f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: expected a string or a list of parts", f"{where}.content")
    return {"role": role, "content": "\n".join(_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(content))}


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise ApiError(400, f"{where}.type: {kind!r} parts are not supported (only input_text and output_text)",
                       f"{where}.type")
    if not isinstance(part.get("text"), str):
        raise ApiError(400, f"{where}.text: expected a string", f"{where}.text")
    return part["text"]


def prompt_ids(state: ServerState, req: ResponsesRequest, tools: list[dict[str, Any]] | None = None,
               previous: list[dict[str, Any]] | None = None, previous_name: str = "previous_response_id") -> list[int]:
    try:
        return state.tokenizer.encode_chat(chat_messages(req, state.reasoning_parser is not None, previous,
                                                         previous_name),
                                           add_generation_prompt=True, tools=tools)
    except ChatTemplateError as e:
        raise ApiError(400, f"chat template: {e}", "input") from e


# ---- sampling and text.format -------------------------------------------------------------------
_FIELDS = (sampling.Field("temperature", "temperature", 1.0), sampling.Field("top_p", "top_p", 1.0))


def sampling_params(req: ResponsesRequest, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`defaults`: the model's (ServerState.sampling_defaults)."""
    num_top = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
    return sampling.build(_FIELDS, lambda name: getattr(req, name), defaults, max_tokens=req.max_output_tokens,
                          logprobs=num_top)


def text_format(req: ResponsesRequest) -> tuple[dict[str, Any], GuideSpec | None]:
    """The format echoed in the response, and its structured-output constraint."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, guide.json_object("text.format")
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or "schema" not in fmt:
            raise ApiError(400, "text.format: json_schema needs a name and a schema", "text.format")
        return fmt, guide.json_schema(fmt["schema"], "text.format.schema")
    raise ApiError(400, f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "text.format.type")


# The engine names its limits in completions' words.
_ENGINE_PARAMS = {"prompt": "input", "max_tokens": "max_output_tokens"}


async def submit(flight: Flight, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    try:
        await flight.submit(request_id, prompt, params)
    except InvalidRequestError as e:
        param = _ENGINE_PARAMS.get(e.param, e.param)
        detail = str(e).partition(": ")[2].replace("max_tokens", "max_output_tokens")
        raise ApiError(400, f"{param}: {detail}", param) from e


# ---- the Response object ------------------------------------------------------------------------
class Reply:
    """One response as it is generated: its reasoning, answer text and function calls so far, the
    order its output items appeared in, and its Response object at any point. `add` reports what
    each engine delta changed, as steps the event stream turns into events."""

    def __init__(self, state: ServerState, req: ResponsesRequest, num_prompt: int, fmt: dict[str, Any],
                 plan: answers.OutputPlan):
        self.state, self.req, self.num_prompt, self.fmt = state, req, num_prompt, fmt
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"  # OpenAI's spelling
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.text = ""  # the answer
        self.reasoning = ""  # the think block's text (with a reasoning parser)
        self.plan = plan
        self.split = answers.OutputStream(plan)
        self.calls: dict[int, dict[str, str]] = {}  # index -> call_id, name, arguments, item id
        self.order: list[Any] = []  # "reasoning", "message", ("call", index): as they appeared
        self.reasoning_closed = False  # its item closed: the answer has begun
        self.counter = reasoning.ReasoningCounter(state.tokenizer.decode, plan.opened)
        self.token_logprobs: list[dict[str, Any]] = []  # one per output token
        self.num_output = self.num_cached = 0
        self.num_draft = self.num_accepted = 0  # speculative tokens proposed and accepted so far
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.num_top = req.top_logprobs or 0
        # Kept once finished: asked to be (store, OpenAI's default) on a server that stores.
        self.stored = state.responses is not None and req.store is not False
        self.cancelled = False  # a background response cancelled (POST /v1/responses/{id}/cancel)
        self.deleted = False  # deleted while it ran: not stored again
        self.conversation_id: str | None = None  # the conversation it reads and extends (`conversation`)
        self.added = False  # its items have gone to that conversation

    def add(self, delta: RequestOutput) -> list[tuple[Any, ...]]:
        """Take one engine delta; what it changed, in order: ("open", key), ("reasoning", text),
        ("text", text, logprobs), ("arguments", index, piece), ("close", key)."""
        self.num_cached = delta.num_cached_tokens
        self.num_draft, self.num_accepted = delta.num_draft_tokens, delta.num_accepted_draft_tokens
        text, sent, finish = "", len(self.logprobs), None
        for o in delta.outputs:
            text += o.text
            self.num_output += len(o.token_ids)
            self.counter.add(o.token_ids)
            if o.logprobs is not None:
                self.token_logprobs += chat_logprobs(self.state, o.logprobs, self.num_top,
                                                     self.state.return_tokens_as_token_ids)["content"]
            if o.finish_reason is not None:
                finish = self.finish_reason = o.finish_reason
                self.completed_at = int(time.time())
                if o.finish_reason not in ("stop", "length") and not self.cancelled:  # aborted, or timed out
                    self.fail(f"generation ended early: {o.stop_reason or o.finish_reason}")
        parts = self.split.delta(text, finish)
        steps: list[tuple[Any, ...]] = []
        if parts.get("reasoning_content"):
            if "reasoning" not in self.order:
                steps.append(self._open("reasoning"))
            self.reasoning += parts["reasoning_content"]
            steps.append(("reasoning", parts["reasoning_content"]))
        logprobs = self.logprobs[sent:]
        if parts.get("content") or logprobs:
            steps += self._answering()
            if "message" not in self.order:
                steps.append(self._open("message"))
            self.text += parts.get("content", "")
            steps.append(("text", parts.get("content", ""), logprobs))
        for call in parts.get("tool_calls", []):
            steps += self._answering()
            k, fn = call["index"], call["function"]
            if "id" in call:
                self.calls[k] = {"call_id": call["id"], "name": fn["name"], "arguments": "",
                                 "id": f"fc_{uuid.uuid4().hex}"}
                steps.append(self._open(("call", k)))
            if fn.get("arguments"):
                self.calls[k]["arguments"] += fn["arguments"]
                steps.append(("arguments", k, fn["arguments"]))
        if finish is not None:
            steps += self._answering()
            if not self.calls and "message" not in self.order:  # an empty answer is still a message
                steps.append(self._open("message"))
            steps += [("close", key) for key in self.order if key != "reasoning"]
        return steps

    def _open(self, key: Any) -> tuple[Any, ...]:
        self.order.append(key)
        return ("open", key)

    def close_cancelled(self) -> list[tuple[Any, ...]]:
        """The steps that close the items a cancelled response left open: its engine stream ends
        when it is released, without a last delta to close them."""
        if not self.cancelled or self.finish_reason is not None:
            return []
        return self._answering() + [("close", key) for key in self.order if key != "reasoning"]

    def _answering(self) -> list[tuple[Any, ...]]:
        """The think block is over once the answer starts: its item closes first."""
        if "reasoning" in self.order and not self.reasoning_closed:
            self.reasoning_closed = True
            return [("close", "reasoning")]
        return []

    def reasoning_tokens(self) -> tuple[int, bool]:
        """(output tokens spent thinking, whether the block has closed)."""
        return self.counter.count() if self.plan.parser is not None else (0, False)

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """The answer's tokens' logprobs: none while the think block is open."""
        count, closed = self.reasoning_tokens()
        if self.plan.parser is not None and count and not closed:
            return []
        return self.token_logprobs[count:]

    def fail(self, message: str) -> None:
        self.error = {"code": "server_error", "message": message}

    @property
    def status(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.error is not None:
            return "failed"
        return {None: "in_progress", "stop": "completed"}.get(self.finish_reason, "incomplete")

    def _item_status(self) -> str:
        return self.status if self.status in ("in_progress", "completed") else "incomplete"

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def part(self, done: bool = True) -> dict[str, Any]:
        """The message's text part; not done: as announced when it opens, empty (a delta that opens
        the message also carries its first text, which goes out as the first output_text.delta)."""
        return {"type": "output_text", "text": self.text if done else "", "annotations": [],
                "logprobs": self.logprobs if done else []}

    def item(self, done: bool = True) -> dict[str, Any]:
        status = self._item_status() if done else "in_progress"
        content = [] if status == "in_progress" else [self.part()]  # the part is announced by its own events
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def reasoning_item(self, done: bool) -> dict[str, Any]:
        status = "in_progress" if not done else ("completed" if self.status != "failed" else "incomplete")
        thinking = self.split.thinking
        if done and thinking is not None and not thinking.ended:
            status = "incomplete"  # cut off while thinking
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": self.reasoning}] if done else [],
                "encrypted_content": None}

    def call_item(self, k: int, done: bool) -> dict[str, Any]:
        c = self.calls[k]
        return responses_tools.call_item(c["call_id"], c["name"], c["arguments"] if done else "",
                                         self._item_status() if done else "in_progress", c["id"])

    def item_of(self, key: Any, done: bool) -> dict[str, Any]:
        if key == "reasoning":
            return self.reasoning_item(done)
        if key == "message":
            return self.item(done)
        return self.call_item(key[1], done)

    def output(self) -> list[dict[str, Any]]:
        return [self.item_of(key, True) for key in self.order]

    def body(self) -> dict[str, Any]:
        req, status = self.req, self.status
        done = self.done
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": self.completed_at if status == "completed" else None, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.state.model_names.reported(req.model), "output": self.output() if done else [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "conversation": {"id": self.conversation_id} if self.conversation_id is not None else None,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "service_tier": "default",
            "store": self.stored, "background": bool(req.background),
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "top_logprobs": self.num_top,
            "text": {"format": self.fmt, "verbosity": "medium"}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        # No prompt-cache writes are billed here, so cache_write_tokens is always 0. Speculative
        # tokens take chat's predicted-output names (jaxserve.server.openai.usage).
        output_details: dict[str, int] = {"reasoning_tokens": self.reasoning_tokens()[0]}
        if (drafts := draft_counts(self.state, self.num_draft, self.num_accepted)) is not None:
            output_details |= prediction_details(*drafts)
        return {"input_tokens": self.num_prompt,
                "input_tokens_details": {"cached_tokens": self.num_cached, "cache_write_tokens": 0},
                "output_tokens": self.num_output, "output_tokens_details": output_details,
                "total_tokens": self.num_prompt + self.num_output}


_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


async def _events(reply: Reply, flight: Flight, keep: Callable[[], None]) -> AsyncIterator[bytes]:
    """The Responses event stream: lifecycle events, then each output item as it appears -- a
    reasoning item with its reasoning_text deltas, the message with one output_text part and its
    deltas, a function_call item with its argument deltas -- and the closing events. A failure
    mid-stream sends `error`, then response.failed. `keep` stores the finished response before
    its last event goes out (so a client may continue it as soon as it has read that)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\n" + sse.event({"type": kind, "sequence_number": next(numbers),
                                                                **fields})

    def index(key: Any) -> int:
        return reply.order.index(key)

    def where(key: Any) -> dict[str, Any]:
        item_id = {"reasoning": reply.reasoning_id, "message": reply.item_id}.get(key) or reply.calls[key[1]]["id"]
        return {"item_id": item_id, "output_index": index(key)}

    def events(step: tuple[Any, ...]) -> list[bytes]:
        kind, *rest = step
        if kind == "open":
            (key,) = rest
            out = [event("response.output_item.added", output_index=index(key), item=reply.item_of(key, False))]
            if key == "message":
                out.append(event("response.content_part.added", **where(key), content_index=0,
                                 part=reply.part(done=False)))
            return out
        if kind == "reasoning":
            return [event("response.reasoning_text.delta", **where("reasoning"), content_index=0, delta=rest[0])]
        if kind == "text":
            return [event("response.output_text.delta", **where("message"), content_index=0, delta=rest[0],
                          logprobs=rest[1])]
        if kind == "arguments":
            return [event("response.function_call_arguments.delta", **where(("call", rest[0])), delta=rest[1])]
        (key,) = rest
        if key == "reasoning":
            return [event("response.reasoning_text.done", **where(key), content_index=0, text=reply.reasoning),
                    event("response.output_item.done", output_index=index(key), item=reply.reasoning_item(True))]
        if key == "message":
            return [event("response.output_text.done", **where(key), content_index=0, text=reply.text,
                          logprobs=reply.logprobs),
                    event("response.content_part.done", **where(key), content_index=0, part=reply.part()),
                    event("response.output_item.done", output_index=index(key), item=reply.item())]
        call = reply.calls[key[1]]
        return [event("response.function_call_arguments.done", **where(key), name=call["name"],
                      arguments=call["arguments"]),
                event("response.output_item.done", output_index=index(key), item=reply.call_item(key[1], True))]

    yield event("response.created", response=reply.body())
    yield event("response.in_progress", response=reply.body())
    try:
        async for delta in flight.streams[0]:
            for step in reply.add(delta):
                for e in events(step):
                    yield e
        for step in reply.close_cancelled():
            for e in events(step):
                yield e
    except Exception as e:  # noqa: BLE001 -- any failure after the headers ends the stream as an event
        error = error_event(e, "openai")["error"]
        reply.fail(error["message"])
        yield event("error", code=error["code"], message=error["message"], param=error["param"])
        keep()
        yield event("response.failed", response=reply.body())
        return
    keep()
    last = _LAST_EVENT.get(reply.status)
    if last is not None:  # a cancelled background response: OpenAI's events have no closing one for it
        yield event(last, response=reply.body())


async def responses(state: ServerState) -> Response:
    """OpenAI Responses API: one assistant message through the chat template, stored when asked
    (module docstring)."""
    req = await parse(ResponsesRequest)
    lora = state.model_names.lora(req.model)
    refuse_unhonoured(req)
    if req.conversation is not None and req.previous_response_id is not None:
        raise ApiError(400, "conversation: cannot be used with previous_response_id (the conversation holds the "
                       "earlier turns)", "conversation")
    previous = None
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id) if state.responses is not None else None
        if previous is None:  # OpenAI's code, on which clients fall back to sending the whole conversation
            raise ApiError(400, f"previous_response_id: no stored response {req.previous_response_id!r} (responses "
                           f"are kept in memory, the last {_store_size(state)}, and only with store: true)",
                           "previous_response_id", code="previous_response_not_found")
        if previous.status == "in_progress":
            raise ApiError(400, f"previous_response_id: {req.previous_response_id!r} is still in progress; continue "
                           "it once it has finished", "previous_response_id")
    tools = responses_tools.chat_tools(req.tools)
    choice = responses_tools.chat_tool_choice(req.tool_choice)
    tools_on = bool(tools) and choice != "none"
    schemas = function_schemas(tools) if tools else {}
    forced = forced_tools(tools, choice, req.parallel_tool_calls)
    conversation = _conversation(state, req)
    earlier = previous.conversation if previous is not None else conversation.items if conversation else []
    prompt = prompt_ids(state, req, tools if tools_on else None, earlier,
                        "conversation" if conversation is not None else "previous_response_id")
    params = sampling_params(req, state.sampling_defaults)
    params.lora = lora
    fmt, spec = text_format(req)
    plan = answers.plan(state, prompt, forced, tools_on and forced is None, schemas)
    await answers.constrain(state, params, plan, spec, req.parallel_tool_calls is not False)
    reply = Reply(state, req, len(prompt), fmt, plan)
    reply.conversation_id = conversation.id if conversation is not None else None
    own = input_items(req)
    # Once: their ids stay the same however often the response is stored. Ids new to the
    # conversation, if there is one (it reads and deletes items by id).
    own_listed = (with_ids(own) if conversation is None
                  else conversations.with_unique_ids(own, conversation.items, "input"))

    def keep(events: tuple[bytes, ...] = ()) -> None:
        # A conversation gets the exchange once the response has an answer (completed, or cut at
        # max_output_tokens); a failed or cancelled one adds nothing, so it can be asked again.
        if conversation is not None and not reply.added and reply.status in ("completed", "incomplete"):
            reply.added = True
            if not conversations.store_of(state).add_items(conversation.id,
                                                           [*own_listed, *_continuable(reply.output())]):
                logger.warning("response %s: conversation %s is gone (deleted, or forgotten for newer ones) or "
                               "full; the exchange was not added to it", reply.id, conversation.id)
        if reply.stored and not reply.deleted and state.responses is not None:
            history = [*earlier, *own, *_continuable(reply.output())]
            if not state.responses.put(StoredResponse.of(reply.body(), own_listed, history, events)) and events:
                # Its events are most of its bytes: kept without them, it can still be read and
                # continued, only not streamed again.
                state.responses.put(StoredResponse.of(reply.body(), own_listed, history))

    if req.background:
        if not reply.stored:
            raise ApiError(400, "background: a background response is polled from the store; it needs store true "
                           "(and a server started with --max-stored-responses above 0)", "background")
        log = EventLog() if req.stream else None
        await _run_in_background(state, reply, prompt, params, keep, log)
        return jsonify(reply.body()) if log is None else sse.sse_response(log.follow())
    async with state.admit() as flight:
        await submit(flight, reply.id, prompt, params)
        if req.stream:
            return sse.sse_response(flight.respond(_events(reply, flight, keep)))
        (result,) = await flight.collect()
    reply.add(result)
    keep()
    return jsonify(reply.body())


def _conversation(state: ServerState, req: ResponsesRequest) -> Conversation | None:
    """The conversation the request names (`conversation`: its id, or an object with it)."""
    if req.conversation is None:
        return None
    named = req.conversation.get("id") if isinstance(req.conversation, dict) else req.conversation
    if not isinstance(named, str) or (isinstance(req.conversation, dict) and set(req.conversation) != {"id"}):
        raise ApiError(400, "conversation: expected a conversation id, or an object with just its id", "conversation")
    return conversations.conversation_of(state, named, "conversation")


def _continuable(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the next request's input: without logprobs (nothing reads
    them there, and they are most of a response's bytes), and without a function call cut off
    before its arguments were whole (no output could answer it; the text it was cut from stays)."""
    out = []
    for item in output:
        if item["type"] == "message":
            item = {**item, "content": [{k: v for k, v in part.items() if k != "logprobs"}
                                        for part in item["content"]]}
        elif item["type"] == "function_call":
            try:
                whole = isinstance(json.loads(item["arguments"]), dict)
            except ValueError:
                whole = False
            if not whole:
                continue
        out.append(item)
    return out


async def _run_in_background(state: ServerState, reply: Reply, prompt: list[int], params: SamplingParams,
                             keep: Callable[..., None], log: EventLog | None) -> None:
    """Admit and submit now (a full server or a refused request answers this request), then let
    the generation run on in a task of its own, outliving this HTTP exchange; it stores the
    response as it starts and again when it ends (GET /v1/responses/{id} polls it). log: a
    streamed one's events go there as they happen (its readers follow the log, and a reader that
    goes away stops nothing), and are stored with the finished response."""
    admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    def events() -> tuple[bytes, ...]:
        return tuple(log.events) if log is not None else ()

    async def run() -> None:
        result = None
        try:
            async with state.admit() as flight:
                await submit(flight, reply.id, prompt, params)
                state.background[reply.id] = (flight, reply, log)
                keep()
                if not admitted.done():
                    admitted.set_result(None)
                if log is None:
                    (result,) = await flight.collect()
                else:  # the stream's own failures end it as events (error, response.failed)
                    async for event in _events(reply, flight, keep):
                        log.append(event)
            if result is not None:
                reply.add(result)
        except asyncio.CancelledError:  # the event loop is closing: stored as it stands
            if reply.finish_reason is None:  # (one that has finished, and said so, stays as it is)
                reply.fail("the server shut down before the response finished")
            keep(events())
            raise
        except Exception as e:  # noqa: BLE001 -- refused before it started: this request's answer
            if not admitted.done():
                admitted.set_exception(e)
                return
            reply.fail(error_event(e, "openai")["error"]["message"])
        finally:
            state.background.pop(reply.id, None)
            if log is not None:
                log.close()
        keep(events())

    # A context of its own: the flight must not end with this exchange (end_flights_with_exchanges).
    # The task is held until it ends (the event loop keeps only a weak reference).
    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    state.background_tasks.add(task)
    task.add_done_callback(state.background_tasks.discard)
    await admitted


def _store_size(state: ServerState) -> int:
    return state.responses.max_entries if state.responses is not None else 0


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    found = state.responses.get(response_id) if state.responses is not None else None
    if found is None:
        raise ApiError(404, f"no stored response {response_id!r}", "response_id")
    return found


async def get_response(state: ServerState, response_id: str) -> Response:
    """A stored response (OpenAI's `responses.retrieve`), or with `stream=true` the events of a
    streamed background response after `starting_after` (all of them without it): those so far,
    then each as it happens while it runs. `include` is refused (nothing more to include)."""
    args = request.args
    for name in ("include", "include[]"):
        if name in args:
            raise ApiError(400, "include: a stored response is returned as it was answered, with nothing more to "
                           "include", "include")
    if args.get("include_obfuscation", "false").lower() != "false":
        raise ApiError(400, "include_obfuscation: no obfuscation padding is sent; set it to false",
                       "include_obfuscation")
    stream = args.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise ApiError(400, f"stream: must be true or false, got {args.get('stream')!r}", "stream")
    if stream == "false":
        if "starting_after" in args:
            raise ApiError(400, "starting_after: only with stream=true (it resumes a stream)", "starting_after")
        return jsonify(_stored(state, response_id).body)
    running = state.background.get(response_id)
    log = running[2] if running is not None else None
    # (A running one is read from its log even if newer responses have pushed it out of the store.)
    events = log.events if log is not None else _stored(state, response_id).events
    if not events:
        raise ApiError(400, f"stream: {response_id!r} was not a streamed background response, so it has no events "
                       "to stream again (created with background and stream true, it would); GET it without "
                       "stream", "stream")
    text = args.get("starting_after", "-1")
    after = int(text) if re.fullmatch(r"-?[0-9]{1,9}", text) else len(events)
    if not -1 <= after < len(events):
        raise ApiError(400, f"starting_after: must be the sequence_number of an event sent so far, from 0 to "
                       f"{len(events) - 1}, got {text!r}", "starting_after")
    if log is not None:
        return sse.sse_response(log.follow(after))
    return sse.sse_response(_replay(events[after + 1:]))


async def _replay(events: tuple[bytes, ...]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


async def delete_response(state: ServerState, response_id: str) -> Response:
    """Forget a stored response (OpenAI's `responses.delete`); a background one still running
    stops, and is not stored again when it ends."""
    _stored(state, response_id)
    running = state.background.get(response_id)
    if running is not None:
        flight, reply, _ = running
        reply.deleted = True
        _cancel(flight, reply)
    state.responses.delete(response_id)  # type: ignore[union-attr]  # _stored found the store
    return jsonify({"id": response_id, "object": "response", "deleted": True})


def _cancel(flight: Flight, reply: Reply) -> None:
    if reply.finish_reason is None:  # (one that has finished keeps its status)
        reply.cancelled = True
        flight.release()  # aborts its engine request: the generation ends at the next step


async def cancel_response(state: ServerState, response_id: str) -> Response:
    """Cancel a background response still running (OpenAI's `responses.cancel`): its generation
    stops and it is stored as it stands, status "cancelled". Cancelling one already cancelled
    answers it again; one that finished otherwise, or was not a background response, is a 400."""
    running = state.background.get(response_id)
    if running is None:
        found = _stored(state, response_id)  # 404 for an unknown id
        if found.status == "cancelled":
            return jsonify(found.body)
        raise ApiError(400, f"response_id: {response_id!r} is not a background response in progress; only those "
                       "can be cancelled", "response_id")
    flight, reply, _ = running
    _cancel(flight, reply)
    for _ in range(500):  # the task stores the response as its generation ends (at the next step)
        if response_id not in state.background:
            break
        await asyncio.sleep(0.01)
    return jsonify(reply.body())


async def list_input_items(state: ServerState, response_id: str) -> Response:
    """A stored response's own input items (OpenAI's `responses.input_items.list`): `order` "desc"
    (OpenAI's default) or "asc", `limit` 1-100 (20), `after` an item id."""
    return jsonify(conversations.page_from_query(_stored(state, response_id).input_items, "input item",
                                                 "this response"))
