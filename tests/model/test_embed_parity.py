"""Embedding and cross-encoder parity. Tiny random-init HF models saved as sentence-transformers
directories give sentence-transformers' embeddings (pooling by the attention mask, then
F.normalize) within 1e-5 in float32, for a batch of inputs of different lengths packed into one
engine step: a BertModel (mean, normalised), an XLM-RoBERTa body (CLS, not normalised), a bare
Qwen3 body as Qwen3-Embedding ships it (last token, normalised) and a Qwen3ForCausalLM served with
--task embed. A one-label BERT cross-encoder scores text pairs (token types 0 and 1) as HF does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_classifiers import make_tiny_classifier
from tiny_embedders import make_tiny_embedder, reference_embeddings

from jaxserve.engine.classify import ClassifyConfig, ClassifyEngine
from jaxserve.engine.classify_batcher import cosine, finish_embedding
from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.embedder import EmbedderConfig
from jaxserve.models.tasks import resolve_task
from jaxserve.weights.classifier_loader import load_classifier

# Lengths 1, 5, 12 and 23; no pad ids (0 or 1) inside, so HF's padded batch sees the same tokens.
INPUTS = [[17], [101, 9, 8, 7, 6], [101, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18],
          [101] + [(37 * i) % 250 + 2 for i in range(22)]]
# name, pooling (None: no sentence-transformers files), normalised
CASES = [("bert", "mean", True), ("xlm-roberta", "cls", False), ("qwen3", "last", True), ("qwen3-causal", None, True),
         ("bert", None, True)]


def _engine(loaded, max_len: int = 64) -> ClassifyEngine:
    engine = ClassifyEngine(loaded.model, loaded.config, ClassifyConfig(max_model_len=max_len, max_num_seqs=4,
                                                                        token_buckets=(max_len,)))
    engine.compile()
    return engine


@pytest.mark.parametrize("name,pooling,normalize", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_embeddings_match_sentence_transformers(name, pooling, normalize, tmp_path):
    hf = make_tiny_embedder(name, tmp_path, pooling, normalize)
    assert resolve_task("auto", json.loads((tmp_path / "config.json").read_text()), tmp_path) == (
        "generate" if name == "qwen3-causal" else "embed")
    loaded = load_classifier(tmp_path, "float32", use_cache=False, task="embed")
    cfg = loaded.config
    assert isinstance(cfg, EmbedderConfig)
    # Without sentence-transformers files: [CLS] for encoders, the last token for decoders, normalised.
    want_pooling = pooling or ("cls" if name == "bert" else "last")
    assert (cfg.pooling, cfg.normalize) == (want_pooling, normalize)
    engine = _engine(loaded)
    results = engine.classify(INPUTS)
    assert engine.num_steps == 1
    ours = np.stack([finish_embedding(r.output, cfg.normalize) for r in results])
    pad = 1 if name == "xlm-roberta" else 0
    ref = reference_embeddings(hf, INPUTS, want_pooling, normalize, pad).numpy()
    assert ours.shape == ref.shape == (4, cfg.dimensions)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_matryoshka_cut_then_renormalised(tmp_path):
    hf = make_tiny_embedder("bert", tmp_path, "mean", True, matryoshka_dimensions=[16, 32])
    cfg = load_classifier(tmp_path, "float32", use_cache=False, task="embed").config
    assert cfg.matryoshka_dimensions == (16, 32) and cfg.is_matryoshka
    pooled = reference_embeddings(hf, INPUTS[1:2], "mean", False)[0].numpy()
    cut = finish_embedding(pooled, True, 16)
    np.testing.assert_allclose(cut, pooled[:16] / np.linalg.norm(pooled[:16]), atol=1e-6)
    assert cosine(cut, cut) == pytest.approx(1.0)


def test_max_seq_length_and_unsupported_modules(tmp_path):
    make_tiny_embedder("bert", tmp_path, "mean", True, max_seq_length=48)
    assert load_classifier(tmp_path, "float32", use_cache=False, task="embed").config.max_seq_length == 48
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="sentence_transformers.models.Dense.*not supported"):
        load_classifier(tmp_path, "float32", use_cache=False, task="embed")
    pooling = tmp_path / "1_Pooling" / "config.json"
    (tmp_path / "modules.json").write_text(json.dumps(modules[:3]))
    pooling.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedModelError, match=r"pooling \['max'\] is not supported"):
        load_classifier(tmp_path, "float32", use_cache=False, task="embed")


def test_tasks_refused_with_the_reason(tmp_path):
    make_tiny_classifier("bert-cls", tmp_path / "cls")
    cfg = json.loads((tmp_path / "cls" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="--task embed: BertForSequenceClassification is a classif"):
        resolve_task("embed", cfg, tmp_path / "cls")
    make_tiny_embedder("bert", tmp_path / "emb", "mean")
    cfg = json.loads((tmp_path / "emb" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="--task generate: .*embedding model"):
        resolve_task("generate", cfg, tmp_path / "emb")
    with pytest.raises(UnsupportedModelError, match="--task classify: .*no classification head"):
        resolve_task("classify", cfg, tmp_path / "emb")


def test_cross_encoder_scores_pairs_with_token_types(tmp_path):
    from tiny_classifiers import save_word_tokenizer

    from jaxserve.tokenizer import load_tokenizer

    hf = make_tiny_classifier("bert-cross-encoder", tmp_path)
    save_word_tokenizer(tmp_path, bert=True)
    tok = load_tokenizer(tmp_path)
    pairs = [("w5 w6", "w7 w8 w9"), ("w5 w6", "w40"), ("w9 w10 w11 w12", "w13 w14")]
    encoded = [tok.encode_pair(a, b) for a, b in pairs]
    ids, types = [e[0] for e in encoded], [e[1] for e in encoded]
    assert ids[0] == [101, 5, 6, 102, 7, 8, 9, 102] and types[0] == [0, 0, 0, 0, 1, 1, 1, 1]
    loaded = load_classifier(tmp_path, "float32", use_cache=False)
    assert loaded.config.score_activation == "sigmoid"
    engine = _engine(loaded)
    ours = np.array([r.output[0] for r in engine.classify(ids, token_types=types)])
    with torch.no_grad():
        ref = np.array([hf(input_ids=torch.tensor([i]), token_type_ids=torch.tensor([t])).logits[0, 0].item()
                        for i, t in zip(ids, types)])
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    # Token types matter: the same ids read as one text score differently.
    single = engine.classify(ids[:1])[0].output[0]
    assert abs(single - ours[0]) > 1e-3



def test_llm_embed_offline(tmp_path):
    from tiny_classifiers import save_word_tokenizer

    from jaxserve.llm import LLM

    hf = make_tiny_embedder("bert", tmp_path / "m", "mean", True, matryoshka_dimensions=[16])
    save_word_tokenizer(tmp_path / "m", bert=True)
    llm = LLM(str(tmp_path / "m"), dtype="float32", max_model_len=32, cache_dir=tmp_path / "cache")
    assert llm.task == "embed"
    out = llm.embed(["w5 w6", {"prompt_token_ids": [101, 7, 8, 9, 102]}], use_tqdm=False)
    ref = reference_embeddings(hf, [[101, 5, 6, 102], [101, 7, 8, 9, 102]], "mean", True).numpy()
    np.testing.assert_allclose([o.outputs.embedding for o in out], ref, atol=1e-5, rtol=0)
    assert out[0].prompt_token_ids == [101, 5, 6, 102] and out[0].outputs.hidden_size == 64
    cut = llm.embed("w5 w6", use_tqdm=False, dimensions=16)[0].outputs.embedding
    assert len(cut) == 16 and np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"dimensions: must be one of \[16\]"):
        llm.embed("w5", use_tqdm=False, dimensions=8)
    with pytest.raises(ValueError, match="LLM.generate needs task 'generate'.*use LLM.embed"):
        llm.generate("w5")


RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w7", "w9"],
            "is_original_qwen3_reranker": True}


def test_qwen3_reranker_from_lm_head_tokens(tmp_path):
    """A causal LM served as Qwen3-Reranker's model card scores: P(second token) against the
    first at the last position, i.e. sigmoid(logit[w9] - logit[w7]); built from the LM head."""
    from tiny_models import make_tiny_model, save_tiny_tokenizer

    hf = make_tiny_model("qwen3", tmp_path)
    save_tiny_tokenizer(tmp_path)
    loaded = load_classifier(tmp_path, "float32", use_cache=False, hf_overrides=RERANKER)
    cfg = loaded.config
    assert (cfg.num_labels, cfg.labels, cfg.score_activation) == (1, ("w9",), "sigmoid")
    inputs = INPUTS[1:]
    ours = np.array([r.output[0] for r in _engine(loaded).classify(inputs)])
    with torch.no_grad():
        logits = [hf(input_ids=torch.tensor([x])).logits[0, -1] for x in inputs]
    np.testing.assert_allclose(ours, [float(lg[9] - lg[7]) for lg in logits], atol=1e-5, rtol=0)
    probs = [float(torch.softmax(lg[[7, 9]], -1)[1]) for lg in logits]
    np.testing.assert_allclose(1 / (1 + np.exp(-ours)), probs, atol=1e-6)
    # Several tokens without the difference: one label per token, the LM head's logits.
    plain = load_classifier(tmp_path, "float32", use_cache=False,
                            hf_overrides={**RERANKER, "is_original_qwen3_reranker": False})
    both = np.stack([r.output for r in _engine(plain).classify(inputs)])
    np.testing.assert_allclose(both, [[float(lg[7]), float(lg[9])] for lg in logits], atol=1e-5, rtol=0)
    with pytest.raises(UnsupportedModelError, match="'nope' is not a token of the vocabulary"):
        load_classifier(tmp_path, "float32", use_cache=False, hf_overrides={**RERANKER, "classifier_from_token": ["w7", "nope"]})
    with pytest.raises(UnsupportedModelError, match="scores with two tokens"):
        load_classifier(tmp_path, "float32", use_cache=False, hf_overrides={**RERANKER, "classifier_from_token": ["w7"]})
