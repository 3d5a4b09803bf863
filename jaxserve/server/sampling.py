"""Each protocol's request fields -> SamplingParams, as one table per protocol.

A row names the protocol's field, the SamplingParams field it sets, the value a null (or absent)
field means, and how the value is converted; `build` reads a request through a table. What a
table cannot say (a protocol's own logprob switches, bad words that need the tokenizer, the
max_tokens that chat and completions spell differently) is passed to `build` as computed fields.
Range checks are SamplingParams.validate's, in the engine's one place (the speculative-decoding
fields' are Engine.add_request's: they depend on how the server was started). Fields a protocol
carries that this server knows and cannot honour yet are refused by `refuse_unhonoured`, naming
the field, before a table is read.

Beam search (jaxserve.engine.beam) is asked for with vLLM's `use_beam_search: true` (width best_of,
default n) on every protocol that carries it, and on OVMS's routes (`/v3/...`) also by best_of > 1
alone, as OVMS documents ("increase best_of to enable beam search"); `length_penalty` and
`early_stopping` (true, false or "never") apply to it and are refused without it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.server.errors import ApiError

NUMBERS = (int, float)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str  # the protocol's field
    param: str  # the SamplingParams field it sets
    default: Any = None  # what null / absent means (None: SamplingParams' own default)
    convert: Callable[[Any], Any] | None = None
    types: tuple[type, ...] | None = None  # accepted JSON types (protocols without a schema: Triton)


def build(fields: Iterable[Field], value_of: Callable[[str], Any], defaults: Mapping[str, Any] | None = None,
          **computed: Any) -> SamplingParams:
    """SamplingParams from a request: `value_of(name)` is the request's value of a field (None when
    absent); `computed` sets fields no table row covers. `defaults` (SamplingParams fields: the
    model's generation_config.json, jaxserve.generation_config) stand in for what the request
    leaves unset, before the protocol's own defaults; beam search takes none of them (it scores
    the model's own probabilities)."""
    fields = tuple(fields)
    beams = bool(computed.get("use_beam_search")) or any(
        f.param == "use_beam_search" and value_of(f.name) for f in fields)
    defaults = {} if beams or defaults is None else dict(defaults)
    # The model's token limit is a soft one: the engine cuts it to the room the prompt leaves.
    default_max = defaults.pop("max_tokens", None)
    kwargs: dict[str, Any] = {}
    for f in fields:
        value = value_of(f.name)
        if value is None:
            if f.param in defaults:
                kwargs[f.param] = defaults[f.param]
                continue
            if f.default is None:
                continue
            value = f.default
        elif f.types is not None and (isinstance(value, bool) and bool not in f.types or not isinstance(value, f.types)):
            raise ApiError(400, f"{f.name}: expected {' or '.join(t.__name__ for t in f.types)}, got {value!r}", f.name)
        kwargs[f.param] = f.convert(value) if f.convert is not None else value
    if default_max is not None and (computed["max_tokens"] if "max_tokens" in computed else kwargs.get("max_tokens")) \
            is None:  # the request set no limit (a protocol's own default counts as one: completions' 16)
        kwargs.pop("max_tokens", None)
        computed |= {"max_tokens": None, "default_max_tokens": default_max}
    # Defaults for knobs the protocol has no field for (the Responses API's top_k) apply too.
    tabled = {f.param for f in fields} | set(computed)
    kwargs |= {k: v for k, v in defaults.items() if k not in tabled}
    return SamplingParams(**kwargs, **computed)


def in_protocol_names(e: InvalidRequestError, fields: Sequence[Field], prefix: str = "",
                      names: dict[str, str] | None = None) -> ApiError:
    """The engine's refusal (in SamplingParams' names) as a 400 in the names the client sent: the
    parameter under `prefix` ("sampling_params.max_new_tokens" for SGLang's max_tokens), and every
    renamed field the message mentions ("prompt has 9 tokens and max_new_tokens is 600"). `names`
    adds engine names no table row covers (the prompt, a computed field)."""
    renamed = {f.param: f.name for f in reversed(fields) if f.name != f.param}  # the first row wins
    where = {f.param: prefix + f.name for f in reversed(fields)} | (names or {})
    param = where.get(e.param, e.param)
    message = str(e).removeprefix(f"{e.param}: ")
    if renamed:
        message = re.sub(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b", lambda m: renamed[m.group(1)], message)
    return ApiError(400, f"{param}: {message}", param)


UNHONOURED: tuple[str, ...] = ()  # fields refuse_unhonoured refuses whatever their value (none today)


def refuse_unhonoured(value_of: Callable[[str], Any], prefix: str = "") -> None:
    """400 for fields that cannot go together: OVMS's num_assistant_tokens and
    assistant_confidence_threshold (the engine refuses each where the server's speculation does
    not use it). `value_of` as build's; `prefix` is where the protocol keeps the fields
    ("sampling_params." for SGLang), for the name in the error."""
    threshold = value_of("assistant_confidence_threshold")
    if threshold is not None and value_of("num_assistant_tokens") is not None:  # OVMS refuses both too
        raise ApiError(400, f"{prefix}num_assistant_tokens, {prefix}assistant_confidence_threshold: mutually "
                       "exclusive, give one at most", f"{prefix}assistant_confidence_threshold")


def refuse_streamed_beams(params: SamplingParams, stream: bool | None, name: str = "use_beam_search") -> None:
    """Beam search knows its beams only when it ends: nothing to stream before."""
    if stream and params.use_beam_search:
        raise ApiError(400, f"{name}: beam search returns its beams when the search ends; set stream to false", name)


def stop_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def token_bias(name: str) -> Callable[[dict], dict[int, float]]:
    """logit_bias keys are token ids written as JSON strings."""

    def convert(bias: dict) -> dict[int, float]:
        try:
            return {int(k): v for k, v in bias.items()}
        except ValueError:
            raise ApiError(400, f"{name}: keys must be token ids (integers as strings)", "logit_bias") from None

    return convert


# OpenAI completions and chat (and vLLM's extras on them).
OPENAI = (
    Field("n", "n"), Field("best_of", "best_of"), Field("min_tokens", "min_tokens"),
    Field("temperature", "temperature", 1.0), Field("top_p", "top_p", 1.0), Field("top_k", "top_k", -1),
    Field("min_p", "min_p", 0.0), Field("frequency_penalty", "frequency_penalty"),
    Field("presence_penalty", "presence_penalty"), Field("repetition_penalty", "repetition_penalty", 1.0),
    Field("logit_bias", "logit_bias", convert=token_bias("logit_bias")), Field("seed", "seed"),
    Field("ignore_eos", "ignore_eos"), Field("stop", "stop", convert=stop_list),
    Field("stop_token_ids", "stop_token_ids", convert=list), Field("allowed_token_ids", "allowed_token_ids"),
    Field("cache_salt", "cache_salt"),
    Field("include_stop_str_in_output", "include_stop_str_in_output"), Field("prompt_logprobs", "prompt_logprobs"),
    Field("skip_special_tokens", "skip_special_tokens"),
    Field("spaces_between_special_tokens", "spaces_between_special_tokens"),
    Field("num_assistant_tokens", "num_assistant_tokens"), Field("max_ngram_size", "max_ngram_size"),
    Field("length_penalty", "length_penalty"), Field("early_stopping", "early_stopping"),
    Field("assistant_confidence_threshold", "assistant_confidence_threshold"),
)

# SGLang's /generate sampling_params.
SGLANG = (
    Field("n", "n"), Field("max_new_tokens", "max_tokens"), Field("min_new_tokens", "min_tokens"),
    Field("stop", "stop", convert=stop_list), Field("stop_token_ids", "stop_token_ids", convert=list),
    Field("temperature", "temperature"), Field("top_p", "top_p"), Field("top_k", "top_k"), Field("min_p", "min_p"),
    Field("frequency_penalty", "frequency_penalty"), Field("presence_penalty", "presence_penalty"),
    Field("repetition_penalty", "repetition_penalty"), Field("ignore_eos", "ignore_eos"),
    Field("skip_special_tokens", "skip_special_tokens"),
    Field("spaces_between_special_tokens", "spaces_between_special_tokens"),
    Field("no_stop_trim", "include_stop_str_in_output"), Field("sampling_seed", "seed"),
    Field("logit_bias", "logit_bias", convert=token_bias("sampling_params.logit_bias")),
    Field("num_assistant_tokens", "num_assistant_tokens"), Field("max_ngram_size", "max_ngram_size"),
    Field("use_beam_search", "use_beam_search"), Field("length_penalty", "length_penalty"),
    Field("early_stopping", "early_stopping"),
    Field("assistant_confidence_threshold", "assistant_confidence_threshold"),
)

# Triton's generate extension `parameters` (the vLLM backend's names, and TensorRT-LLM's).
TRITON = (
    Field("max_tokens", "max_tokens", types=(int,)), Field("min_tokens", "min_tokens", types=(int,)),
    Field("temperature", "temperature", types=NUMBERS), Field("top_p", "top_p", types=NUMBERS),
    Field("top_k", "top_k", types=(int,)), Field("min_p", "min_p", types=NUMBERS),
    Field("seed", "seed", types=(int,)), Field("random_seed", "seed", types=(int,)),
    Field("frequency_penalty", "frequency_penalty", types=NUMBERS),
    Field("presence_penalty", "presence_penalty", types=NUMBERS),
    Field("repetition_penalty", "repetition_penalty", types=NUMBERS), Field("ignore_eos", "ignore_eos", types=(bool,)),
    Field("n", "n", types=(int,)), Field("best_of", "best_of", types=(int,)),
    Field("skip_special_tokens", "skip_special_tokens", types=(bool,)),
    Field("include_stop_str_in_output", "include_stop_str_in_output", types=(bool,)),
    Field("num_assistant_tokens", "num_assistant_tokens", types=(int,)),
    Field("max_ngram_size", "max_ngram_size", types=(int,)),
    Field("use_beam_search", "use_beam_search", types=(bool,)),
    Field("length_penalty", "length_penalty", types=NUMBERS),
    Field("early_stopping", "early_stopping", types=(bool, str)),
    Field("assistant_confidence_threshold", "assistant_confidence_threshold", types=NUMBERS),
)
