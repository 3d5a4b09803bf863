"""Embedding models: an encoder (BertModel / RobertaModel / XLMRobertaModel) or a causal decoder
(Qwen3-Embedding-style) whose hidden states are pooled into one vector per input, then
L2-normalised if the checkpoint's sentence-transformers configuration says so. The step returns
the pooled vectors; normalising (and cutting Matryoshka dimensions) is the host's, per request
(`jaxserve.engine.classify_batcher.finish_embedding`).

A sentence-transformers directory lists its pipeline in `modules.json`: the Transformer, then a
Pooling module (`1_Pooling/config.json`: CLS, mean or last token) and often a Normalize module.
That file is what tells an embedding checkpoint from a causal LM (Qwen3-Embedding's config.json
says Qwen3ForCausalLM). Without it, a bare encoder pools [CLS] and a decoder its last token, both
normalised (vLLM's defaults). Modules that change the vector further (Dense projections, ...)
are refused at start-up, naming the module, rather than skipped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Union

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.bert import ENCODER_EMBEDDERS, Encoder, EncoderConfig, encoder_config_from_hf
from jaxserve.models.classifier import (
    Classifier,
    ClassifierConfig,
    OnABody,
    build_classifier,
    packed_decoder_hidden_states,
)
from jaxserve.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig, UnsupportedModelError, decoder_config_from_hf
from jaxserve.models.decoder import Decoder

Array = jax.Array

POOLING = ("cls", "mean", "last")
# Bare decoder bodies (saved without the LM head) -> the causal LM whose body they are.
DECODER_BODIES = {arch.replace("ForCausalLM", "Model"): arch for arch in SUPPORTED_ARCHITECTURES}
# sentence-transformers' Pooling flags -> ours; the other modes (max, mean_sqrt_len, weightedmean)
# are refused.
_ST_POOLING = {"cls": "cls", "mean": "mean", "lasttoken": "last"}


@dataclasses.dataclass(frozen=True)
class SentenceTransformersConfig:
    """What the sentence-transformers files of a directory say (None: they do not say)."""

    pooling: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None


@dataclasses.dataclass(frozen=True)
class EmbedderConfig(OnABody):
    architecture: str
    body: DecoderConfig | EncoderConfig
    pooling: str  # cls | mean | last
    normalize: bool
    # Matryoshka models may be cut to their first `dimensions` values (then renormalised); None:
    # any size, () : not a Matryoshka model.
    matryoshka_dimensions: tuple[int, ...] | None = ()
    max_seq_length: int | None = None  # sentence-transformers' input limit: the default context
    pad_token_id: int | None = None

    @property
    def dimensions(self) -> int:
        """Length of an embedding."""
        return self.body.hidden_size

    @property
    def is_matryoshka(self) -> bool:
        return self.matryoshka_dimensions != ()

    def dimensions_problem(self, dimensions: int | None) -> str | None:
        """Why a request may not cut this model's vectors to `dimensions` (None: it may, or asks
        for the whole vector); the server answers it as a 400, LLM.embed as a ValueError."""
        if dimensions is None:
            return None
        if not self.is_matryoshka:
            return (f"model {self.architecture} does not support Matryoshka embeddings (its config.json declares "
                    f"neither matryoshka_dimensions nor is_matryoshka); omit dimensions for its "
                    f"{self.dimensions}-value vectors")
        allowed = self.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            return f"must be one of {list(allowed)} (the model's Matryoshka sizes), got {dimensions}"
        if not 1 <= dimensions <= self.dimensions:
            return f"must be in [1, {self.dimensions}], got {dimensions}"
        return None


def read_sentence_transformers(directory: Path) -> SentenceTransformersConfig | None:
    """The pooling, normalisation and input limit of a sentence-transformers directory; None when
    it has no modules.json. Raises UnsupportedModelError for a module or pooling mode we cannot run."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _st_pooling(json.loads((directory / module.get("path", "") / "config.json").read_text()))
        else:
            raise UnsupportedModelError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} ({module.get('path')}) is not "
                "supported; embedding models may hold a Transformer, a Pooling and a Normalize module")
    max_seq_length = None
    bert_config = directory / "sentence_bert_config.json"
    if bert_config.is_file():
        max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return SentenceTransformersConfig(pooling, normalize, None if max_seq_length is None else int(max_seq_length))


def _st_pooling(cfg: dict[str, Any]) -> str:
    if isinstance(cfg.get("pooling_mode"), str):
        modes = [cfg["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        modes = ["lasttoken" if m == "lasttoken" else m.removesuffix("_token").removesuffix("_tokens") for m in modes]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise UnsupportedModelError(f"sentence-transformers pooling {modes or '(none)'} is not supported; one of "
                                    "cls, mean and lasttoken is")
    if cfg.get("include_prompt") is False:
        raise UnsupportedModelError("sentence-transformers pooling with include_prompt=false is not supported")
    return _ST_POOLING[modes[0]]


def is_embedding_checkpoint(cfg: dict[str, Any], directory: Path) -> bool:
    """A bare encoder or decoder body, or any directory sentence-transformers can load."""
    archs = cfg.get("architectures") or []
    return any(a in ENCODER_EMBEDDERS or a in DECODER_BODIES for a in archs) or (directory / "modules.json").is_file()


def embedder_config_from_hf(cfg: dict[str, Any], directory: Path) -> EmbedderConfig:
    """The embedding model of a HF directory (config.json plus its sentence-transformers files)."""
    archs = list(cfg.get("architectures") or [])
    st = read_sentence_transformers(directory) or SentenceTransformersConfig()
    encoder = next((a for a in archs if a in ENCODER_EMBEDDERS), None)
    decoder = next((DECODER_BODIES.get(a, a) for a in archs if a in DECODER_BODIES or a in SUPPORTED_ARCHITECTURES),
                   None)
    body: DecoderConfig | EncoderConfig
    if encoder is not None:
        body = encoder_config_from_hf({**cfg, "architectures": [encoder]}, 0)
        arch = encoder
    elif decoder is not None:
        # No LM head: tying keeps the Decoder from allocating one.
        body = dataclasses.replace(decoder_config_from_hf({**cfg, "architectures": [decoder]}),
                                   tie_word_embeddings=True)
        arch = archs[0]
    else:
        raise UnsupportedModelError(
            f"architecture {archs or '(none given)'} is not an embedding model jaxserve runs; supported: "
            f"{', '.join(ENCODER_EMBEDDERS)}, and causal LMs ({', '.join(SUPPORTED_ARCHITECTURES)}) or their bare "
            "bodies with a sentence-transformers configuration")
    pooling = st.pooling or ("cls" if encoder is not None else "last")
    normalize = True if st.normalize is None else st.normalize
    dims = cfg.get("matryoshka_dimensions")
    matryoshka: tuple[int, ...] | None = (tuple(int(d) for d in dims) if dims
                                          else None if cfg.get("is_matryoshka") else ())
    pad = cfg.get("pad_token_id")
    return EmbedderConfig(architecture=arch, body=body, pooling=pooling, normalize=normalize,
                          matryoshka_dimensions=matryoshka, max_seq_length=st.max_seq_length,
                          pad_token_id=None if pad is None else int(pad))


def pool(hidden: Array, segments: Array, pool_rows: Array, how: str) -> Array:
    """hidden [T, H] of a packed row -> float32 [S, H]: the token at pool_rows (cls / last), or the
    mean over each segment's tokens (segment -1 is padding; an unused row's mean is 0)."""
    hidden = hidden.astype(jnp.float32)
    if how != "mean":
        return hidden[pool_rows]
    n = pool_rows.shape[0]
    ids = jnp.where(segments < 0, n, segments)  # padding goes to an extra segment, dropped below
    sums = jax.ops.segment_sum(hidden, ids, num_segments=n + 1)[:n]
    counts = jax.ops.segment_sum(jnp.ones_like(segments, jnp.float32), ids, num_segments=n + 1)[:n]
    return sums / jnp.maximum(counts, 1.0)[:, None]


class Embedder(nnx.Module):
    """Encoder or decoder body -> pooled float32 vectors; the body's parameters live under
    `model`, named as the classifier's are."""

    def __init__(self, cfg: EmbedderConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.model = Encoder(cfg.body, dtype) if isinstance(cfg.body, EncoderConfig) else Decoder(cfg.body, dtype)

    def __call__(self, tokens: Array, positions: Array, segments: Array, pool_rows: Array, token_types: Array,
                 max_segment: int | None = None) -> Array:
        """One packed step (as the classifiers take it) -> pooled float32 [S, hidden], not normalised."""
        if isinstance(self.model, Encoder):
            hidden = self.model.packed_hidden_states(tokens, positions, segments, token_types, max_segment)
        else:
            hidden = packed_decoder_hidden_states(self.model, tokens, positions, segments, max_segment)
        return pool(hidden, segments, pool_rows, self.cfg.pooling)


# What the classify engine runs: one output row per input, classes or an embedding.
PoolingConfig = Union[ClassifierConfig, EmbedderConfig]
PoolingModel = Union[Classifier, Embedder]


def build_pooling_model(cfg: PoolingConfig, dtype: Any = jnp.float32) -> PoolingModel:
    return Embedder(cfg, dtype) if isinstance(cfg, EmbedderConfig) else build_classifier(cfg, dtype)
