"""The offline API: LLM(model=...).generate(prompts, SamplingParams) in prompt order, vLLM's
prompt dicts, and LLM.chat."""

from __future__ import annotations

import pytest

from jaxserve.engine.request import SamplingParams
from jaxserve.llm import LLM
from jaxserve.models.reference import greedy_reference
from tiny_models import make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow


def test_generate_returns_outputs_in_prompt_order(tmp_path):
    make_tiny_model("llama3", tmp_path / "m")
    save_tiny_tokenizer(tmp_path / "m")
    # The model creator's sampling (vLLM's --generation-config auto): what generate uses without params.
    (tmp_path / "m" / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 5}')
    llm = LLM(str(tmp_path / "m"), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_pages=32,
              page_size=4, cache_dir=tmp_path / "cache", decode_buckets=[2], prefill_buckets=(16,))
    assert {key[:2] for key in llm.engine.runner.compiled_steps} == {("prefill", 16), ("decode", 2)}
    prompts = [[1, 5, 9, 13, 17], [1, 2], [1, 100, 101, 102]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    expected = greedy_reference(llm.model, prompts, 6)
    assert [o.outputs[0].token_ids for o in outs] == expected
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.default_max_tokens) == (0.0, None, 5)
    plain = llm.generate(prompts[:1], use_tqdm=False)[0].outputs[0]  # greedy, at most 5 tokens
    assert plain.token_ids == expected[0][: len(plain.token_ids)] and 1 <= len(plain.token_ids) <= 5
    assert [o.prompt_token_ids for o in outs] == prompts and all(o.prompt is None for o in outs)
    text = llm.generate("w5 w9", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(text) == 1 and len(text[0].outputs[0].token_ids) == 3 and text[0].outputs[0].finish_reason == "length"
    assert text[0].prompt == "w5 w9"  # vLLM's quickstart prints output.prompt
    # Structured output offline: a compiled constraint rides on SamplingParams.
    grammar = llm.structured(choice=["w7", "w9"])
    out = llm.generate([[1, 5]], SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=4, grammar=grammar),
                       use_tqdm=False)[0]
    # (The word-level test tokenizer decodes with a space between words, prompt included.)
    assert [o.text.strip() in ("w7", "w9") and o.finish_reason == "stop" for o in out.outputs] == [True] * 4
    with pytest.raises(ValueError, match="one kind of structured output"):
        llm.structured(regex="w1", choice=["w2"])
    # vLLM's prompt dicts, and chat: the same tokens as the equivalent plain prompts.
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    by_dict = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt": "w5 w9"}], greedy, use_tqdm=False)
    assert by_dict[0].outputs[0].token_ids == expected[1][:3]
    assert by_dict[1].outputs[0].token_ids == text[0].outputs[0].token_ids
    assert (by_dict[0].prompt, by_dict[1].prompt) == (None, "w5 w9")
    with pytest.raises(ValueError, match="one of 'prompt' and 'prompt_token_ids'"):
        llm.generate({"prompt": "w5", "prompt_token_ids": [1]}, greedy, use_tqdm=False)
    template = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w7{% endif %}"
    conversation = [{"role": "user", "content": "w5"}, {"role": "user", "content": "w9"}]
    chats = llm.chat([conversation, conversation[:1]], greedy, use_tqdm=False, chat_template=template)
    rendered = [llm.tokenizer.encode_chat(c, chat_template=template) for c in (conversation, conversation[:1])]
    assert [c.prompt_token_ids for c in chats] == rendered
    assert [c.outputs[0].token_ids for c in chats] == greedy_reference(llm.model, rendered, 3)
    assert llm.chat(conversation, greedy, use_tqdm=False, chat_template=template)[0].outputs[0].token_ids == \
        chats[0].outputs[0].token_ids  # one conversation, not a list of them
    # vLLM's `stop` may be one string: that string, not each of its characters.
    whole = text[0].outputs[0].text
    word = whole.split()[1]
    cut = llm.generate("w5 w9", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop=word),
                       use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.stop_reason) == (whole[: whole.index(word)], word)
    # A refused prompt refuses the whole call and leaves nothing of the batch queued.
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2], [1, 99999]], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.close()
