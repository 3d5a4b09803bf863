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
cache is automatic), `parallel_tool_calls` and `max_tool_calls` (with no tools there are no calls).

Nothing is stored. `store` is accepted (OpenAI's default is true; the client omits it) but no
response is kept, so what needs a stored object is refused with a 400 naming it:
`previous_response_id`, `conversation`, `prompt` (stored prompt templates), `background`, and
`item_reference` input items. Refused too, as they would otherwise be ignored: non-empty `tools`
and a `tool_choice` other than "none"/"auto" (tool calling comes separately), function_call and
other non-message input items, image/file/audio parts, `reasoning` asking for effort or summaries
(the served models do not reason), `text.verbosity` other than "medium", `truncation: "auto"` (an
input that does not fit is refused, never cut), a `service_tier` other than "auto"/"default",
`stream_options.include_obfuscation: true`. Unlike chat completions, unknown fields are refused
rather than ignored: every field a Responses client sends is either honoured or named in a 400.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from quart import Response, jsonify

from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.server import sampling, sse
from jaxserve.server.errors import ApiError, error_event
from jaxserve.server.generation import Flight, ServerState, attach_grammar
from jaxserve.server.openai import chat_logprobs, parse
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec
from jaxserve.tokenizer import ChatTemplateError

LOGPROBS = "message.output_text.logprobs"  # the one `include` value we can fill


# ---- request ------------------------------------------------------------------------------------
class _Forbid(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextConfig(_Forbid):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(_Forbid):
    include_obfuscation: bool = False


class ResponsesRequest(_Forbid):
    """The body `client.responses.create` sends; a field not declared here is refused (400)."""

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
    # Accepted and echoed; they change nothing here (module docstring).
    store: bool | None = None
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


_STORED = "nothing is stored here (store is accepted, no response is kept); send the whole conversation as input"


def _bad_metadata(r: ResponsesRequest) -> bool:
    pairs = r.metadata or {}
    return len(pairs) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in pairs.items())


def _obfuscation(r: ResponsesRequest) -> bool:
    return r.stream_options is not None and r.stream_options.include_obfuscation


# (parameter, is it set to something we cannot honour, why): validation as data.
_REFUSED: tuple[tuple[str, Callable[[ResponsesRequest], bool], str], ...] = (
    ("previous_response_id", lambda r: r.previous_response_id is not None, _STORED),
    ("conversation", lambda r: r.conversation is not None, _STORED),
    ("prompt", lambda r: r.prompt is not None, "stored prompt templates are not available; send instructions"),
    ("background", lambda r: bool(r.background), "background responses need a stored response to poll"),
    ("tools", lambda r: bool(r.tools), "tools are not supported yet"),
    ("tool_choice", lambda r: r.tool_choice not in (None, "none", "auto"),
     "only 'none' and 'auto' are accepted while tools are not supported"),
    ("reasoning", lambda r: any(v not in (None, "none") for v in (r.reasoning or {}).values()),
     "the served model does not reason; only effort 'none' (or null) is accepted"),
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
    ("metadata", _bad_metadata, "at most 16 pairs, keys up to 64 characters, values up to 512"),
)


def refuse_unhonoured(req: ResponsesRequest) -> None:
    for param, refused, why in _REFUSED:
        if refused(req):
            raise ApiError(400, f"{param}: {why}", param)


# ---- input items -> chat messages ---------------------------------------------------------------
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_WHY = {
    "function_call": "tool calling is not supported yet",
    "function_call_output": "tool calling is not supported yet",
    "item_reference": "nothing is stored to refer to",
    "reasoning": "the served model does not reason",
}


def chat_messages(req: ResponsesRequest) -> list[dict[str, str]]:
    """The conversation as the chat template takes it, `instructions` first as a system message."""
    if req.input is None:
        raise ApiError(400, "input: required (nothing is stored to continue from)", "input")
    if not req.input:
        raise ApiError(400, "input: must not be empty", "input")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    return head + [_message(item, f"input[{i}]") for i, item in enumerate(items)]


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


def prompt_ids(state: ServerState, req: ResponsesRequest) -> list[int]:
    try:
        return state.tokenizer.encode_chat(chat_messages(req), add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, f"chat template: {e}", "input") from e


# ---- sampling and text.format -------------------------------------------------------------------
_FIELDS = (sampling.Field("temperature", "temperature", 1.0), sampling.Field("top_p", "top_p", 1.0))


def sampling_params(req: ResponsesRequest) -> SamplingParams:
    num_top = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
    return sampling.build(_FIELDS, lambda name: getattr(req, name), max_tokens=req.max_output_tokens,
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
    """One response as it is generated: its text so far, and its Response object at any point."""

    def __init__(self, state: ServerState, req: ResponsesRequest, num_prompt: int, fmt: dict[str, Any]):
        self.state, self.req, self.num_prompt, self.fmt = state, req, num_prompt, fmt
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"  # OpenAI's spelling
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.num_output = self.num_cached = 0
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.num_top = req.top_logprobs or 0

    def add(self, delta: RequestOutput) -> tuple[str, list[dict[str, Any]]]:
        """Take one engine delta; its new text and logprobs."""
        self.num_cached = delta.num_cached_tokens
        text, logprobs = "", []
        for o in delta.outputs:
            text += o.text
            self.num_output += len(o.token_ids)
            if o.logprobs is not None:
                logprobs += chat_logprobs(self.state, o.logprobs, self.num_top)["content"]
            if o.finish_reason is not None:
                self.finish_reason = o.finish_reason
                self.completed_at = int(time.time())
                if o.finish_reason not in ("stop", "length"):  # aborted, or cut by --request-timeout
                    self.fail(f"generation ended early: {o.stop_reason or o.finish_reason}")
        self.text += text
        self.logprobs += logprobs
        return text, logprobs

    def fail(self, message: str) -> None:
        self.error = {"code": "server_error", "message": message}

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return {None: "in_progress", "stop": "completed"}.get(self.finish_reason, "incomplete")

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def item(self) -> dict[str, Any]:
        status = self.status if self.status in ("in_progress", "completed") else "incomplete"
        content = [] if status == "in_progress" else [self.part()]  # the part is announced by its own events
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def body(self) -> dict[str, Any]:
        req, status = self.req, self.status
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": self.completed_at if status == "completed" else None, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.state.model_name, "output": [self.item()] if done else [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "service_tier": "default",
            "store": False, "background": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "top_logprobs": self.num_top,
            "text": {"format": self.fmt, "verbosity": "medium"}, "tool_choice": req.tool_choice or "auto",
            "tools": [], "truncation": "disabled", "user": req.user, "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        # No prompt-cache writes are billed here, so cache_write_tokens is always 0.
        return {"input_tokens": self.num_prompt,
                "input_tokens_details": {"cached_tokens": self.num_cached, "cache_write_tokens": 0},
                "output_tokens": self.num_output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt + self.num_output}


_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


async def _events(reply: Reply, flight: Flight) -> AsyncIterator[bytes]:
    """The Responses event stream: lifecycle, one message item with one output_text part, its
    deltas, then the closing events; a failure mid-stream sends `error`, then response.failed."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\n" + sse.event({"type": kind, "sequence_number": next(numbers),
                                                                **fields})

    where = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=reply.body())
    yield event("response.in_progress", response=reply.body())
    yield event("response.output_item.added", output_index=0, item=reply.item())
    yield event("response.content_part.added", **where, part=reply.part())  # empty so far
    try:
        async for delta in flight.streams[0]:
            text, logprobs = reply.add(delta)
            if text or logprobs:
                yield event("response.output_text.delta", **where, delta=text, logprobs=logprobs)
    except Exception as e:  # noqa: BLE001 -- any failure after the headers ends the stream as an event
        error = error_event(e, "openai")["error"]
        reply.fail(error["message"])
        yield event("error", code=error["code"], message=error["message"], param=error["param"])
        yield event("response.failed", response=reply.body())
        return
    yield event("response.output_text.done", **where, text=reply.text, logprobs=reply.logprobs)
    yield event("response.content_part.done", **where, part=reply.part())
    yield event("response.output_item.done", output_index=0, item=reply.item())
    yield event(_LAST_EVENT[reply.status], response=reply.body())


async def responses(state: ServerState) -> Response:
    """OpenAI Responses API: one assistant message through the chat template; nothing is stored."""
    req = await parse(ResponsesRequest)
    state.model_names.check(req.model)
    refuse_unhonoured(req)
    prompt = prompt_ids(state, req)
    params = sampling_params(req)
    fmt, spec = text_format(req)
    await attach_grammar(state, params, spec)
    reply = Reply(state, req, len(prompt), fmt)
    async with state.admit() as flight:
        await submit(flight, reply.id, prompt, params)
        if req.stream:
            return sse.sse_response(flight.respond(_events(reply, flight)))
        (result,) = await flight.collect()
    reply.add(result)
    return jsonify(reply.body())
