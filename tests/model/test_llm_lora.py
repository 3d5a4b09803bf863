"""vLLM's offline LoRA API: `LLM(enable_lora=True, max_loras=1)` and `generate(...,
lora_request=LoRARequest(name, id, path))` decode as the `peft` library's model of that adapter;
one slot serves adapters in turn (the least recently used unloaded), the base model beside them;
what cannot be held is refused."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import make_adapter
from tiny_models import make_tiny_model

from jaxserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250], [1, 9, 8, 7, 6, 5]]
MAX_TOKENS = 8


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_lora_requests_offline(tmp_path):
    hf = make_tiny_model("llama3", tmp_path / "m")
    peft = {name: make_adapter(hf, name, tmp_path / name, seed=40 + i) for i, name in enumerate(("sql", "poet"))}
    llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, dtype="float32", max_model_len=32, max_num_seqs=2,
              max_num_batched_tokens=16, decode_buckets=[2], prefill_buckets=[16], cache_dir=tmp_path / "cache",
              enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(lora_request):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                              lora_request=lora_request)]

    base = run(None)
    assert base == [_greedy(hf, p) for p in PROMPTS]
    for name in ("sql", "poet", "sql"):  # one slot: each call unloads the other adapter
        assert run(LoRARequest(name, 1, str(tmp_path / name))) == [_greedy(peft[name], p) for p in PROMPTS]
    assert llm.engine.lora.names == ("sql",)
    # Loaded: the path may be left out; per prompt, the base model beside it.
    assert run([None, LoRARequest("sql", 1)]) == [base[0], _greedy(peft["sql"], PROMPTS[1])]
    with pytest.raises(ValueError, match="2 LoRA adapters in one call, and this LLM holds 1"):
        run([LoRARequest("sql", 1, str(tmp_path / "sql")), LoRARequest("poet", 2, str(tmp_path / "poet"))])
    with pytest.raises(ValueError, match="not loaded, and no lora_path"):
        run(LoRARequest("poet", 2))
    with pytest.raises(ValueError, match="which need enable_lora=True"):
        LLM(str(tmp_path / "m"), max_loras=2)
