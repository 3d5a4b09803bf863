"""vLLM's offline LoRA API: `LLM(enable_lora=True, max_loras=1)` and `generate(...,
lora_request=LoRARequest(name, id, path))` decode as the `peft` library's model of that adapter;
one slot serves adapters in turn, the least recently used unloaded beyond max_cpu_loras, the base
model beside them; what cannot be held is refused."""

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
              enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(lora_request):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                              lora_request=lora_request)]

    base = run(None)
    assert base == [_greedy(hf, p) for p in PROMPTS]
    for name in ("sql", "poet", "sql"):  # one kept loaded (max_cpu_loras): each call unloads the other
        assert run(LoRARequest(name, 1, str(tmp_path / name))) == [_greedy(peft[name], p) for p in PROMPTS]
    assert llm.engine.lora.names == ("sql",)
    # Loaded: the path may be left out; per prompt, the base model beside it.
    assert run([None, LoRARequest("sql", 1)]) == [base[0], _greedy(peft["sql"], PROMPTS[1])]
    with pytest.raises(ValueError, match=r"2 LoRA adapters in one call, and this LLM keeps 1 loaded \(max_cpu_loras"):
        run([LoRARequest("sql", 1, str(tmp_path / "sql")), LoRARequest("poet", 2, str(tmp_path / "poet"))])
    with pytest.raises(ValueError, match="not loaded, and no lora_path"):
        run(LoRARequest("poet", 2))
    with pytest.raises(ValueError, match="which need enable_lora=True"):
        LLM(str(tmp_path / "m"), max_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras 1 is fewer than max_loras 2"):
        LLM(str(tmp_path / "m"), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_more_adapters_than_slots_in_one_call(tmp_path):
    """One slot and no max_cpu_loras: two adapters in one call take turns in the slot, each
    prompt decoding as its own PEFT model, the base model beside them."""
    hf = make_tiny_model("llama3", tmp_path / "m")
    peft = {name: make_adapter(hf, name, tmp_path / name, seed=50 + i) for i, name in enumerate(("sql", "poet"))}
    llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, dtype="float32", max_model_len=32, max_num_seqs=2,
              max_num_batched_tokens=16, decode_buckets=[2], prefill_buckets=[16], cache_dir=tmp_path / "cache",
              enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    requests = [LoRARequest("sql", 1, str(tmp_path / "sql")), LoRARequest("poet", 2, str(tmp_path / "poet")), None,
                LoRARequest("sql", 1, str(tmp_path / "sql"))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False, lora_request=requests)
    models = [peft["sql"], peft["poet"], hf, peft["sql"]]
    assert [o.outputs[0].token_ids for o in outs] == [_greedy(m, p) for m, p in zip(models, prompts)]
    assert llm.engine.lora.names == ("sql", "poet") and llm.engine.lora.num_slots == 1
