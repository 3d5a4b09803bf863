"""Classification parity: for every supported classifier architecture, a tiny random-init HF model
saved as safetensors gives the same probabilities (within 1e-5, float32) as HF transformers
(PyTorch) for a batch of 4 inputs of different lengths, packed into one engine step; labels come
from id2label, else LABEL_i, else Class_i."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve.engine.classify import ClassifyConfig, ClassifyEngine
from jaxserve.engine.classify_batcher import probabilities
from jaxserve.models import packed_attention
from jaxserve.models.config import UnsupportedModelError
from jaxserve.weights.classifier_loader import load_classifier
from jaxserve.weights.safetensors_dir import WeightsError
from tiny_classifiers import ENCODERS, SENTIMENT, TINY_CLASSIFIERS, edit_config, hf_logits, make_tiny_classifier

# Four lengths (1, 5, 12 and 23 tokens), none holding a pad id (0 or 1), so HF's padded batch and
# our packed step see the same tokens. Gemma2's and Mistral's 5-token windows are crossed.
INPUTS = [[17], [101, 9, 8, 7, 6], [101, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18],
          [101] + [(37 * i) % 250 + 2 for i in range(22)]]


def _engine(loaded, max_len: int = 64, max_seqs: int = 4) -> ClassifyEngine:
    # One step shape keeps the test fast: compiling is most of its time on the CPU.
    config = ClassifyConfig(max_model_len=max_len, max_num_seqs=max_seqs, token_buckets=(max_len,))
    engine = ClassifyEngine(loaded.model, loaded.config, config)
    engine.compile()
    return engine


@pytest.fixture(scope="module", params=sorted(TINY_CLASSIFIERS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, make_tiny_classifier(request.param, directory)


def test_probs_match_hf_for_a_packed_batch_of_four(tiny):
    name, directory, hf = tiny
    loaded = load_classifier(directory, "float32", use_cache=False)
    engine = _engine(loaded)
    ours = np.stack([r.output for r in engine.classify(INPUTS)])
    assert engine.num_steps == 1  # all four inputs went through one packed step
    pad = 1 if "roberta" in name else 0
    if name == "phi3-cls":
        # LongRoPE: HF picks the factors by the longest sequence of its batch, which is no
        # property of an input; each input alone is the reference (the last is past the switch).
        ref = torch.cat([hf_logits(hf, [x], pad) for x in INPUTS])
    else:
        ref = hf_logits(hf, INPUTS, pad)
    num_labels = ref.shape[1]
    assert ours.shape == (4, num_labels) and loaded.config.num_labels == num_labels
    np.testing.assert_allclose(ours, ref.numpy(), atol=1e-5, rtol=0)
    # vLLM's reading of the logits: softmax over labels; one label through a sigmoid, unless the
    # head is a reward model's (Qwen2ForRewardModel) or config.json says regression.
    if num_labels > 1:
        ref_probs = torch.softmax(ref, dim=-1)
    elif name in ("qwen2-reward", "xlm-roberta-reward"):
        ref_probs = ref
    else:
        ref_probs = torch.sigmoid(ref)
    np.testing.assert_allclose(probabilities(ours, loaded.config.class_activation), ref_probs.numpy(), atol=1e-5,
                               rtol=0)


def test_labels_from_id2label(tiny):
    name, directory, hf = tiny
    cfg = load_classifier(directory, "float32", use_cache=False).config
    assert cfg.labels == tuple(hf.config.id2label[i] for i in range(cfg.num_labels))
    if name in ("llama-cls", "gemma2-cls", "bert-cls"):
        assert cfg.labels == tuple(SENTIMENT.values())


@pytest.mark.parametrize("name", ["qwen2-cls", "bert-cls"])
def test_label_fallbacks(tmp_path, name):
    make_tiny_classifier(name, tmp_path)
    n = 2 if name == "qwen2-cls" else 3
    labels = lambda: load_classifier(tmp_path, "float32", use_cache=False).config.labels  # noqa: E731
    edit_config(tmp_path, id2label=None, label2id=None, num_labels=n)
    assert labels() == tuple(f"LABEL_{i}" for i in range(n))
    edit_config(tmp_path, id2label={"0": "zero"})  # a partial map: LABEL_i for the rest
    assert labels() == ("zero",) + tuple(f"LABEL_{i}" for i in range(1, n))
    # Nothing declared: HF assumes 2 labels named LABEL_i (transformers does not even write that
    # default); a head of another size gets the last resort, Class_i.
    edit_config(tmp_path, id2label=None, num_labels=None)
    assert labels() == (("LABEL_0", "LABEL_1") if n == 2 else tuple(f"Class_{i}" for i in range(n)))
    edit_config(tmp_path, num_labels=n + 2)
    with pytest.raises(UnsupportedModelError, match=f"declares {n + 2} labels .* has {n} outputs"):
        labels()


@pytest.mark.parametrize("name", ["gemma2-cls", "bert-cls"])
def test_long_steps_attend_in_query_blocks(tmp_path, monkeypatch, name):
    """Past QUERY_BLOCK tokens a step attends block by block, each block reading only the keys its
    inputs can reach (inputs are at most max_model_len long); the result must not change."""
    hf = make_tiny_classifier(name, tmp_path)
    monkeypatch.setattr(packed_attention, "QUERY_BLOCK", 16)
    loaded = load_classifier(tmp_path, "float32", use_cache=False)
    inputs = [[(11 * i + j) % 250 + 2 for j in range(n)] for i, n in enumerate((20, 3, 17, 20))]
    config = ClassifyConfig(max_model_len=20, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,))
    engine = ClassifyEngine(loaded.model, loaded.config, config)
    engine.compile()
    ours = np.stack([r.output for r in engine.classify(inputs)])
    assert engine.num_steps == 1
    np.testing.assert_allclose(ours, hf_logits(hf, inputs, 0).numpy(), atol=1e-5, rtol=0)


def test_decoder_pools_the_last_token_that_is_not_padding(tmp_path):
    """HF's decoder classifiers read the rightmost non-pad token, even inside one unpadded input."""
    hf = make_tiny_classifier("llama-cls", tmp_path)
    engine = _engine(load_classifier(tmp_path, "float32", use_cache=False))
    (ours,) = engine.classify([[5, 6, 7, 0, 0]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([[5, 6, 7, 0, 0]])).logits[0]
    np.testing.assert_allclose(ours.output, ref.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours.output, engine.classify([[5, 6, 7]])[0].output, atol=1e-6)


def test_bfloat16_close_to_float32(tmp_path):
    hf = make_tiny_classifier("qwen3-cls", tmp_path)
    loaded = load_classifier(tmp_path, "bfloat16", use_cache=False)
    ours = np.stack([r.output for r in _engine(loaded).classify(INPUTS)])
    ref = hf_logits(hf, INPUTS, 0).numpy()
    assert ours.dtype == np.float32
    # bfloat16 keeps 8 mantissa bits; the head's logits here are O(1).
    np.testing.assert_allclose(ours, ref, atol=0.1, rtol=0)


def test_weight_cache_round_trip(tmp_path):
    make_tiny_classifier("bert-cls", tmp_path / "m")
    first = load_classifier(tmp_path / "m", "float32", cache_dir=tmp_path / "cache")
    second = load_classifier(tmp_path / "m", "float32", cache_dir=tmp_path / "cache")
    assert not first.from_cache and second.from_cache
    a = _engine(first).classify(INPUTS)
    b = _engine(second).classify(INPUTS)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.output, y.output)


def test_checkpoint_errors_name_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_tiny_classifier("llama-cls", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="model.norm.weight is missing"):
        load_classifier(tmp_path, "float32", use_cache=False)
    save_file({**tensors, "score.weight": tensors["score.weight"][:, :-1]}, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"score.weight has shape \(3, 63\), the config implies \(3, 64\)"):
        load_classifier(tmp_path, "float32", use_cache=False)
    save_file({**tensors, "lm_head.weight": tensors["score.weight"]}, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="tensors the model does not use: \\['lm_head.weight'\\]"):
        load_classifier(tmp_path, "float32", use_cache=False)


def test_encoders_listed():
    assert ENCODERS <= set(TINY_CLASSIFIERS)


@pytest.mark.parametrize("arch, labels, problem_type, activation", [
    ("LlamaForSequenceClassification", 3, None, "softmax"),
    ("LlamaForSequenceClassification", 3, "single_label_classification", "softmax"),
    ("LlamaForSequenceClassification", 3, "multi_label_classification", "sigmoid"),
    ("LlamaForSequenceClassification", 1, None, "sigmoid"),
    ("LlamaForSequenceClassification", 1, "regression", "identity"),
    ("Qwen2ForRewardModel", 1, None, "identity"),
])
def test_the_class_activation_is_vllms(arch, labels, problem_type, activation):
    """vLLM's classify activation, after HF's loss for the config's problem_type; a one-label head
    reads as a sigmoid unless it is a regression or a reward model's."""
    from jaxserve.models.classifier import classifier_config_from_hf

    cfg = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
               num_labels=labels, **({"problem_type": problem_type} if problem_type else {}))
    assert classifier_config_from_hf(cfg, labels).class_activation == activation
