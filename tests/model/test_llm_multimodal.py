"""`jaxserve.LLM` offline with vLLM's prompt dicts: {"prompt_token_ids", "multi_modal_data":
{"image": ...}} on a vision-language model (greedy tokens equal HF's generate), and
{"prompt_embeds": tensor} with enable_prompt_embeds (equal to the token prompt)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxserve
from jaxserve.engine.request import SamplingParams
from tiny_vlm import IMAGE_TOKEN, hf_greedy, make_tiny_llava, random_image

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    hf = make_tiny_llava(directory)
    llm = jaxserve.LLM(str(directory), dtype="float32", max_model_len=256, num_pages=64, page_size=16,
                       max_num_batched_tokens=64, cache_dir=tmp_path_factory.mktemp("cache"),
                       enable_prompt_embeds=True)
    return hf, llm


def test_images_offline_equal_hf(llava):
    hf, llm = llava
    image, others = random_image(48, 150, seed=1), [random_image(60, 60, seed=2), random_image(100, 40, seed=3)]
    prompts = [{"prompt_token_ids": [124, IMAGE_TOKEN, 5, 125], "multi_modal_data": {"image": image}},
               {"prompt": "user <image> w3 <image> w4 assistant", "multi_modal_data": {"image": others}}]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, images in zip(outputs, [[image], others]):
        assert out.outputs[0].token_ids == hf_greedy(hf, "llava", out.prompt_token_ids, images, 8)
    with pytest.raises(Exception, match="placeholder"):
        llm.generate({"prompt_token_ids": [124, 5], "multi_modal_data": {"image": image}}, GREEDY)


def test_prompt_embeds_offline(llava):
    _, llm = llava
    ids = [124, 5, 6, 7, 125]
    table = np.asarray(llm.engine.runner.params["embed_tokens"].get_value())
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": torch.from_numpy(table[ids])}],
                                     GREEDY, use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
