"""`POST /v1/embeddings` (OpenAI's embeddings API, as vLLM and SGLang serve it) on an
embedding-model server.

`input` is a string, a list of strings, token ids or a list of token-id lists; `encoding_format`
"float" gives lists of numbers, "base64" the little-endian float32 bytes (what the official client
asks for by default and decodes). `dimensions` cuts a Matryoshka model's vector to its first
values (then renormalises, if the model normalises), and is refused for a model that does not
declare Matryoshka support, as vLLM does. vLLM's `normalize` overrides the checkpoint's choice.
Text is the whole model input, so special-token strings in it are the tokens (as
sentence-transformers tokenizes it); no input is ever truncated unless `truncate_prompt_tokens`
asks.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import ConfigDict
from quart import Quart, Response, jsonify, request

from jaxserve.engine.classify_batcher import finish_embedding
from jaxserve.models.embedder import EmbedderConfig
from jaxserve.server import accepted_fields
from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.errors import ApiError
from jaxserve.server.generation import new_id, route

if TYPE_CHECKING:
    from jaxserve.server.classify import ClassifyState


class EmbeddingRequest(KnownFields):
    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.EMBEDDINGS
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None  # None: as the checkpoint's sentence-transformers config says
    priority: int = 0


ROUTES = (("/v1/embeddings", EmbeddingRequest),)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return [float(x) for x in vector]


async def embeddings(state: ClassifyState) -> Response:
    """Embed a string or a list of strings (or token ids): one vector per input."""
    from jaxserve.server.classify import INPUT_SHAPES, encode_inputs, parse, request_ids, require_task

    require_task(state, "embed", "/v1/embeddings")
    req = parse(EmbeddingRequest, await request.get_data(cache=False), "input", INPUT_SHAPES)
    state.model_names.check(req.model)
    cfg = state.config
    assert isinstance(cfg, EmbedderConfig)
    problem = cfg.dimensions_problem(req.dimensions)
    if problem:
        raise ApiError(400, f"dimensions: {problem}", "dimensions")
    inputs = encode_inputs(state, req.input, "input", req.add_special_tokens, req.truncate_prompt_tokens,
                           whole_prompt=True)
    results = await state.run(request_ids(None, len(inputs), "embd"), inputs, req.priority)
    normalize = cfg.normalize if req.normalize is None else req.normalize
    num_tokens = sum(r.num_tokens for r in results)
    return jsonify({
        "id": new_id("embd"), "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [{"index": i, "object": "embedding",
                  "embedding": encode_vector(finish_embedding(r.output, normalize, req.dimensions),
                                             req.encoding_format)}
                 for i, r in enumerate(results)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    })


def register(app: Quart, state: ClassifyState) -> None:
    for rule, model in ROUTES:
        route(app, state, rule, embeddings, "POST", model)
