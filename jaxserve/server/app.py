"""The Quart app: shared state, auth, admission, errors, and every API family's routes; `serve`
runs it under Hypercorn with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any, Awaitable, Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart

from jaxserve.config import StructuredOutputConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.multimodal.images import ImageSupport
from jaxserve.server import classify, lora_routes, openai, sglang, tool_parsers, triton
from jaxserve.server.base_app import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    base_app,
    check_limits,
)
from jaxserve.generation_config import describe
from jaxserve.server.conversation_store import ConversationStore
from jaxserve.server.cors import CorsPolicy
from jaxserve.server.generation import ServerState, end_flights_with_exchanges
from jaxserve.server.metrics import Metrics
from jaxserve.server.model_names import ModelNames
from jaxserve.server.reasoning import check_parser
from jaxserve.server.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.server")


def create_app(
    async_engine: AsyncEngine,
    tokenizer: Tokenizer,
    served_model_name: str | ModelNames,
    max_model_len: int,
    api_keys: tuple[str, ...] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    request_timeout: float | None = None,
    structured: StructuredOutputConfig = StructuredOutputConfig(),
    warm_structured: bool = False,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    images: ImageSupport | None = None,
    cors: CorsPolicy | None = CorsPolicy(),
    request_id_headers: bool = False,
    sampling_defaults: dict[str, Any] | None = None,
    return_tokens_as_token_ids: bool = False,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    runtime_lora: bool = False,
) -> Quart:
    """warm_structured starts the constraint compile workers now (a served process) rather than
    at the first constrained request (tests). max_stored_responses: the Responses API's store
    (jaxserve.server.response_store; 0: nothing is kept). runtime_lora: LoRA adapters may be
    loaded and unloaded while serving (--enable-lora; jaxserve.server.lora_routes)."""
    check_limits(max_request_bytes, max_concurrent_requests, request_timeout)
    names = ModelNames.of(served_model_name)
    state = ServerState(
        engine=async_engine, tokenizer=tokenizer, model_names=names,
        max_model_len=max_model_len, max_concurrent_requests=max_concurrent_requests, request_timeout=request_timeout,
        metrics=_metrics(names.primary, async_engine),
        structured=structured, reasoning_parser=check_parser(reasoning_parser),
        tool_parser=(tool_parsers.resolve(tool_call_parser, tokenizer.chat_template, async_engine.info.architecture)
                     if tool_call_parser == "auto" else tool_parsers.check_parser(tool_call_parser)),
        images=images, sampling_defaults=dict(sampling_defaults or {}),
        return_tokens_as_token_ids=return_tokens_as_token_ids, runtime_lora=runtime_lora,
        responses=ResponseStore(max_stored_responses) if max_stored_responses > 0 else None,
        conversations=ConversationStore(max_stored_responses) if max_stored_responses > 0 else None,
    )
    if state.sampling_defaults:  # as vLLM says it: a surprise otherwise, when answers differ from another server's
        log.info("requests that leave them unset sample with the model's generation_config.json: %s (start with "
                 "--generation-config vllm for the API's neutral defaults)", describe(state.sampling_defaults))
        if async_engine.info.speculative_method and state.sampling_defaults.get("repetition_penalty", 1.0) != 1.0:
            log.warning("speculative decoding drafts for no row with a repetition penalty, and the model's default "
                        "gives every request that leaves it unset one: set repetition_penalty 1 per request, or "
                        "--override-generation-config '{\"repetition_penalty\": 1.0}'")
    if state.tool_parser is not None:
        log.info("tool calls for tool_choice 'auto' read with the %s parser%s", state.tool_parser,
                 " (chosen from the chat template / architecture)" if tool_call_parser == "auto" else "")
    app = base_app(state, api_keys, max_request_bytes,
                   healthy=lambda: not state.draining and async_engine.error is None, cors=cors,
                   request_id_headers=request_id_headers)
    if warm_structured:
        threading.Thread(target=lambda: state.grammars.warm_up(), name="jaxserve-grammar-warmup", daemon=True).start()

    @app.after_serving
    async def close_grammars() -> None:
        state.close_grammars()

    end_flights_with_exchanges(app)
    openai.register(app, state)
    sglang.register(app, state)
    triton.register(app, state)
    lora_routes.register(app, state)
    classify.register_refusals(app, state)  # a generation model has no classification head
    return app


def _metrics(model_name: str, async_engine: AsyncEngine) -> Metrics:
    m = Metrics(model_name)
    # The engine thread's snapshot of its last step: whole and consistent, at most one step old.
    stats = lambda: async_engine.stats  # noqa: E731
    m.gauge("num_requests_running", "Sequences in the running batch.", lambda: stats().num_running)
    m.gauge("num_requests_waiting", "Sequences waiting for admission.", lambda: stats().num_waiting)
    m.gauge("kv_cache_usage_perc", "Fraction of KV pages in use.", lambda: stats().kv_cache_usage)
    m.gauge("prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / tokens looked up.",
            lambda: stats().prefix_cache_hit_rate)
    m.counter("num_preemptions_total", "Sequences preempted (recomputed) so far.", lambda: stats().num_preemptions)
    m.counter("spec_decode_num_draft_tokens_total", "Speculative tokens proposed.",
              lambda: stats().num_draft_tokens)
    m.counter("spec_decode_num_accepted_tokens_total", "Speculative tokens accepted by verification.",
              lambda: stats().num_accepted_draft_tokens)
    m.counter("step_calls_total", "Step calls into the compiled programs.", lambda: stats().step_calls)
    m.counter("step_call_seconds_total", "Seconds spent inside step calls (on a GPU a decode loop's call "
              "returns when the loop has run; other calls return once queued).", lambda: stats().step_call_seconds)
    m.counter("step_handover_seconds_total", "Seconds from a step call's return to the start of the next "
              "one, when that one was already waiting (host time between back-to-back steps).",
              lambda: stats().step_handover_seconds)
    if async_engine.info.max_loras:
        # vLLM's: which adapters the running and the waiting requests use, for LoRA-aware routers.
        m.info("lora_requests_info", "LoRA adapters of the running and the waiting requests.",
               lambda: {"max_lora": str(async_engine.info.max_loras),
                        "running_lora_adapters": ",".join(stats().running_loras),
                        "waiting_lora_adapters": ",".join(stats().waiting_loras)})
    return m


def state_of(app: Quart) -> ServerState:
    return app.extensions["jaxserve"]


def hypercorn_config(host: str, port: int, shutdown_timeout: float) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    # Our own deadline (serve_async) ends in-flight requests at shutdown_timeout; Hypercorn's is a
    # backstop (on Python 3.12 it waits for open connections before its timeout even starts).
    config.graceful_timeout = shutdown_timeout + 5.0
    config.accesslog = None
    # Hypercorn's own lines follow the third-party level (cli.configure_logging): jaxserve logs
    # where it serves itself.
    config.loglevel = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    config.keep_alive_timeout = 75
    return config


async def serve_async(app: Quart, host: str, port: int, shutdown_timeout: float,
                      shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
    """Serve until `shutdown_trigger` returns, then stop accepting, let in-flight requests finish
    for up to `shutdown_timeout` seconds, and abort the rest (their bodies are cancelled)."""
    state = state_of(app)

    async def trigger() -> None:
        await shutdown_trigger()
        begin_drain(state, shutdown_timeout)

    await hypercorn_serve(app, hypercorn_config(host, port, shutdown_timeout), shutdown_trigger=trigger)
    await finish_background(state, shutdown_timeout)


async def finish_background(state: Any, shutdown_timeout: float) -> None:
    """Hypercorn waits for open connections only: background Responses (which outlive theirs)
    get the same grace here, before the event loop would cancel them. The drain's own timer
    aborts what still runs at shutdown_timeout, so this ends by then. (A classification
    server's state has none.)"""
    tasks = list(getattr(state, "background_tasks", ()))
    if tasks:
        log.info("finishing %d background response(s)", len(tasks))
        await asyncio.wait(tasks, timeout=shutdown_timeout + 5)


def begin_drain(state: ServerState, shutdown_timeout: float) -> None:
    """Stop admitting (/health turns 503, new inference requests are refused) and abort whatever is
    still running after shutdown_timeout seconds."""
    state.draining = True
    log.info("shutting down: finishing in-flight requests (up to %ss)", shutdown_timeout)
    asyncio.get_running_loop().call_later(shutdown_timeout, _abort_rest, state)


def _abort_rest(state: ServerState) -> None:
    if n := state.abort_all():
        log.warning("shutdown timeout: aborted %d in-flight request(s)", n)


def serve(app: Quart, host: str, port: int, shutdown_timeout: float = 30.0) -> None:
    """Serve until SIGTERM or SIGINT; blocks. The caller shuts the AsyncEngine down afterwards."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("serving %s on http://%s:%d", state_of(app).model_name, host, port)
        await serve_async(app, host, port, shutdown_timeout, stop.wait)

    asyncio.run(main())
