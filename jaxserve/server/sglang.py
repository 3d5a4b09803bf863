"""SGLang's native API: POST /generate (text or input_ids, single or batch, cumulative-text
streaming) and POST /abort_request. Shapes follow SGLang's http_server."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Literal

from pydantic import ConfigDict
from quart import Quart, Response, jsonify

from jaxserve import __version__
from jaxserve.engine.embeds import EmbedSpan, ImageItem
from jaxserve.engine.output import CompletionOutput, RequestOutput, TokenLogprob
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.server import accepted_fields, sampling, sse
from jaxserve.server.accepted_fields import KnownFields
from jaxserve.multimodal.media import check_count
from jaxserve.server.embed_inputs import json_embeds
from jaxserve.server.errors import ApiError, error_event, not_supported
from jaxserve.server.generation import EngineStream, ServerState, attach_grammar, merged, new_id, route, token_text
from jaxserve.server.openai import draft_counts, parse
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec


class SGLangSamplingParams(KnownFields):
    # Unknown keys are refused: SGLang itself fails on them, and a typo must not pass silently.
    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.SGLANG_SAMPLING
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # OVMS's prompt-lookup fields (a server started with --speculative-method ngram honours them).
    num_assistant_tokens: int | None = None
    max_ngram_size: int | None = None
    # Beam search, as vLLM spells it (jaxserve.engine.beam).
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # OVMS's draft-model threshold (a server with --speculative-model honours it).
    assistant_confidence_threshold: float | None = None


class GenerateRequest(KnownFields):
    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.SGLANG_GENERATE
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    image_data: Any = None
    input_embeds: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    priority: int | None = None


class AbortRequest(KnownFields):
    model_config = ConfigDict(strict=True)
    rid: str = ""
    abort_all: bool = False


def guide_spec(sp: SGLangSamplingParams) -> GuideSpec | None:
    """SGLang's constraint fields: regex, json_schema (a JSON string), ebnf (GBNF), structural_tag
    (a JSON string of structures and triggers); one at most."""
    return guide.only_one([
        guide.structural_tag(sp.structural_tag, "sampling_params.structural_tag")
        if sp.structural_tag is not None else None,
        guide.regex(sp.regex, "sampling_params.regex") if sp.regex is not None else None,
        guide.json_schema(sp.json_schema, "sampling_params.json_schema") if sp.json_schema is not None else None,
        guide.grammar(sp.ebnf, "sampling_params.ebnf") if sp.ebnf is not None else None,
    ])


def _params(sp: SGLangSamplingParams, req: GenerateRequest, prompt_len: int,
            model_defaults: dict[str, Any]) -> SamplingParams:
    sampling.refuse_unhonoured(lambda name: getattr(sp, name), "sampling_params.")
    # SGLang's first input logprob is always null, so the engine scores from the one after it.
    first_scored = logprob_start(req, prompt_len) + 1
    # The model's defaults fill what the client did not send; max_new_tokens keeps SGLang's 128
    # (SGLang's model sampling defaults leave it out too).
    defaults = {k: v for k, v in model_defaults.items() if k != "max_tokens"}
    unset = {name for name in defaults if name not in sp.model_fields_set}  # SGLang's names are the engine's here
    params = sampling.build(
        sampling.SGLANG, lambda name: None if name in unset else getattr(sp, name), defaults,
        logprobs=(req.top_logprobs_num if req.return_logprob else None),
        prompt_logprobs=(req.top_logprobs_num if req.return_logprob and first_scored < prompt_len else None),
        prompt_logprobs_start=min(first_scored, prompt_len),
    )
    sampling.refuse_streamed_beams(params, req.stream, "sampling_params.use_beam_search")
    return params


def logprob_start(req: GenerateRequest, prompt_len: int) -> int:
    """The first prompt position SGLang reports input logprobs for: logprob_start_len, or the
    last prompt token when it is -1 (the default)."""
    return prompt_len - 1 if req.logprob_start_len == -1 else req.logprob_start_len


def wants_input_logprobs(req: GenerateRequest) -> bool:
    """Whether the client asked for the prompt's logprobs past the default last token."""
    return req.return_logprob and req.logprob_start_len >= 0


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    images: list[ImageItem] = dataclasses.field(default_factory=list)
    embeds: tuple[EmbedSpan, ...] = ()


async def _inputs(state: ServerState, req: GenerateRequest) -> tuple[list[_Prompt], bool]:
    """The prompts (token ids, with their images or embeddings), and whether the request was a batch."""
    for name in ("audio_data", "video_data", "custom_logit_processor"):
        if getattr(req, name) is not None:
            raise not_supported(name, name)
    if sum(x is not None for x in (req.text, req.input_ids, req.input_embeds)) != 1:
        raise ApiError(400, "text: give exactly one of text, input_ids and input_embeds", "text")
    if req.input_embeds is not None:
        if req.image_data is not None:
            raise ApiError(400, "image_data: a prompt given as input_embeds holds its images' embeddings itself",
                           "image_data")
        if wants_input_logprobs(req):
            raise ApiError(400, "logprob_start_len: a prompt given as input_embeds has no tokens to score; use -1",
                           "logprob_start_len")
        embeds = req.input_embeds
        batch = isinstance(embeds, list) and bool(embeds) and isinstance(embeds[0], list) and bool(embeds[0]) \
            and isinstance(embeds[0][0], list)
        each = embeds if batch else [embeds]
        name = lambda i: f"input_embeds[{i}]" if batch else "input_embeds"  # noqa: E731
        return [_embedded(e, state, name(i)) for i, e in enumerate(each)], batch
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts = [state.tokenizer.encode_prompt(t) for t in (req.text if batch else [req.text])]  # type: ignore[union-attr]
    else:
        ids = req.input_ids or []
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
    if not prompts or any(not p for p in prompts):
        param = "text" if req.text is not None else "input_ids"
        raise ApiError(400, f"{param}: the prompt must not be empty", param)
    images = _image_specs(req.image_data, len(prompts), batch)
    if state.images is None:
        if any(images):
            raise ApiError(400, f"image_data: {state.engine.info.architecture} takes no images (served as a "
                           "text-only model)", "image_data", code="not_supported")
        return [_Prompt(p) for p in prompts], batch
    # The image limit is per request, however its prompts share the images.
    check_count(sum(map(len, images)), state.images.policy, "image_data")
    out = []
    for ids, specs in zip(prompts, images):
        out.append(_Prompt(*await state.images.load_into(ids, specs, "image_data")))
    return out, batch


def _embedded(value: Any, state: ServerState, param: str) -> _Prompt:
    ids, spans = json_embeds(value, state.engine.info, param)
    return _Prompt(ids, [], spans)


def _image_specs(data: Any, count: int, batch: bool) -> list[list[tuple[str, str]]]:
    """SGLang's image_data, per prompt: (image, parameter name) of each. One prompt takes an image
    (str) or a list of them; a batch takes one entry per prompt, each an image, a list or None."""
    if data is None:
        return [[] for _ in range(count)]
    if not batch:
        data = [data]
    elif not isinstance(data, list) or len(data) != count:
        raise ApiError(400, f"image_data: a batch takes one entry per prompt ({count})", "image_data")
    out = []
    for i, entry in enumerate(data):
        where = f"image_data[{i}]" if batch else "image_data"
        entries = [] if entry is None else entry if isinstance(entry, list) else [entry]
        if not all(isinstance(e, str) for e in entries):
            raise ApiError(400, f"{where}: an image is a string (a file name, URL, data URL or base64)", where)
        out.append([(e, f"{where}[{k}]" if isinstance(entry, list) else where) for k, e in enumerate(entries)])
    return out


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"{name}: a list needs one entry per prompt ({count}), got {len(value)}", name)
        return value
    return [value] * count


async def generate(state: ServerState) -> Response:
    """SGLang's native generate: text or input_ids, single or batch, cumulative-text streaming."""
    req = await parse(GenerateRequest)
    inputs, batch = await _inputs(state, req)
    prompts = [p.ids for p in inputs]
    if req.logprob_start_len < -1:
        raise ApiError(400, f"logprob_start_len: must be -1 (the last prompt token) or >= 0, got "
                       f"{req.logprob_start_len}", "logprob_start_len")
    if req.return_logprob:
        for i, ids in enumerate(prompts):
            if req.logprob_start_len >= len(ids):  # SGLang refuses it too (a 400)
                raise ApiError(400, f"logprob_start_len: must be below the prompt's {len(ids)} tokens"
                               f"{f' (prompt {i})' if batch else ''}, got {req.logprob_start_len}",
                               "logprob_start_len")
    given = req.sampling_params
    sps = _per_prompt(SGLangSamplingParams() if given is None else given, len(prompts), "sampling_params")
    if not batch and isinstance(req.rid, list):
        raise ApiError(400, "rid: a single prompt takes a single rid", "rid")
    if batch and isinstance(req.rid, str):
        raise ApiError(400, "rid: a batch takes a list of rids, one per prompt", "rid")
    rids = _per_prompt(req.rid, len(prompts), "rid")
    loras = [_lora(state, value, f"lora_path[{i}]" if isinstance(req.lora_path, list) else "lora_path")
             for i, value in enumerate(_per_prompt(req.lora_path, len(prompts), "lora_path"))]
    try:
        params = [_params(sp, req, len(ids), state.sampling_defaults) for sp, ids in zip(sps, prompts)]
        for p, lora in zip(params, loras):
            p.lora = lora
        for sp, p in zip(sps, params):
            await attach_grammar(state, p, guide_spec(sp))
    except InvalidRequestError as e:
        raise _in_sglang_names(e) from None
    async with state.admit() as flight:
        try:
            for i, (prompt, p) in enumerate(zip(inputs, params)):
                await flight.submit(rids[i] or new_id("gen"), prompt.ids, p, req.priority or 0, prompt.images,
                                    prompt.embeds)
        except InvalidRequestError as e:
            given = "text" if req.text is not None else "input_ids" if req.input_ids is not None else "input_embeds"
            raise _in_sglang_names(e, given) from None
        if req.stream:
            return sse.sse_response(flight.respond(_stream(state, req, prompts, params, flight.streams, batch)))
        results = await flight.collect()
    items = [_item(state, req, res, o, p, stream) for res, p, stream in zip(results, params, flight.streams)
             for o in res.outputs]
    return jsonify(items if batch or len(items) > 1 else items[0])


def _lora(state: ServerState, value: Any, where: str) -> str | None:
    """SGLang's lora_path: a loaded adapter's name (--lora-modules name=path), or its path; None:
    the base model."""
    if value is None:
        return None
    adapters = state.model_names.adapters
    for name, path, _ in adapters:
        if value in (name, path):
            return name
    loaded = ", ".join(a[0] for a in adapters) or "none: the server was started without --lora-modules"
    raise ApiError(400, f"{where}: no LoRA adapter {value!r} is loaded ({loaded})", where)


def _in_sglang_names(e: InvalidRequestError, prompt: str = "text") -> ApiError:
    """An engine refusal in the names the SGLang client sent: `max_tokens` is its
    `sampling_params.max_new_tokens`, `prompt` its text or input_ids."""
    return sampling.in_protocol_names(e, sampling.SGLANG, "sampling_params.",
                                      {"prompt": prompt, "prompt_logprobs_start": "logprob_start_len",
                                       "lora": "lora_path"})


def _item(state: ServerState, req: GenerateRequest, res: RequestOutput, out: CompletionOutput,
          params: SamplingParams, stream: EngineStream, index: int | None = None,
          prompt_logprobs: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
    prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else res.prompt_logprobs
    # Each of n samples is its own request in SGLang, with its own id (rid_0, rid_1, ...).
    rid = res.request_id if params.n == 1 else f"{res.request_id}_{out.index}"
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": _finish(out, params),
        "prompt_tokens": len(res.prompt_token_ids), "completion_tokens": len(out.token_ids),
        "cached_tokens": res.num_cached_tokens, "e2e_latency": time.monotonic() - stream.start,
    }
    if (drafts := draft_counts(state, res.num_draft_tokens, res.num_accepted_draft_tokens)) is not None:
        meta |= _speculation(*drafts)
    if req.return_logprob:
        meta |= _logprobs(state, req, out.logprobs or [], res.prompt_token_ids, prompt_logprobs)
    item = {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}
    if index is not None:
        item["index"] = index
    return item


def _speculation(drafted: int, accepted: int) -> dict[str, Any]:
    """The request's speculative tokens so far (over its samples): proposed, accepted, and the rate."""
    return {"spec_draft_token_num": drafted, "spec_accept_token_num": accepted,
            "spec_accept_rate": accepted / drafted if drafted else 0.0}


def _finish(out: CompletionOutput, params: SamplingParams) -> dict[str, Any] | None:
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == "stop":  # SGLang names what matched: a stop string, or a token id (EOS included)
        matched = out.stop_reason if out.stop_reason is not None else (out.token_ids[-1] if out.token_ids else None)
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": params.max_tokens if params.max_tokens is not None else len(out.token_ids)}
    return {"type": "abort", "message": str(out.stop_reason or "aborted")}


def _logprobs(state: ServerState, req: GenerateRequest, lps: list[TokenLogprob], prompt_ids: list[int],
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any]:
    def entry(token_id: int, logprob: float | None) -> list[Any]:
        return [logprob, token_id, token_text(state.tokenizer, token_id) if req.return_text_in_logprobs else None]

    # Input logprobs from logprob_start_len on (the last prompt token by default). As in SGLang the
    # first is always null, whatever precedes it; a prompt of embeddings has no tokens to list.
    first = logprob_start(req, len(prompt_ids))
    positions = range(first, len(prompt_ids)) if req.input_embeds is None else range(0)
    inputs = [prompt_lps[p] if prompt_lps is not None and p > first else None for p in positions]
    meta: dict[str, Any] = {
        "input_token_logprobs": [entry(prompt_ids[p], lp.logprob if lp else None) for p, lp in zip(positions, inputs)],
        "output_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in lps],
    }
    if req.top_logprobs_num > 0:
        meta |= {"input_top_logprobs": [[entry(i, v) for i, v in lp.top] if lp else None for lp in inputs],
                 "output_top_logprobs": [[entry(i, v) for i, v in lp.top] for lp in lps]}
    return meta


async def _stream(state: ServerState, req: GenerateRequest, prompts: list[list[int]], params: list[SamplingParams],
                  streams: list[EngineStream], batch: bool) -> AsyncIterator[bytes]:
    """SGLang streams the cumulative text (and output ids) of one output per event."""
    totals: dict[tuple[int, int], CompletionOutput] = {}
    prompt_lps: dict[int, list[TokenLogprob | None]] = {}  # sent by the engine with the first delta only
    n = max(p.n for p in params)
    try:
        async for i, delta in merged(streams):
            if delta.prompt_logprobs is not None:
                prompt_lps[i] = delta.prompt_logprobs
            for o in delta.outputs:
                acc = totals.setdefault((i, o.index), CompletionOutput(o.index, "", []))
                acc.text += o.text
                acc.token_ids = acc.token_ids + o.token_ids
                if o.logprobs is not None:
                    acc.logprobs = (acc.logprobs or []) + o.logprobs
                acc.finish_reason, acc.stop_reason = o.finish_reason, o.stop_reason
                index = i * n + o.index if batch or n > 1 else None
                yield sse.event(_item(state, req, delta, acc, params[i], streams[i], index, prompt_lps.get(i)))
    except Exception as e:
        yield sse.event(error_event(e, "sglang"))
    yield sse.DONE


async def abort_request(state: ServerState) -> Response:
    """Abort one request by rid (a sample of n by its own rid, `<rid>_<i>`), or all of them."""
    req = await parse(AbortRequest)
    if req.abort_all:
        state.engine.abort_all()
    elif req.rid:
        state.engine.abort_by_rid(req.rid)
    else:
        raise ApiError(400, "give rid or abort_all", "rid")
    return Response("", status=200)


async def get_model_info(state: ServerState) -> Response:
    """SGLang's model info (clients read is_generation and the model path)."""
    return jsonify({"model_path": state.model_name, "tokenizer_path": state.model_name, "is_generation": True,
                    "max_model_len": state.max_model_len})


async def get_server_info(state: ServerState) -> Response:
    """SGLang's server info: the version and how the engine was sized (its EngineInfo)."""
    return jsonify({"version": __version__, "model_path": state.model_name, "served_model_name": state.model_name,
                    **dataclasses.asdict(state.engine.info),
                    "max_concurrent_requests": state.max_concurrent_requests})


async def flush_cache(state: ServerState) -> Response:
    """SGLang's: forget the prefix cache. Unlike SGLang's radix cache it may be flushed while
    requests run: the pages they hold stay theirs."""
    dropped = await state.engine.reset_prefix_cache()
    return Response(f"Cache flushed: {dropped} cached pages freed.\n", status=200, content_type="text/plain")


async def health_generate(state: ServerState) -> Response:
    """SGLang's deep health check: generate one token."""
    async with state.admit() as flight:
        await flight.submit(new_id("health"), state.tokenizer.encode("ping"), SamplingParams(max_tokens=1))
        await flight.collect()
    return Response("", status=200)


def register(app: Quart, state: ServerState) -> None:
    route(app, state, "/generate", generate, "POST", GenerateRequest)
    route(app, state, "/abort_request", abort_request, "POST", AbortRequest)
    route(app, state, "/get_model_info", get_model_info, "GET")
    route(app, state, "/health_generate", health_generate, "GET")
    for rule in ("/get_server_info", "/server_info"):
        route(app, state, rule, get_server_info, "GET")
    for method in ("GET", "POST"):  # SGLang takes either
        route(app, state, "/flush_cache", flush_cache, method)
