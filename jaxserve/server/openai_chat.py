"""OpenAI chat completions (/v1/chat/completions, also under /v3): messages through the chat
template, reasoning split from the answer, tool calls (forced, or the model's own under
--tool-call-parser), constraints composed after the think block, and the stream of
chat.completion.chunk deltas. The shared pieces
(parsing, sampling fields, usage and logprob shapes) are jaxserve.server.openai's."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from quart import Response, jsonify

from jaxserve.server import answers, reasoning, sse
from jaxserve.server.errors import ApiError, error_event
from jaxserve.server.generation import ServerState, merged, truncate_prompt
from jaxserve.server.openai import (
    _Usage,
    _usage_options,
    chat_logprobs,
    chat_messages,
    chat_prompt,
    draft_counts,
    expand_images,
    guide_spec,
    parse,
    response_id,
    sampling_params,
    tokens_as_ids,
    usage,
    vllm_prompt_logprobs,
)
from jaxserve.server.openai_protocol import ChatCompletionRequest
from jaxserve.server.tools import forced_tools, function_schemas


# ---- /v1/chat/completions -------------------------------------------------------------------------
async def chat_completions(state: ServerState) -> Response:
    """OpenAI chat completions, with vLLM's sampling and chat-template extras."""
    req = await parse(ChatCompletionRequest)
    state.model_names.lora(req.model)
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
    if req.documents is not None and (req.prompt_token_ids is not None or token_messages or req.disable_chat_template):
        raise ApiError(400, "documents: given to the chat template, which this request bypasses", "documents")
    urls: list[tuple[str, str]] | None = None  # the images of the messages (a vision-language model)
    if req.prompt_token_ids is not None or token_messages:
        prompt = list(req.prompt_token_ids if req.prompt_token_ids is not None else req.messages)  # type: ignore[arg-type]
    elif req.disable_chat_template:
        if state.images is not None and any(isinstance(m.content, list)
                                            and any(p.type == "image_url" for p in m.content) for m in req.messages):
            raise ApiError(400, "disable_chat_template: image parts are placed by the chat template; write the "
                           "placeholder into a prompt of your own through /generate or completions instead",
                           "disable_chat_template")
        prompt = state.tokenizer.encode("".join(m["content"] for m in chat_messages(req.messages)
                                                if isinstance(m.get("content"), str)))
        if not prompt:
            raise ApiError(400, "messages: no text to prompt with (disable_chat_template joins their content)",
                           "messages")
    else:
        urls = [] if state.images is not None else None
        prompt = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template,
                             req.chat_template_kwargs, req.tools if tools_on else None, images=urls,
                             continue_final_message=req.continue_final_message, documents=req.documents)
    prompt, images = await expand_images(state, prompt, urls, "messages", req.mm_processor_kwargs)
    prompt, images = truncate_prompt(prompt, images, req.truncate_prompt_tokens, state.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    plan = answers.plan(state, prompt, forced, auto, schemas)
    await answers.constrain(state, params, plan, guide_spec(req), req.parallel_tool_calls is not False,
                            req.reasoning_max_tokens)
    request_id = response_id("chatcmpl", req.request_id)
    echoed = echoed_text(req)
    async with state.admit() as flight:
        await flight.submit(request_id, prompt, params, req.priority, images=images)
        image_tokens = sum(item.num_tokens for item in images)
        if req.stream:
            return sse.sse_response(flight.respond(_chat_stream(state, req, request_id, prompt, flight.streams, plan,
                                                                image_tokens, echoed)))
        (res,) = await flight.collect()
    choices = []
    for o in res.outputs:
        choice = {"index": o.index, "message": {"role": "assistant"} | answers.message(o.text, o.finish_reason, plan),
                  "logprobs": (chat_logprobs(state, o.logprobs, req.top_logprobs or 0, tokens_as_ids(state, req))
                               if o.logprobs is not None else None),
                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        if choice["message"].get("tool_calls"):
            choice["finish_reason"] = answers.tool_finish(plan.forced, o.finish_reason)
        if not req.include_reasoning and "reasoning_content" in choice["message"]:
            choice["message"]["reasoning_content"] = None
        if echoed:
            choice["message"]["content"] = echoed + (choice["message"].get("content") or "")
        if req.return_token_ids:
            choice["token_ids"] = o.token_ids  # vLLM's place; the message carries both lists too
            choice["message"] |= {"prompt_token_ids": prompt, "completion_token_ids": o.token_ids}
        choices.append(choice)
    num_reasoning = None
    if plan.parser is not None:  # a few full decodes per output: off the event loop
        counts = await asyncio.to_thread(lambda: [reasoning.reasoning_tokens(o.token_ids, state.tokenizer.decode,
                                                                             plan.opened) for o in res.outputs])
        num_reasoning = sum(counts)
    token_usage = usage(len(prompt), sum(len(o.token_ids) for o in res.outputs), res.num_cached_tokens,
                        num_reasoning, draft_counts(state, res.num_draft_tokens, res.num_accepted_draft_tokens),
                        image_tokens)
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_names.reported(req.model), "choices": choices, "usage": token_usage,
            "system_fingerprint": None}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt
    if req.prompt_logprobs is not None and res.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(state, res.prompt_logprobs)  # vLLM: top level for chat
    return jsonify(body)


def echoed_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text, when it is the assistant's (the reply
    continues it, as with continue_final_message); else nothing."""
    if not req.echo or isinstance(req.messages[0], int):
        return ""
    last = req.messages[-1]
    if last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "".join(p.text or "" for p in last.content if p.type == "text")
    return last.content or ""


async def _chat_stream(state: ServerState, req: ChatCompletionRequest, request_id: str, prompt: list[int],
                       streams: list, plan: answers.OutputPlan, image_tokens: int = 0,
                       echoed: str = "") -> AsyncIterator[bytes]:
    """Each delta's text split into reasoning_content, content and tool_calls (answers.OutputStream); a
    piece of a tag or trigger is held back until the next token decides it."""
    created = int(time.time())
    include_usage, continuous = _usage_options(req)
    total = _Usage(state, [prompt], image_tokens)
    outputs = {i: answers.OutputStream(plan) for i in range(req.n)}
    # Reasoning tokens from the tokens' own text, not the streamed text (which the detokenizer may
    # still hold back for a stop string): the same count as the whole reply's, never going down.
    counters = {i: reasoning.ReasoningCounter(state.tokenizer.decode, plan.opened) for i in range(req.n)}

    def usage_body() -> dict[str, Any]:
        return total.body(sum(c.count()[0] for c in counters.values()) if plan.parser is not None else None)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_names.reported(req.model), "choices": choices, "system_fingerprint": None, **extra}
        if include_usage:
            body["usage"] = usage_body() if continuous else None
        return sse.event(body)

    try:
        # The role comes first, before any token, as OpenAI sends it.
        for index in range(req.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}],
                        **({"prompt_token_ids": prompt} if req.return_token_ids and index == 0 else {}))
            if echoed:  # the echoed message, before the continuation
                yield chunk([{"index": index, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}])
        async for i, delta in merged(streams):
            total.add(i, delta)
            for o in delta.outputs:
                if plan.parser is not None:
                    counters[o.index].add(o.token_ids)
                out = outputs[o.index]
                delta_body = out.delta(o.text, o.finish_reason)
                if not req.include_reasoning:
                    delta_body.pop("reasoning_content", None)
                finish = o.finish_reason
                if finish is not None and out.called:
                    finish = answers.tool_finish(plan.forced, finish)
                if not delta_body and finish is None and o.logprobs is None and not req.return_token_ids:
                    continue  # nothing to say yet (a forced call is sent whole)
                choice = {"index": o.index, "delta": delta_body, "logprobs": None,
                          "finish_reason": finish, "stop_reason": o.stop_reason}
                if o.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(state, o.logprobs, req.top_logprobs or 0,
                                                       tokens_as_ids(state, req))
                if req.return_token_ids:
                    choice["token_ids"] = o.token_ids
                yield chunk([choice])
        if include_usage:
            yield sse.event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": state.model_names.reported(req.model), "choices": [], "usage": usage_body()})
    except Exception as e:
        yield sse.event(error_event(e, "openai"))
    yield sse.DONE
