"""Which request fields each protocol accepts, in one place: every field is honoured, accepted and
deliberately ignored (the tables below, each with its reason), or refused with a 400 naming it.

Honoured fields are the request models' own (openai_protocol.py, openai_responses.py, sglang.py,
classify.py, embeddings.py, scoring.py). A field is accepted and ignored only when ignoring it
cannot change what is generated: a hint for another server's billing, storage, tracing or routing,
or a detail of an input that the server derives itself (image hashes). A field whose absence would change the
output is never on a table: it is honoured or refused. A table may name a declared field (`user`):
it is type-checked, then unused. Anything else gets a 400 whose message and `param` name it (code
"unknown_parameter", with the nearest honoured name when one is close: a typo such as `max_token`
is refused, not dropped); known fields refused with a reason (OPENAI_CHAT_REFUSED) say why instead.
Request models inherit the rule from `KnownFields`.

Where a protocol allows extra keys, they stay allowed:
- Triton / KServe generate: the top level and `parameters` are free-form in the spec; triton.py
  checks the union itself against its own names plus TRITON below, and refuses any other by name;
- OpenAI chat messages and content parts: extra keys pass through to the chat template
  (`reasoning_content`, ...); tool definitions are free-form JSON schemas;
- rerank documents given as objects: Cohere's carry any keys, and only `text` is ranked.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

Reasons = Mapping[str, str]  # field -> why it is ignored (or refused)

_USER = "an end-user id for the provider's abuse monitoring: nothing is monitored on a self-hosted server"
_STREAM_CHUNKS = "tokens gathered per streamed chunk: each piece is sent as it is decoded; the joined text is the same"

# OpenAI completions (/v1 and /v3), with FastDeploy's extras.
OPENAI_COMPLETIONS: Reasons = {
    "user": _USER,
    "mm_hashes": "FastDeploy's hashes of the request's images, for its multimodal cache: the server hashes "
                 "each image's decoded pixels itself (its prefix and encoder caches key images by them)",
    "include_draft_logprobs": "FastDeploy's logprobs of a draft model's proposals: there is no draft model "
                              "(prompt lookup proposes without logprobs), and FastDeploy without one returns none",
    "max_streaming_response_tokens": f"FastDeploy's {_STREAM_CHUNKS}",
    "trace_context": "FastDeploy's OpenTelemetry trace context: nothing is traced here",
}

# OpenAI chat completions (/v1 and /v3).
OPENAI_CHAT: Reasons = {
    **OPENAI_COMPLETIONS,
    "safety_identifier": _USER,
    "store": "OpenAI's stored completions: nothing is stored here, whatever its value",
    "metadata": "tags for a stored completion: nothing is stored here",
    "service_tier": "OpenAI's processing tier (price and latency): there is one tier, and the text does not "
                    "depend on it",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache: the prefix cache here matches prompts by "
                        "their tokens",
    "prompt_cache_retention": "how long OpenAI keeps cached prefixes: the prefix cache here keeps them while "
                              "pages last",
    "prompt_cache_options": "OpenAI's cache breakpoints and lifetime: the prefix cache here needs none",
    "prediction": "a Predicted Output only makes OpenAI faster; the text is the model's own either way (it is "
                  "not used as a draft here)",
}

# Known chat fields that ignoring would change the answer for: refused, with the reason.
OPENAI_CHAT_REFUSED: Reasons = {
    "audio": "audio output is not available: only text is generated",
    "functions": "the deprecated function-calling fields are not read: send tools",
    "function_call": "the deprecated function-calling fields are not read: send tool_choice",
    "reasoning_effort": "the amount of reasoning cannot be asked for: the model thinks as it was trained "
                        "(chat_template_kwargs switch thinking off where the template allows)",
    "verbosity": "the served model has no verbosity control",
    "web_search_options": "there is no hosted web search",
    "moderation": "no moderation model runs here",
}

# OpenAI responses: declared, echoed in the Response, changing nothing (openai_responses.py's
# docstring lists what it refuses instead).
RESPONSES: Reasons = {
    "user": _USER,
    "safety_identifier": _USER,
    "metadata": "tags for a stored response: kept with it and echoed, changing nothing else",
    "prompt_cache_key": OPENAI_CHAT["prompt_cache_key"],
    "max_tool_calls": "caps calls to OpenAI's built-in tools, which are refused here",
    "service_tier": "'auto' and 'default' only (others are refused): there is one tier",
}

# SGLang's /generate body, and its sampling_params.
SGLANG_GENERATE: Reasons = {
    "log_metrics": "whether SGLang records this request in its metrics (its own health check turns it off): "
                   "/metrics counts every request here",
    "data_parallel_rank": "the data-parallel rank to run on (sgl-model-gateway's dp-aware mode sends it with "
                          "every request): there is one engine here",
    "routed_dp_rank": "SGLang's newer name for data_parallel_rank: there is one engine here",
}
SGLANG_SAMPLING: Reasons = {
    "stream_interval": f"SGLang's {_STREAM_CHUNKS}",
    "custom_params": "arguments for custom_logit_processor, which is refused: nothing reads them",
}
# SGLang's reward-model /classify (its EmbeddingReqInput).
SGLANG_CLASSIFY: Reasons = {"log_metrics": SGLANG_GENERATE["log_metrics"]}

# vLLM's and SGLang's /v1/classify, OpenAI's /v1/embeddings, vLLM's /v1/score and /v1/rerank.
CLASSIFY: Reasons = {"user": _USER}
EMBEDDINGS: Reasons = {"user": _USER}
SCORE: Reasons = {"user": _USER}

# Triton's generate `parameters` (or top level) that triton.py accepts and does not read; `end_id`
# is read (triton._check_end_id: only the model's own EOS ids are accepted).
TRITON: Reasons = {
    "stream": "the vLLM backend's streaming switch: the route decides (generate answers whole, generate_stream "
              "streams); the text is the same",
    "pad_id": "TensorRT-LLM's token for padding its output tensors (its examples send it beside end_id): "
              "no output is padded here",
}


class KnownFields(BaseModel):
    """A request model that refuses any field it does not declare, unless IGNORED lists it (the
    field is then dropped before validation). REFUSED names known fields to refuse with a reason."""

    model_config = ConfigDict(extra="forbid")  # what the check below leaves can only be declared
    IGNORED: ClassVar[Reasons] = {}
    REFUSED: ClassVar[Reasons] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own type error follows
        declared = _declared(cls)
        unknown = [k for k in data if k not in declared and k not in cls.IGNORED]
        if unknown:
            name = unknown[0]
            why, code = (cls.REFUSED[name], "not_supported") if name in cls.REFUSED else (
                _unknown(name, declared), "unknown_parameter")
            if len(unknown) > 1:
                why += f"; also not accepted: {', '.join(unknown[1:])}"
            # Raised as a validation error at this model's place; errors.py adds `field` to the path.
            raise PydanticCustomError("unknown_field", "{why}", {"field": name, "why": why, "code": code})
        return {k: v for k, v in data.items() if k in declared}


@functools.cache
def _declared(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(f.alias or name for name, f in model.model_fields.items())


def _unknown(name: str, declared: frozenset[str]) -> str:
    near = difflib.get_close_matches(name, sorted(declared), n=1, cutoff=0.8)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return f"unknown parameter, refused rather than ignored{hint}"
