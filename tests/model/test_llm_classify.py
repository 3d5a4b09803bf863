"""LLM.classify (vLLM's): for a classification or reward checkpoint (task "auto" finds it), one
ClassificationRequestOutput per prompt, in prompt order, whose probs are HF transformers'
softmax(logits) within 1e-5 in float32 (a one-label head's sigmoid, as vLLM's); prompts are
text, token ids or vLLM's dicts; the other task's methods are refused naming the task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from jaxserve.llm import LLM, ClassificationOutput, ClassificationRequestOutput
from tiny_classifiers import hf_logits, make_tiny_classifier, save_word_tokenizer
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

# name -> (text prompts, the token ids the word tokenizer gives them); BERT's adds [CLS] .. [SEP].
# (No word starts with a special token's spelling, "w1" or "w3": a raw prompt parses those.)
TEXTS = {
    "llama-cls": (["w55", "w99 w9 w8 w7 w6"], [[55], [99, 9, 8, 7, 6]]),
    "llama-reward": (["w55", "w99 w9 w8 w7 w6"], [[55], [99, 9, 8, 7, 6]]),
    "bert-cls": (["w55", "w99 w9 w8 w7 w6"], [[101, 55, 102], [101, 99, 9, 8, 7, 6, 102]]),
}
IDS = [[101, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [101] + [(37 * i) % 250 + 2 for i in range(20)]]


def _llm(directory, cache_dir, **kwargs) -> LLM:
    # Two token buckets (16, 32) keep compiling short on the CPU.
    return LLM(str(directory), dtype="float32", max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32,
               cache_dir=cache_dir, **kwargs)


@pytest.fixture(scope="module", params=sorted(TEXTS))
def tiny(request, tmp_path_factory, cache_dir):
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    hf = make_tiny_classifier(name, directory)
    save_word_tokenizer(directory, bert=name == "bert-cls")
    return name, directory, hf, _llm(directory, cache_dir)


def test_probs_match_hf_in_prompt_order(tiny):
    name, directory, hf, llm = tiny
    texts, text_ids = TEXTS[name]
    assert llm.task == "classify"
    # Text is tokenized as HF tokenizes a raw prompt (and vLLM's LLM.classify does).
    assert [AutoTokenizer.from_pretrained(directory).encode(t) for t in texts] == text_ids
    outs = llm.classify([texts[0], IDS[0], {"prompt": texts[1]}, {"prompt_token_ids": IDS[1]}], use_tqdm=False)
    inputs = [text_ids[0], IDS[0], text_ids[1], IDS[1]]
    assert all(isinstance(o, ClassificationRequestOutput) and isinstance(o.outputs, ClassificationOutput)
               for o in outs)
    assert [o.prompt_token_ids for o in outs] == inputs
    assert [(o.finished, o.num_cached_tokens) for o in outs] == [(True, 0)] * 4
    assert len({o.request_id for o in outs}) == 4
    logits = hf_logits(hf, inputs, pad_id=0)
    num_labels = logits.shape[1]
    # vLLM's: a one-label head (llama-reward: LlamaForSequenceClassification, no problem_type) is
    # read through a sigmoid; a regression or Qwen2ForRewardModel head as it is (test_classify_server).
    expected = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, dim=-1)
    assert [o.outputs.num_classes for o in outs] == [num_labels] * 4
    assert all(type(p) is float for o in outs for p in o.outputs.probs)
    np.testing.assert_allclose(np.array([o.outputs.probs for o in outs]), expected.numpy(), atol=1e-5, rtol=0)
    # One prompt (text or ids) is one input; request ids never repeat across calls.
    again = llm.classify(IDS[1], use_tqdm=False)
    assert [o.prompt_token_ids for o in again] == [IDS[1]] and again[0].request_id not in {o.request_id for o in outs}
    np.testing.assert_allclose(again[0].outputs.probs, outs[3].outputs.probs, atol=1e-6, rtol=0)


def test_generation_methods_are_refused_naming_the_task(tiny):
    llm = tiny[3]
    why = "needs task 'generate', but this LLM was started for task 'classify': use LLM.classify"
    with pytest.raises(ValueError, match=f"^LLM.generate {why}"):
        llm.generate([[1, 2]], use_tqdm=False)
    with pytest.raises(ValueError, match=f"^LLM.chat {why}"):
        llm.chat([{"role": "user", "content": "w5"}], use_tqdm=False)
    with pytest.raises(ValueError, match=f"^LLM.structured {why}"):
        llm.structured(choice=["w5"])


def test_a_bad_input_is_refused_before_any_is_queued(tiny):
    llm = tiny[3]
    with pytest.raises(ValueError, match=r"^prompts\[1\]: the input has 33 tokens, more than the maximum context "
                                         r"length of 32 tokens"):
        llm.classify([[5, 6], [7] * 33], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: token id 256 is outside the vocabulary \[0, 256\)"):
        llm.classify([[256]], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert [o.prompt_token_ids for o in llm.classify([[5, 6]], use_tqdm=False)] == [[5, 6]]


def test_skip_tokenizer_init_classifies_token_ids(tmp_path, cache_dir):
    hf = make_tiny_classifier("llama-cls", tmp_path)  # saved with no tokenizer
    llm = _llm(tmp_path, cache_dir, skip_tokenizer_init=True, task="classify")
    assert llm.tokenizer is None
    outs = llm.classify(IDS, use_tqdm=False)
    expected = torch.softmax(hf_logits(hf, IDS, pad_id=0), dim=-1).numpy()
    np.testing.assert_allclose(np.array([o.outputs.probs for o in outs]), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer, and none was loaded because "
                                         "skip_tokenizer_init=True"):
        llm.classify(["w5"], use_tqdm=False)


def test_task_is_checked_before_loading(tmp_path, cache_dir):
    make_tiny_classifier("llama-cls", tmp_path / "cls")
    make_tiny_model("llama3", tmp_path / "lm")
    with pytest.raises(ValueError, match="^task must be one of auto, generate, classify, embed, got 'embedding'$"):
        LLM(str(tmp_path / "cls"), task="embedding", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="--task generate: LlamaForSequenceClassification is a classification model"):
        LLM(str(tmp_path / "cls"), task="generate", cache_dir=cache_dir)
    with pytest.raises(ValueError, match=r"--task classify: architecture \['LlamaForCausalLM'\] has no "
                                         "classification head"):
        LLM(str(tmp_path / "lm"), task="classify", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: classification and embedding models run on one device"):
        LLM(str(tmp_path / "cls"), tensor_parallel_size=2, cache_dir=cache_dir)
