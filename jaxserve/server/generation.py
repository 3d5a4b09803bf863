"""The routes' side of the engine: admission (--max-concurrent-requests), submission, deadlines,
metrics, and making sure every engine request ends when its HTTP request does.

A `Flight` is one HTTP request's hold on the engine, taken with `async with state.admit() as
flight:`. Whatever way the HTTP exchange ends — the response is complete, the client went away
(Quart cancels the handler or closes the body), or the body was never started — the Flight's
engine requests are aborted and its slot returned: a non-streamed response's flight ends with the
`async with`, a streamed one's with its body, and every flight at the latest with its exchange
(`end_flights_with_exchanges` wraps the app's ASGI entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.embeds import EmbedSpan, ImageItem
from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import SamplingParams
from jaxserve.server.conversation_store import ConversationStore
from jaxserve.server.errors import ApiError
from jaxserve.server.metrics import Metrics
from jaxserve.server.model_names import ModelNames
from jaxserve.server.response_store import ResponseStore
from jaxserve.config import StructuredOutputConfig
from jaxserve.multimodal.images import ImageSupport
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.spec import GuideSpec
from jaxserve.structured.vocabulary import token_vocabulary
from jaxserve.tokenizer import Tokenizer

TIMEOUT = "timeout"  # the finish reason of a request cut by --request-timeout


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: ModelNames  # what requests may name; the first is reported
    max_model_len: int
    max_concurrent_requests: int
    request_timeout: float | None
    metrics: Metrics
    structured: StructuredOutputConfig = StructuredOutputConfig()
    reasoning_parser: str | None = None  # --reasoning-parser (jaxserve.server.reasoning)
    tool_parser: str | None = None  # --tool-call-parser, resolved (jaxserve.server.tool_parsers)
    images: ImageSupport | None = None  # a vision-language model's image input (jaxserve.multimodal.images)
    # What a request leaves unset samples with: the model's generation_config.json (SamplingParams
    # fields; jaxserve.generation_config), before each protocol's own defaults.
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    runtime_lora: bool = False  # --enable-lora: LoRA adapters may be loaded while serving (lora_routes)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs show "token_id:N"
    responses: ResponseStore | None = None  # stored Responses-API responses (--max-stored-responses; None: 0)
    conversations: ConversationStore | None = None  # the Conversations API's (the same bound; None: 0)
    # Background Responses-API responses running now, by id: (their Flight, their Reply, their
    # EventLog or None when not streamed), and the tasks running them (held: the event loop keeps
    # only weak references).
    background: dict[str, tuple[Any, Any, Any]] = dataclasses.field(default_factory=dict)
    background_tasks: set = dataclasses.field(default_factory=set)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    draining: bool = False
    flights: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    _grammars: GrammarCompiler | None = None
    _grammars_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def model_name(self) -> str:
        return self.model_names.primary

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, built at first use (its vocabulary takes ~0.5 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                cfg = self.structured
                vocabulary = token_vocabulary(self.tokenizer.hf, list(self.engine.info.eos_ids))
                self._grammars = GrammarCompiler(vocabulary, self.tokenizer.hf, timeout_s=cfg.timeout_s,
                                                 max_index_bytes=cfg.max_mib << 20, cache_entries=cfg.cache_entries,
                                                 workers=cfg.workers)
            return self._grammars

    def close_grammars(self) -> None:
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()
                self._grammars = None

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator["Flight"]:
        """Admit one HTTP request, or refuse at once (503 draining, 429 full: no unbounded
        queue). The flight ends when the block exits, unless it handed its streams to a response
        body (`Flight.respond`), which then ends it."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.num_in_flight >= self.max_concurrent_requests:
            raise ApiError(429, f"the server is at --max-concurrent-requests ({self.max_concurrent_requests}); "
                           "retry later", code="too_many_requests")
        flight = Flight(self)
        try:
            yield flight
        finally:
            if not flight.responding:
                await flight.close()

    def abort_all(self) -> int:
        """End every in-flight request (their responses finish with finish_reason "abort")."""
        flights = list(self.flights)
        self.engine.abort_all()
        return len(flights)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def truncation_length(truncate: int, max_model_len: int) -> int:
    """vLLM's truncate_prompt_tokens as a token count: -1 means the context length; 0, other
    negatives and more than the context are refused (as vLLM does)."""
    if truncate == -1:
        return max_model_len
    if not 1 <= truncate <= max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens: must be -1 or in [1, {max_model_len}] (the maximum "
                       f"context length), got {truncate}", "truncate_prompt_tokens")
    return truncate


def truncate_prompt(prompt: list[int], images: Sequence[ImageItem], truncate: int | None,
                    max_model_len: int) -> tuple[list[int], list[ImageItem]]:
    """A generation prompt cut to its last `truncate_prompt_tokens` tokens (vLLM's left
    truncation), its images moved with it. An image the cut would split or drop is refused: its
    placeholder positions are the vision encoder's input, and half an image is no image."""
    if truncate is None:
        return prompt, list(images)
    cut = max(0, len(prompt) - truncation_length(truncate, max_model_len))
    if cut == 0:
        return prompt, list(images)
    # (An image's placeholders follow a start marker: a cut at its first one would drop the marker.)
    if any(item.offset <= cut for item in images):
        raise ApiError(400, f"truncate_prompt_tokens: keeping the last {len(prompt) - cut} of the prompt's "
                       f"{len(prompt)} tokens would cut an image out of it", "truncate_prompt_tokens")
    return prompt[cut:], [dataclasses.replace(item, offset=item.offset - cut) for item in images]


# The flights of the HTTP exchange being served (end_flights_with_exchanges).
_exchange_flights: contextvars.ContextVar[list["Flight"] | None] = contextvars.ContextVar("jaxserve_flights",
                                                                                            default=None)


def end_flights_with_exchanges(app: Any) -> None:
    """Wrap the app's ASGI entry so that every flight taken while serving an HTTP exchange ends
    when the exchange does, however it ends: even a streamed body the server never started (the
    client left before the response began) returns its slot and aborts its engine requests."""
    inner = app.asgi_app

    async def asgi_app(scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await inner(scope, receive, send)
        flights: list[Flight] = []
        token = _exchange_flights.set(flights)
        try:
            await inner(scope, receive, send)
        finally:
            _exchange_flights.reset(token)
            for flight in flights:
                flight.release()

    app.asgi_app = asgi_app


class Flight:
    def __init__(self, state: ServerState):
        self.state = state
        self.streams: list[EngineStream] = []
        self.closed = False
        self.responding = False  # a response body owns it (respond)
        state.num_in_flight += 1
        state.flights.add(self)
        exchange = _exchange_flights.get()
        if exchange is not None:
            exchange.append(self)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     priority: int = 0, images: Sequence[ImageItem] = (),
                     embeds: Sequence[EmbedSpan] = ()) -> "EngineStream":
        engine = self.state.engine
        try:
            inputs = {"images": images, "embeds": embeds} if images or embeds else {}
            inner = await engine.submit(request_id, prompt_ids, params, priority, **inputs)
        except asyncio.CancelledError:
            engine.abort(request_id)  # the engine may have queued it before we were cancelled
            raise
        stream = EngineStream(self.state, request_id, inner, len(prompt_ids))
        self.streams.append(stream)
        return stream

    async def collect(self) -> list[RequestOutput]:
        """Every stream's whole output (non-streaming responses)."""
        return list(await asyncio.gather(*(s.collect() for s in self.streams)))

    async def close(self) -> None:
        self.release()
        for s in self.streams:
            await s.aclose()

    def respond(self, body: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        """Hand the flight to a streamed response body, which closes it however it ends."""
        self.responding = True
        return self._guard(body)

    async def _guard(self, body: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.release()  # the engine requests end now, even if the awaits below are cancelled
            await body.aclose()  # stops merged()'s readers before the streams are closed under them
            await self.close()

    def release(self) -> None:
        """Return the slot and abort the engine requests still running (idempotent)."""
        if not self.closed:
            self.closed = True
            self.state.num_in_flight -= 1
            self.state.flights.discard(self)
            for s in self.streams:
                s.abort()


class EngineStream:
    """One engine request's deltas, with its deadline and its metrics."""

    def __init__(self, state: ServerState, request_id: str, inner: AsyncIterator[RequestOutput], num_prompt: int):
        self.state = state
        self.request_id = request_id
        self.inner = inner
        self.num_prompt = num_prompt
        self.finished = False
        self.timed_out = False
        self.start = time.monotonic()
        self.last_token: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        if state.request_timeout is not None:
            self.timer = asyncio.get_running_loop().call_later(state.request_timeout, self._deadline)

    def _deadline(self) -> None:
        # Abort rather than cancel: the engine then posts the final delta, which we relabel.
        self.timed_out = True
        self.state.engine.abort(self.request_id)

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.inner.__anext__()
        self._record(out)
        if out.finished:
            self.finished = True
            self._cancel_timer()
        if self.timed_out:
            for o in out.outputs:
                if o.finish_reason == "abort":
                    o.finish_reason, o.stop_reason = TIMEOUT, f"request timeout ({self.state.request_timeout}s)"
        return out

    async def collect(self) -> RequestOutput:
        total: RequestOutput | None = None
        try:
            async for delta in self:
                if total is None:
                    total = dataclasses.replace(delta, outputs=[])
                total.merge(delta)
        finally:
            await self.aclose()
        if total is None:
            raise ApiError(503, "the engine ended the request without output", code="engine_stopped")
        return total

    def abort(self) -> None:
        self._cancel_timer()
        if not self.finished:
            self.finished = True
            self.state.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()
        aclose: Any = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _record(self, out: RequestOutput) -> None:
        m = self.state.metrics
        now = time.monotonic()
        num_new = sum(len(o.token_ids) for o in out.outputs)
        if num_new:
            if self.last_token is None:
                m.ttft.observe(now - self.start)
            else:
                m.itl.observe((now - self.last_token) / num_new)
            self.last_token = now
            m.generation_tokens.inc(num_new)
        if out.finished:
            m.e2e.observe(now - self.start)
            m.prompt_tokens.inc(self.num_prompt)
            for o in out.outputs:
                if o.finish_reason is not None:
                    m.requests.inc(1, TIMEOUT if self.timed_out and o.finish_reason == "abort" else o.finish_reason)


async def merged(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams' deltas as they arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: EngineStream) -> None:
        try:
            async for delta in s:
                await queue.put((i, delta, None))
        except Exception as e:  # surfaced to the consumer in order
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def grammar_compiler(state: ServerState) -> GrammarCompiler:
    """The structured-output compiler; its first use builds it (~0.5 s) off the event loop."""
    return state.grammars if state._grammars is not None else await asyncio.to_thread(lambda: state.grammars)


async def attach_grammar(state: ServerState, params: SamplingParams, spec: GuideSpec | None) -> None:
    """Compile the request's constraint (cached, off the event loop) into params.grammar."""
    if spec is not None:
        params.grammar = await (await grammar_compiler(state)).get_async(spec)


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences to ban for each word, as vLLM does: with and without a leading space,
    since the word may start a new word or continue one."""
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise ApiError(400, "bad_words: entries must be non-empty words", "bad_words")
        for variant in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's own text, special tokens spelled out (the form logprobs show)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def route(app: Any, state: ServerState, rule: str, handler: Callable[..., Awaitable[Any]], method: str,
          body: type | None = None) -> None:
    """Register `handler(state, **url_args)` as an async view; `body` (a pydantic model) documents
    the request in /openapi.json."""

    async def view(**kwargs: Any) -> Any:
        return await handler(state, **kwargs)

    view.__doc__ = handler.__doc__
    view.request_model = body  # type: ignore[attr-defined]
    app.add_url_rule(rule, f"{method} {rule}", view, methods=[method])
