"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (also under /v3), /v1/responses,
/v1/models, /tokenize, /detokenize. Shapes follow OpenAI, with vLLM's extras (stop_reason, return_token_ids)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, TypeVar

import pydantic
from quart import Quart, Response, jsonify, request

from jaxserve.engine.embeds import ImageItem
from jaxserve.engine.output import RequestOutput, TokenLogprob
from jaxserve.engine.request import SamplingParams
from jaxserve.server import sampling, sse
from jaxserve.server.embed_inputs import base64_embeds
from jaxserve.server.errors import ApiError, error_event, not_supported
from jaxserve.server.generation import (
    ServerState,
    attach_grammar,
    bad_words_ids,
    merged,
    new_id,
    route,
    token_text,
    truncate_prompt,
)
from jaxserve.server.tools import parse_arguments
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec
from jaxserve.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    SamplingFields,
)

M = TypeVar("M", bound=pydantic.BaseModel)


async def parse(model: type[M]) -> M:
    """The body as `model`; malformed JSON, wrong types and out-of-range values raise (-> 400)."""
    return model.model_validate_json(await request.get_data(cache=False))


def sampling_params(state: ServerState, req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    _refuse_unsupported(req)
    # OVMS (/v3): best_of > 1 is beam search, its width (sampling.py).
    ovms_beams = (request.path.startswith("/v3/") and (req.best_of or 1) > 1
                  and "use_beam_search" not in req.model_fields_set)  # an explicit false keeps sampling
    params = sampling.build(sampling.OPENAI, lambda name: getattr(req, name), state.sampling_defaults,
                            max_tokens=max_tokens, logprobs=logprobs,
                            bad_words_ids=bad_words_ids(state.tokenizer, req.bad_words) if req.bad_words else None,
                            use_beam_search=bool(req.use_beam_search) or ovms_beams)
    sampling.refuse_streamed_beams(params, req.stream, "best_of" if ovms_beams else "use_beam_search")
    params.lora = state.model_names.lora(req.model)
    return params


def guide_spec(req: SamplingFields) -> GuideSpec | None:
    """The request's structured-output constraint: OpenAI's response_format, vLLM's guided_*
    extras, or vLLM's structured_outputs object; more than one -> 400. The JSON whitespace
    options (guided_whitespace_pattern, structured_outputs' whitespace_pattern and
    disable_any_whitespace) apply to whichever JSON constraint the request has, as in vLLM."""
    so, whitespace = _structured_outputs(req.structured_outputs)
    found = [
        guide.json_schema(req.guided_json, "guided_json") if req.guided_json is not None else None,
        guide.regex(req.guided_regex, "guided_regex") if req.guided_regex is not None else None,
        guide.choice(req.guided_choice, "guided_choice") if req.guided_choice is not None else None,
        guide.grammar(req.guided_grammar, "guided_grammar") if req.guided_grammar is not None else None,
        _response_format(req.response_format),
        so,
    ]
    if req.guided_whitespace_pattern is not None:
        whitespace.append(("guided_whitespace_pattern", req.guided_whitespace_pattern))
    if len(whitespace) > 1:
        raise ApiError(400, f"{' and '.join(n for n, _ in whitespace)}: give one whitespace rule", whitespace[1][0])
    spec = guide.only_one(found)
    return guide.with_whitespace(spec, *whitespace[0][::-1]) if whitespace else spec


def _response_format(fmt: Any) -> GuideSpec | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return guide.json_object("response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, "response_format.json_schema: expected {\"name\", \"schema\", \"strict\"?} with a "
                           "schema", "response_format")
        return guide.json_schema(spec["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":  # vLLM's: {"type", "structures": [{begin, schema, end}], "triggers"}
        return guide.structural_tag(fmt, "response_format")
    raise ApiError(400, f"response_format.type: must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                   f"got {kind!r}", "response_format")


# vLLM's StructuredOutputsParams options besides the constraint itself.
_SO_OPTIONS = ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties", "disable_fallback")


def _structured_outputs(so: Any) -> tuple[GuideSpec | None, list[tuple[str, str]]]:
    """vLLM's structured_outputs: the constraint, and its whitespace rule as [(param, regex)]."""
    if so is None:
        return None, []
    if not isinstance(so, dict):
        raise ApiError(400, "structured_outputs: expected an object", "structured_outputs")
    makers = {"json": guide.json_schema, "regex": guide.regex, "choice": guide.choice, "grammar": guide.grammar,
              "structural_tag": guide.structural_tag}
    unknown = sorted(set(so) - set(makers) - {"json_object", *_SO_OPTIONS})
    if unknown:
        raise ApiError(400, f"structured_outputs: unknown key(s) {unknown}", "structured_outputs")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if so.get(flag) is not None and not isinstance(so[flag], bool):
            raise ApiError(400, f"structured_outputs.{flag}: expected true or false", f"structured_outputs.{flag}")
    if so.get("disable_additional_properties") is False:
        # vLLM's guidance backend then lets objects take properties their schema does not list.
        # Here (as in xgrammar's strict mode, vLLM's default backend) an object whose schema does
        # not say additionalProperties gets only its listed ones: the model invents none.
        raise ApiError(400, "structured_outputs.disable_additional_properties: false is not supported: objects get "
                       "only the properties their schema lists unless it says \"additionalProperties\": true; "
                       "say so in the schema", "structured_outputs.disable_additional_properties")
    # disable_fallback holds whatever its value: each constraint has one compiler here, and a
    # constraint it cannot compile is a 400, never handed to another backend.
    whitespace = []
    if so.get("whitespace_pattern") is not None:
        whitespace.append(("structured_outputs.whitespace_pattern", so["whitespace_pattern"]))
    if so.get("disable_any_whitespace"):
        whitespace.append(("structured_outputs.disable_any_whitespace", ""))
    found = [makers[k](v, f"structured_outputs.{k}") for k, v in so.items() if k in makers and v is not None]
    if so.get("json_object"):
        found.append(guide.json_object("structured_outputs.json_object"))
    return guide.only_one(found), whitespace


def _refuse_unsupported(req: SamplingFields) -> None:
    sampling.refuse_unhonoured(lambda name: getattr(req, name))
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise ApiError(400, "best_of: streaming needs best_of == n (the best samples are known only at the end)",
                       "best_of")
    if req.stream_options is not None and not req.stream:  # vLLM's and OpenAI's refusal: nothing to apply it to
        raise ApiError(400, "stream_options: only with stream: true", "stream_options")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise ApiError(400, "stream_options.include_obfuscation: no obfuscation padding is sent; set it to false",
                       "stream_options.include_obfuscation")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None,
          drafts: tuple[int, int] | None = None, image_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object. `drafts` (speculative tokens proposed, accepted) fill OpenAI's
    predicted-output counts, which mean just that: the accepted ones were emitted, the rest
    were checked and thrown away. image_tokens: the prompt tokens that are images' (reported
    when there are any, as OpenAI's and FastDeploy's prompt_tokens_details do)."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if image_tokens:
        body["prompt_tokens_details"]["image_tokens"] = image_tokens
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if drafts is not None:
        details |= prediction_details(*drafts)
    if details:
        body["completion_tokens_details"] = details
    return body


def prediction_details(num_draft: int, num_accepted: int) -> dict[str, int]:
    return {"accepted_prediction_tokens": num_accepted, "rejected_prediction_tokens": num_draft - num_accepted}


def draft_counts(state: ServerState, num_draft: int, num_accepted: int) -> tuple[int, int] | None:
    """(proposed, accepted) speculative tokens to report: on a server that speculates, or when a
    request drafted any; None otherwise (usage keeps OpenAI's plain shape)."""
    if num_draft > 0 or state.engine.info.speculative_method is not None:
        return num_draft, num_accepted
    return None


def _usage_options(req: SamplingFields) -> tuple[bool, bool]:
    """(usage chunk before [DONE], usage so far on every chunk: vLLM's continuous_usage_stats)."""
    opts = req.stream_options
    if opts is None:
        return False, False
    return opts.include_usage, opts.include_usage and opts.continuous_usage_stats


class _Usage:
    """Token counts across a request's engine streams, as deltas arrive."""

    def __init__(self, state: ServerState, prompts: list[list[int]], image_tokens: int = 0):
        self.state = state
        self.prompt = sum(map(len, prompts))
        self.image_tokens = image_tokens
        self.completion = 0
        # Per stream; each delta carries its stream's totals so far.
        self.cached: dict[int, int] = {}
        self.drafted: dict[int, tuple[int, int]] = {}

    def add(self, i: int, delta: RequestOutput) -> None:
        self.completion += sum(len(o.token_ids) for o in delta.outputs)
        self.cached[i] = delta.num_cached_tokens
        self.drafted[i] = (delta.num_draft_tokens, delta.num_accepted_draft_tokens)

    def body(self, reasoning_tokens: int | None = None) -> dict[str, Any]:
        num_draft = sum(d for d, _ in self.drafted.values())
        num_accepted = sum(a for _, a in self.drafted.values())
        return usage(self.prompt, self.completion, sum(self.cached.values()), reasoning_tokens,
                     draft_counts(self.state, num_draft, num_accepted), self.image_tokens)


def verbatim_text(state: ServerState, ids: list[int]) -> str:
    """The text of `ids` with their special tokens kept, as written, with nothing between them:
    what a prompt's tokens join to. The echoed prompt (its logprobs' text_offset index it;
    skipping the specials lost "<|im_end|>" and sent the offsets backwards) and /detokenize
    (vLLM's, HF's decode default: it undoes /tokenize, chat-template markers included)."""
    return state.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)


# ---- logprobs -------------------------------------------------------------------------------------
def tokens_as_ids(state: ServerState, req: SamplingFields) -> bool:
    """vLLM's return_tokens_as_token_ids: the request's, else the server's
    --return-tokens-as-token-ids."""
    given = req.return_tokens_as_token_ids
    return state.return_tokens_as_token_ids if given is None else given


def response_id(prefix: str, given: str | None) -> str:
    """vLLM's response id: prefix + the X-Request-Id header, else the body's request_id, else a
    fresh one (the engine runs it under this id: /abort_request can name it)."""
    base = request.headers.get("X-Request-Id") or given
    return f"{prefix}-{base}" if base else new_id(prefix)


def shown_token(state: ServerState, token_id: int, as_ids: bool = False) -> str:
    """A token as logprobs show it: its own text, or vLLM's "token_id:N" (return_tokens_as_token_ids,
    for clients that must map every token back, whatever bytes it holds)."""
    return f"token_id:{token_id}" if as_ids else token_text(state.tokenizer, token_id)


def legacy_prompt_logprobs(state: ServerState, ids: list[int], lps: list[TokenLogprob | None],
                           as_ids: bool = False) -> dict[str, Any]:
    """The echoed prompt's part of OpenAI's completions logprobs: the first token has none."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for tid, lp in zip(ids, lps):
        text = shown_token(state, tid, as_ids)
        tokens.append(text)
        token_logprobs.append(lp.logprob if lp else None)
        top.append(({shown_token(state, i, as_ids): v for i, v in lp.top} | {text: lp.logprob}) if lp else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def join_logprobs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}


def vllm_prompt_logprobs(state: ServerState, lps: list[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token {token id: {logprob, rank, decoded_token}},
    the prompt token first, then the top alternatives (ranks 1, 2, ...)."""
    def entries(lp: TokenLogprob) -> dict[str, Any]:
        ranked = [(lp.token_id, lp.logprob, lp.rank)] + [(i, v, k + 1) for k, (i, v) in enumerate(lp.top)
                                                          if i != lp.token_id]
        return {str(i): {"logprob": v, "rank": rank, "decoded_token": token_text(state.tokenizer, i)}
                for i, v, rank in ranked}

    return [entries(lp) if lp else None for lp in lps]


def legacy_logprobs(state: ServerState, lps: list[TokenLogprob], offset: int, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's completions shape: parallel lists, top alternatives as {token text: logprob}."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in lps:
        text = shown_token(state, lp.token_id, as_ids)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        alternatives = {shown_token(state, i, as_ids): v for i, v in lp.top}
        alternatives.setdefault(text, lp.logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(state: ServerState, lps: list[TokenLogprob], num_top: int, as_ids: bool = False) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = shown_token(state, token_id, as_ids)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top[:num_top]]}
                        for lp in lps]}


# ---- /v1/completions ------------------------------------------------------------------------------
def completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    if req.prompt is None:
        raise ApiError(400, "prompt: required (or prompt_embeds)", "prompt")
    p = req.prompt
    if isinstance(p, str):
        texts: list[str] | None = [p]
    elif p and isinstance(p[0], str):
        texts = p  # type: ignore[assignment]
    else:
        texts = None
    if texts is not None:
        prompts = [state.tokenizer.encode_prompt(t, add_special_tokens=req.add_special_tokens) for t in texts]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    if not prompts or any(not ids for ids in prompts):
        raise ApiError(400, "prompt: must not be empty", "prompt")
    return prompts


def _completion_inputs(state: ServerState, req: CompletionRequest) -> tuple[list[list[int]], list[tuple]]:
    """The prompts' token ids and embedding spans: from `prompt`, or from vLLM's prompt_embeds
    (whose prompts have no text to echo and no tokens to score)."""
    if req.prompt_embeds is None:
        prompts = [truncate_prompt(ids, (), req.truncate_prompt_tokens, state.max_model_len)[0]
                   for ids in completion_prompts(state, req)]
        return prompts, [()] * len(prompts)
    if req.prompt is not None:
        raise ApiError(400, "prompt_embeds: give prompt or prompt_embeds, not both", "prompt_embeds")
    if req.truncate_prompt_tokens is not None:
        raise ApiError(400, "truncate_prompt_tokens: applies to token prompts, not to prompt_embeds; send the "
                       "embeddings you want read", "truncate_prompt_tokens")
    for name, used in (("echo", req.echo), ("prompt_logprobs", req.prompt_logprobs is not None)):
        if used:
            raise ApiError(400, f"{name}: a prompt given as prompt_embeds has no tokens to echo or score", name)
    batch = isinstance(req.prompt_embeds, list)
    values = req.prompt_embeds if batch else [req.prompt_embeds]
    if not values:
        raise ApiError(400, "prompt_embeds: must not be empty", "prompt_embeds")
    out = [base64_embeds(v, state.engine.info, f"prompt_embeds[{i}]" if batch else "prompt_embeds")
           for i, v in enumerate(values)]
    return [ids for ids, _ in out], [spans for _, spans in out]


async def completions(state: ServerState) -> Response:
    """OpenAI text completions (legacy), with vLLM's sampling extras."""
    req = await parse(CompletionRequest)
    state.model_names.lora(req.model)
    if req.suffix is not None:
        raise not_supported("suffix", "suffix (insertion)")
    prompts, embeds = _completion_inputs(state, req)
    params = sampling_params(state, req, req.max_tokens, req.logprobs)
    await attach_grammar(state, params, guide_spec(req))
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
    request_id = response_id("cmpl", req.request_id)
    async with state.admit() as flight:
        for i, ids in enumerate(prompts):
            await flight.submit(f"{request_id}-{i}", ids, params, req.priority, embeds=embeds[i])
        if req.stream:
            return sse.sse_response(flight.respond(_completion_stream(state, req, request_id, prompts, flight.streams)))
        results = await flight.collect()
    choices = []
    total = _Usage(state, prompts)
    for i, (ids, res) in enumerate(zip(prompts, results)):
        total.add(i, res)
        echo = verbatim_text(state, ids) if req.echo else ""
        for o in res.outputs:
            as_ids = tokens_as_ids(state, req)
            logprobs = legacy_logprobs(state, o.logprobs, len(echo), as_ids) if o.logprobs is not None else None
            if req.echo and logprobs is not None and res.prompt_logprobs is not None:
                logprobs = join_logprobs(legacy_prompt_logprobs(state, ids, res.prompt_logprobs, as_ids), logprobs)
            choice = {"index": i * req.n + o.index, "text": echo + o.text, "logprobs": logprobs,
                      "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
            if req.prompt_logprobs is not None and res.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(state, res.prompt_logprobs)
            if req.return_token_ids:
                choice |= {"prompt_token_ids": ids, "token_ids": o.token_ids}
            choices.append(choice)
    return jsonify({"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": state.model_names.reported(req.model), "choices": choices, "usage": total.body(),
                    "system_fingerprint": None})


async def _completion_stream(state: ServerState, req: CompletionRequest, request_id: str,
                             prompts: list[list[int]], streams: list) -> AsyncIterator[bytes]:
    created = int(time.time())
    include_usage, continuous = _usage_options(req)
    total = _Usage(state, prompts)
    offsets: dict[int, int] = {}
    prompt_lps: dict[int, list[TokenLogprob | None]] = {}  # the engine sends them with the first delta

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        body = {"id": request_id, "object": "text_completion", "created": created,
                "model": state.model_names.reported(req.model), "choices": choices, "system_fingerprint": None}
        if include_usage:
            body["usage"] = total.body() if continuous else None
        return sse.event(body)

    try:
        async for i, delta in merged(streams):
            total.add(i, delta)
            if delta.prompt_logprobs is not None:
                prompt_lps[i] = delta.prompt_logprobs
            for o in delta.outputs:
                index = i * req.n + o.index
                first = index not in offsets
                echo = verbatim_text(state, prompts[i]) if first and req.echo else ""
                if first:
                    offsets[index] = len(echo)  # logprobs' text_offset counts from the echoed prompt
                choice = {"index": index, "text": echo + o.text, "logprobs": None, "finish_reason": o.finish_reason,
                          "stop_reason": o.stop_reason}
                if o.logprobs is not None:
                    as_ids = tokens_as_ids(state, req)
                    choice["logprobs"] = legacy_logprobs(state, o.logprobs, offsets[index], as_ids)
                    offsets[index] += sum(len(t) for t in choice["logprobs"]["tokens"])
                    if first and req.echo and i in prompt_lps:
                        choice["logprobs"] = join_logprobs(
                            legacy_prompt_logprobs(state, prompts[i], prompt_lps[i], as_ids), choice["logprobs"])
                if first and req.prompt_logprobs is not None and i in prompt_lps:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(state, prompt_lps[i])
                if req.return_token_ids:
                    choice["token_ids"] = o.token_ids
                    if first:
                        choice["prompt_token_ids"] = prompts[i]
                yield chunk([choice])
        if include_usage:
            yield sse.event({"id": request_id, "object": "text_completion", "created": created,
                             "model": state.model_names.reported(req.model), "choices": [], "usage": total.body()})
    except Exception as e:
        yield sse.event(error_event(e, "openai"))
    yield sse.DONE


# ---- chat templates (chat completions: jaxserve.server.openai_chat) -------------------------------
def chat_messages(messages: list[ChatMessage], images: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content parts joined into one string, tool calls'
    arguments as objects (OpenAI sends JSON text; HF templates write `arguments | tojson`), an
    assistant turn that only called tools with "" content (Qwen3's template cannot test None).
    Tool turns must answer a call made before them. With `images` (a vision-language model), the
    content is a list of parts as its processor's template reads them ({"type": "text", "text"}
    and {"type": "image"}, a string becoming one text part), and each image_url part's (url,
    parameter name) is appended to `images`, in order."""
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if images is not None and isinstance(m.content, str):
            d["content"] = [{"type": "text", "text": m.content}]
        elif images is not None and isinstance(m.content, list):
            d["content"] = [_template_part(i, k, part, images) for k, part in enumerate(m.content)]
        elif isinstance(m.content, list):
            texts = []
            for k, part in enumerate(m.content):
                if part.type == "image_url":
                    raise ApiError(400, f"messages[{i}].content[{k}]: this model takes no images (served as a "
                                   "text-only model)", f"messages[{i}].content[{k}]", code="not_supported")
                if part.type == "text" and part.text is None:
                    raise _no_text(f"messages[{i}].content[{k}]")
                if part.type != "text":
                    raise not_supported(f"messages[{i}].content", f"content part type {part.type!r}")
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                               f"messages[{i}].tool_calls")
            d["tool_calls"] = [_template_call(i, k, c) for k, c in enumerate(m.tool_calls)]
            call_ids |= {c["id"] for c in d["tool_calls"] if isinstance(c.get("id"), str)}
            d.setdefault("content", "")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(400, f"messages[{i}].tool_call_id: a tool message must name the call it answers",
                               f"messages[{i}].tool_call_id")
            if call_ids and m.tool_call_id not in call_ids:
                raise ApiError(400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call made "
                               "by an earlier assistant message", f"messages[{i}].tool_call_id")
            if m.content is None:
                raise ApiError(400, f"messages[{i}].content: a tool message needs the call's result",
                               f"messages[{i}].content")
        out.append(d)
    return out


def _no_text(where: str) -> ApiError:
    return ApiError(400, f"{where}.text: a text part needs its text (a string)", f"{where}.text")


def _template_part(i: int, k: int, part: Any, images: list[tuple[str, str]]) -> dict[str, Any]:
    """One content part as a vision-language template reads it; an image's URL goes to `images`."""
    where = f"messages[{i}].content[{k}]"
    if part.type == "text":
        if part.text is None:
            raise _no_text(where)
        return {"type": "text", "text": part.text}
    if part.type != "image_url":
        raise not_supported(where, f"content part type {part.type!r}")
    spec = (part.model_extra or {}).get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}.image_url: needs a url (a data: URL, an http(s) URL or a file)",
                       f"{where}.image_url")
    images.append((url, f"{where}.image_url"))
    return {"type": "image"}


def _template_call(i: int, k: int, call: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{k}]"
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, f"{where}.function: expected {{\"name\": ..., \"arguments\": ...}}", where)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        arguments = parse_arguments(arguments, f"{where}.function.arguments") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments: expected a JSON object", f"{where}.function.arguments")
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": arguments}}


async def expand_images(state: ServerState, prompt: list[int], urls: list[tuple[str, str]] | None,
                        param: str, processor_kwargs: dict[str, Any] | None = None,
                        ) -> tuple[list[int], list[ImageItem]]:
    """On a vision-language server: the images `urls` names ((url, parameter name) each) loaded and
    preprocessed, and the prompt's placeholders expanded for them (a prompt without images must
    hold no placeholder). Elsewhere the prompt as it is. processor_kwargs: vLLM's
    mm_processor_kwargs, the image processor's options for this request (400 on a text-only model)."""
    if state.images is None:
        if processor_kwargs:
            raise ApiError(400, "mm_processor_kwargs: this model takes no images (served as a text-only model)",
                           "mm_processor_kwargs")
        return prompt, []
    images = state.images.with_kwargs(processor_kwargs)
    return await images.load_into(prompt, urls or [], urls[0][1] if urls else param)


def chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                chat_template: str | None, chat_template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None,
                images: list[tuple[str, str]] | None = None, continue_final_message: bool = False,
                documents: list[dict[str, str]] | None = None) -> list[int]:
    """The rendered conversation's token ids. images: as for `chat_messages` (its image
    placeholders are in the ids, unexpanded). continue_final_message: vLLM's, the last message
    left open for the model to continue (it needs add_generation_prompt false, as in vLLM).
    documents: vLLM's, the template's `documents`."""
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "continue_final_message: it continues the last message, and add_generation_prompt "
                       "(true by default) starts a new one; set add_generation_prompt to false",
                       "continue_final_message")
    return state.tokenizer.encode_chat(chat_messages(messages, images), add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                       tools=tools, continue_final_message=continue_final_message,
                                       documents=documents)


# ---- models, tokenize, detokenize -----------------------------------------------------------------
async def models(state: ServerState) -> Response:
    """The served model, once per name it is served under."""
    return jsonify(state.model_names.cards(state.created, state.max_model_len))


async def model(state: ServerState, name: str) -> Response:
    """One served model's card (OpenAI's models.retrieve); 404 for a name this server does not serve."""
    return jsonify(state.model_names.card(name, state.created, state.max_model_len))


async def reset_prefix_cache(state: ServerState) -> Response:
    """vLLM's: forget the prefix cache (pages held by running requests stay)."""
    await state.engine.reset_prefix_cache()
    return Response("", status=200)


async def tokenize(state: ServerState) -> Response:
    """Token ids of a prompt or of a rendered chat (vLLM's /tokenize)."""
    req = await parse(TokenizeRequest)
    state.model_names.lora(req.model)  # an adapter shares the tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise ApiError(400, "messages: must not be empty", "messages")
        urls: list[tuple[str, str]] | None = [] if state.images is not None else None
        ids = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template, req.chat_template_kwargs,
                          images=urls, continue_final_message=req.continue_final_message, documents=req.documents)
        ids, _ = await expand_images(state, ids, urls, "messages",  # the ids a chat request would run
                                     req.mm_processor_kwargs)
    else:
        for name in ("documents", "mm_processor_kwargs"):
            if getattr(req, name) is not None:
                raise ApiError(400, f"{name}: for a chat's messages (images, a template); this request has a "
                               "prompt", name)
        ids = state.tokenizer.encode_prompt(req.prompt or "", add_special_tokens=req.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                            "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.hf.convert_ids_to_tokens(ids)
    return jsonify(body)


async def detokenize(state: ServerState) -> Response:
    """Text of token ids (vLLM's /detokenize)."""
    req = await parse(DetokenizeRequest)
    state.model_names.lora(req.model)  # an adapter shares the tokenizer
    bad = next((t for t in req.tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {state.vocab_size})", "tokens")
    return jsonify({"prompt": verbatim_text(state, req.tokens)})


def register(app: Quart, state: ServerState) -> None:
    from jaxserve.server import conversations
    from jaxserve.server.openai_chat import chat_completions
    from jaxserve.server.openai_responses import (
        ResponsesRequest,
        cancel_response,
        delete_response,
        get_response,
        list_input_items,
        responses,
    )

    for prefix in ("/v1", "/v3"):
        route(app, state, f"{prefix}/completions", completions, "POST", CompletionRequest)
        route(app, state, f"{prefix}/chat/completions", chat_completions, "POST", ChatCompletionRequest)
    route(app, state, "/v1/responses", responses, "POST", ResponsesRequest)
    route(app, state, "/v1/responses/<response_id>", get_response, "GET")
    route(app, state, "/v1/responses/<response_id>", delete_response, "DELETE")
    route(app, state, "/v1/responses/<response_id>/input_items", list_input_items, "GET")
    route(app, state, "/v1/responses/<response_id>/cancel", cancel_response, "POST")
    conversations.register(app, state)
    for prefix in ("/v1", "/v3"):  # OVMS lists its models under /v3 too
        route(app, state, f"{prefix}/models", models, "GET")
        route(app, state, f"{prefix}/models/<path:name>", model, "GET")  # names may hold "/" (org/model)
    route(app, state, "/reset_prefix_cache", reset_prefix_cache, "POST")
    route(app, state, "/tokenize", tokenize, "POST", TokenizeRequest)
    route(app, state, "/detokenize", detokenize, "POST", DetokenizeRequest)
