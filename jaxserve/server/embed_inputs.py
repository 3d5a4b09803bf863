"""Prompts sent as embeddings: SGLang's `input_embeds` (JSON rows of floats) and vLLM's
`prompt_embeds` (base64 of a torch.save'd or .npy tensor). Each becomes a prompt of placeholder
ids whose every position takes the client's embedding (jaxserve.engine.embeds), on a server
started with --enable-prompt-embeds; the shape is checked against the model's hidden size."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.engine.embeds import EmbedSpan, embeds_key
from jaxserve.engine.info import EngineInfo
from jaxserve.server.errors import ApiError
from jaxserve.server.tensor_codec import as_prompt_embeds, decode_base64_tensor

PLACEHOLDER_ID = 0  # the ids of an embedded prompt: only its length and positions matter


def check_enabled(info: EngineInfo, param: str) -> None:
    if not info.embed_dim:
        raise ApiError(400, f"{param}: this server takes no embeddings as input; start it with --enable-prompt-embeds",
                       param, code="not_supported")


def embedded_prompt(embeds: np.ndarray, info: EngineInfo, param: str) -> tuple[list[int], tuple[EmbedSpan, ...]]:
    """A prompt of `embeds` [tokens, hidden] (vLLM's shape rules: a leading axis of 1 is dropped,
    any floating-point dtype), held in float32 (the step casts it to the model's dtype)."""
    embeds = as_prompt_embeds(embeds, param, info.embed_dim).astype(np.float32)
    if not np.all(np.isfinite(embeds)):
        raise ApiError(400, f"{param}: embeddings must be finite (no NaN or infinity)", param)
    return [PLACEHOLDER_ID] * embeds.shape[0], (EmbedSpan(0, embeds, embeds_key(embeds)),)


def json_embeds(value: Any, info: EngineInfo, param: str) -> tuple[list[int], tuple[EmbedSpan, ...]]:
    """SGLang's input_embeds of one prompt: a list of rows, each `hidden` floats."""
    check_enabled(info, param)
    if not isinstance(value, list) or not value or not all(isinstance(row, list) for row in value):
        raise ApiError(400, f"{param}: a prompt's embeddings are a list of rows of {info.embed_dim} numbers", param)
    try:
        embeds = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise ApiError(400, f"{param}: every row must hold {info.embed_dim} numbers", param) from None
    return embedded_prompt(embeds, info, param)


MAX_EMBEDS_BYTES = 1 << 30  # one prompt's tensor (the request body limit applies first)


def base64_embeds(value: Any, info: EngineInfo, param: str) -> tuple[list[int], tuple[EmbedSpan, ...]]:
    """vLLM's prompt_embeds of one prompt: base64 of a torch.save'd (or .npy) tensor."""
    check_enabled(info, param)
    if not isinstance(value, str):
        raise ApiError(400, f"{param}: base64 of a torch.save'd tensor", param)
    return embedded_prompt(decode_base64_tensor(value, param, MAX_EMBEDS_BYTES), info, param)
