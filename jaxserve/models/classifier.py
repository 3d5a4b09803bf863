"""Sequence-classification and reward models: which checkpoints they are, their labels, and the
decoder-based classifier (the existing Decoder plus a score head).

A *ForSequenceClassification decoder is the causal LM's body with `score` (a [labels, hidden]
matrix, no bias) in place of the LM head, read at each input's last non-padding token, as HF's
GenericForSequenceClassification does. Qwen2ForRewardModel (Qwen2.5-Math-RM) scores with a
two-layer MLP (`score.0`, ReLU, `score.2`) into one number. BERT-style encoders live in bert.py.

The number of classes is read from the checkpoint's head (the config may not say it); labels come
from `id2label`, else LABEL_i (HF's names), else Class_i when not even the count is declared.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.bert import ENCODER_ARCHITECTURES, ENCODER_CLASSIFIERS, Encoder, EncoderConfig, encoder_config_from_hf
from jaxserve.models.config import (
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    UnsupportedModelError,
    decoder_config_from_hf,
)
from jaxserve.models.decoder import Decoder
from jaxserve.models.layers import Linear
from jaxserve.models.packed_attention import PackedAttention

Array = jax.Array

# classifier architecture -> the causal LM whose body it shares
DECODER_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    "Phi3ForSequenceClassification": "Phi3ForCausalLM",
    "Qwen2ForRewardModel": "Qwen2ForCausalLM",
}
CLASSIFIER_ARCHITECTURES = (*DECODER_CLASSIFIERS, *ENCODER_CLASSIFIERS)
HF_DEFAULT_NUM_LABELS = 2  # what transformers assumes when config.json names no labels


class OnABody:
    """What a model built on a decoder or encoder body (`self.body`) reads from it."""

    body: Union[DecoderConfig, EncoderConfig]

    @property
    def is_encoder(self) -> bool:
        return isinstance(self.body, EncoderConfig)

    @property
    def max_context(self) -> int:
        """Longest input the position embeddings allow."""
        return self.body.max_context if isinstance(self.body, EncoderConfig) else self.body.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.body.vocab_size

    @property
    def dtype(self) -> str:
        return self.body.dtype


@dataclasses.dataclass(frozen=True)
class ClassifierConfig(OnABody):
    architecture: str
    num_labels: int
    labels: tuple[str, ...]  # one per class
    body: Union[DecoderConfig, EncoderConfig]
    pad_token_id: int | None = None
    reward_mlp: bool = False  # Qwen2ForRewardModel's score.0 / ReLU / score.2 head
    # What turns a one-label logit into a /v1/score or /v1/rerank score: sentence-transformers'
    # CrossEncoder activation as the checkpoint names it, sigmoid by default.
    score_activation: str = "sigmoid"
    # vLLM's `classifier_from_token`: a causal LM served as a classifier whose head is its LM
    # head's rows for these tokens; with `is_original_qwen3_reranker` (token_difference), one
    # label, the second token's row minus the first's, so its sigmoid is the softmax probability
    # of the second token against the first (Qwen3-Reranker's P("yes") over "no"/"yes").
    from_tokens: tuple[str, ...] = ()
    token_difference: bool = False
    problem_type: str | None = None  # config.json's (HF's loss choice): regression, single_/multi_label_classification

    @property
    def class_activation(self) -> str:
        """What turns the head's logits into /v1/classify's `probs` (vLLM's rule, after HF's loss for
        the config's problem_type): softmax over several labels, sigmoid per label for a
        multi-label model or a one-label classifier, identity for a regression or reward head."""
        if self.problem_type == "regression" or self.reward_mlp:
            return "identity"
        if self.problem_type == "multi_label_classification" or self.num_labels == 1:
            return "sigmoid"
        return "softmax"



def architectures(cfg: dict[str, Any]) -> list[str]:
    return list(cfg.get("architectures") or [])


def classifier_architecture(cfg: dict[str, Any]) -> str | None:
    return next((a for a in architectures(cfg) if a in CLASSIFIER_ARCHITECTURES), None)


def class_labels(cfg: dict[str, Any], num_classes: int) -> tuple[str, ...]:
    """Label of each class: id2label; else LABEL_i, HF's own names, when the config declares
    num_labels or says nothing and the head has HF's default 2 outputs (transformers does not write
    a default id2label); else, as a last resort, Class_i. A config that declares another number of
    classes than the head has is refused."""
    raw = cfg.get("id2label") or {}
    try:
        id2label = {int(k): str(v) for k, v in raw.items()}
    except (TypeError, ValueError, AttributeError):
        raise UnsupportedModelError(f"id2label must map class indices to names, got {raw!r}") from None
    declared = cfg.get("num_labels")
    if declared is None and id2label:
        declared = len(id2label)
    if declared is not None and int(declared) != num_classes:
        raise UnsupportedModelError(
            f"the config declares {declared} labels but the checkpoint's classification head has {num_classes} outputs"
        )
    hf_names = declared is not None or num_classes == HF_DEFAULT_NUM_LABELS
    return tuple(id2label.get(i) or (f"LABEL_{i}" if hf_names else f"Class_{i}") for i in range(num_classes))


# sentence-transformers' CrossEncoder activations, by the class name config.json records.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def score_activation(cfg: dict[str, Any]) -> str:
    """sigmoid or identity: the CrossEncoder activation config.json names (in its
    `sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_function`),
    sigmoid when it names none (CrossEncoder's default for one label)."""
    st = cfg.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or cfg.get("sbert_ce_default_activation_function")
    if not name:
        return "sigmoid"
    short = str(name).rsplit(".", 1)[-1]
    if short not in _ACTIVATIONS:
        raise UnsupportedModelError(f"cross-encoder activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[short]


def token_head(cfg: dict[str, Any]) -> tuple[tuple[str, ...], bool] | None:
    """(tokens, difference) when config.json (usually through --hf-overrides) builds the head from
    LM-head rows (`classifier_from_token`, `is_original_qwen3_reranker`); None otherwise."""
    tokens = cfg.get("classifier_from_token")
    difference = bool(cfg.get("is_original_qwen3_reranker"))
    if tokens is None:
        if difference:
            raise UnsupportedModelError("is_original_qwen3_reranker needs classifier_from_token (e.g. [\"no\", \"yes\"])")
        return None
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) and t for t in tokens)):
        raise UnsupportedModelError(f"classifier_from_token must be a non-empty list of token strings, got {tokens!r}")
    if difference and len(tokens) != 2:
        raise UnsupportedModelError(f"is_original_qwen3_reranker scores with two tokens (no, yes), got {tokens}")
    arch = classifier_architecture(cfg)
    if arch not in DECODER_CLASSIFIERS or arch == "Qwen2ForRewardModel":
        raise UnsupportedModelError(f"classifier_from_token builds the head of a decoder *ForSequenceClassification "
                                    f"(set architectures to one, e.g. Qwen3ForSequenceClassification); got {arch}")
    return tuple(tokens), difference


def head_tensor(arch: str) -> str:
    """The checkpoint tensor whose first dimension is the number of classes."""
    if arch == "Qwen2ForRewardModel":
        return "score.2.weight"
    if arch in DECODER_CLASSIFIERS:
        return "score.weight"
    return "classifier.weight" if ENCODER_ARCHITECTURES[arch][2] == "pooler" else "classifier.out_proj.weight"


def classifier_config_from_hf(cfg: dict[str, Any], num_classes: int) -> ClassifierConfig:
    """Parse config.json of a classifier whose head has `num_classes` outputs."""
    arch = classifier_architecture(cfg)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {architectures(cfg) or '(none given)'} is not a supported classifier; supported: "
            + ", ".join(CLASSIFIER_ARCHITECTURES)
        )
    if num_classes < 1:
        raise UnsupportedModelError(f"the classification head has {num_classes} outputs")
    from_tokens = token_head(cfg)
    if from_tokens is not None:  # the labels are the tokens (the one label: the token it scores)
        labels = from_tokens[0][1:] if from_tokens[1] else from_tokens[0]
    else:
        labels = class_labels(cfg, num_classes)
    if arch in ENCODER_CLASSIFIERS:
        body: Union[DecoderConfig, EncoderConfig] = encoder_config_from_hf(cfg, num_classes)
    else:
        # The body is the causal LM's; tying keeps the Decoder from allocating an LM head the
        # classifier never uses (the checkpoint has none).
        lm = decoder_config_from_hf({**cfg, "architectures": [DECODER_CLASSIFIERS[arch]]})
        body = dataclasses.replace(lm, tie_word_embeddings=True)
        if arch == "Qwen2ForRewardModel" and num_classes != 1:
            raise UnsupportedModelError(f"Qwen2ForRewardModel scores with one output, the head has {num_classes}")
    pad = cfg.get("pad_token_id")
    return ClassifierConfig(
        architecture=arch, num_labels=num_classes, labels=labels, body=body,
        pad_token_id=None if pad is None else int(pad), reward_mlp=arch == "Qwen2ForRewardModel",
        score_activation=score_activation(cfg) if num_classes == 1 else "identity",
        from_tokens=from_tokens[0] if from_tokens else (), token_difference=bool(from_tokens and from_tokens[1]),
        problem_type=cfg.get("problem_type") or None,
    )


class DecoderClassifier(nnx.Module):
    """A causal LM body plus a score head, read at each sequence's last non-padding token."""

    def __init__(self, cfg: ClassifierConfig, dtype: Any = jnp.float32):
        if not isinstance(cfg.body, DecoderConfig):
            raise TypeError("DecoderClassifier needs a decoder body")
        self.cfg = cfg
        self.dtype = dtype
        self.model = Decoder(cfg.body, dtype)
        h = cfg.body.hidden_size
        if cfg.reward_mlp:
            self.score_hidden = Linear(h, h, True, dtype)
            self.score_out = Linear(h, 1, True, dtype)
        else:
            self.score = Linear(h, cfg.num_labels, False, dtype)

    def head(self, pooled: Array) -> Array:
        """[n, hidden] -> float32 logits [n, labels]."""
        if self.cfg.reward_mlp:
            return self.score_out(jax.nn.relu(self.score_hidden(pooled))).astype(jnp.float32)
        return self.score(pooled).astype(jnp.float32)

    def __call__(self, tokens: Array, positions: Array, segments: Array, pool_rows: Array, token_types: Array,
                 max_segment: int | None = None) -> Array:
        """One packed step: tokens, positions, segments [T]; pool_rows [S] (each sequence's pooled
        token) -> float32 logits [S, num_labels]. max_segment: the longest input (static).
        token_types: unused (decoders have no token types)."""
        return self.head(packed_decoder_hidden_states(self.model, tokens, positions, segments, max_segment)[pool_rows])


def packed_decoder_hidden_states(model: Decoder, tokens: Array, positions: Array, segments: Array,
                                 max_segment: int | None = None) -> Array:
    """One packed row through a causal decoder: tokens, positions, segments [T] -> final-normed
    hidden [T, hidden]."""
    body = model.cfg
    attend = PackedAttention(segments, positions, causal=True, scale=body.scale, softcap=body.attn_logit_softcap,
                             max_segment=max_segment)
    long_rope = None
    if body.rope.kind == "longrope":
        # As HF's forward over each input alone: long factors for an input longer than the switch.
        # (Segments number the inputs 0.. in a row of T tokens; -1 is padding.)
        t = tokens.shape[0]
        ids = jnp.where(segments < 0, t, segments)
        last = jax.ops.segment_max(positions, ids, num_segments=t + 1)
        long_rope = (last[ids] + 1 > body.rope.original_max_position)[None]
    hidden, _ = model.hidden_states(tokens[None], positions[None], attend, long_rope=long_rope)
    return hidden[0]


Classifier = Union[DecoderClassifier, Encoder]


def build_classifier(cfg: ClassifierConfig, dtype: Any = jnp.float32) -> Classifier:
    if isinstance(cfg.body, EncoderConfig):
        return Encoder(cfg.body, dtype)
    return DecoderClassifier(cfg, dtype)
