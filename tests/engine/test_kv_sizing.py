"""KV-cache sizing: the steps' scratch memory is measured and set aside first, kv-head sharding
multiplies the pages that fit, and prompt logprobs never need a whole [tokens x vocab] scratch."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, step_scratch_bytes
from jaxserve.engine.kv_cache import bytes_per_page, num_pages_for
from jaxserve.models.config import decoder_config_from_hf
from jaxserve.weights import load_model
from tiny_models import make_tiny_model, save_tiny_tokenizer


@dataclasses.dataclass
class _Accelerator:
    """The two things num_pages_for reads from a jax.Device, as an 80 GB GPU would report them."""

    platform: str = "gpu"

    def memory_stats(self) -> dict:
        return {"bytes_limit": 80 * 2**30, "bytes_in_use": 16 * 2**30}


def _llama8b():
    return decoder_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0))  # fmt: skip


def test_pages_come_from_what_is_left_after_weights_and_scratch():
    cfg = _llama8b()
    per_page = bytes_per_page(cfg, 16, jnp.bfloat16)
    assert per_page == 16 * 128 * 1024  # 128 KiB of K and V per token
    cache = CacheConfig(page_size=16, kv_cache_memory_fraction=0.9)
    plain = num_pages_for(cache, cfg, jnp.bfloat16, _Accelerator())
    assert plain == int(64 * 2**30 * 0.9) // per_page
    reserved = num_pages_for(cache, cfg, jnp.bfloat16, _Accelerator(), reserve_bytes=8 * 2**30)
    assert reserved == int(56 * 2**30 * 0.9) // per_page
    # Split over 4 devices by kv head, each device holds a quarter of every page.
    assert num_pages_for(cache, cfg, jnp.bfloat16, _Accelerator(), kv_shards=4) == int(64 * 2**30 * 0.9) // (per_page // 4)
    assert num_pages_for(dataclasses.replace(cache, num_pages=7), cfg, jnp.bfloat16, _Accelerator()) == 7


def test_step_scratch_is_measured_and_prompt_logprobs_are_chunked(tmp_path):
    make_tiny_model("llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    vocab = 8192  # big enough that a whole [tokens x vocab] float32 matrix dominates the scratch
    config["vocab_size"] = vocab
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_tiny_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32", use_cache=False, load_format="dummy").model
    tokens = 512
    scratch = step_scratch_bytes(model, EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=tokens, max_prefill_seqs=2,
                                  max_model_len=256, prefill_buckets=(tokens,), decode_buckets=(4,))))  # fmt: skip
    assert scratch > 256 * 2**20  # the measured scratch plus the fixed headroom
    # Computed in one piece, the prompt logprobs alone would need tokens x vocab float32 logits.
    assert scratch - 256 * 2**20 < tokens * vocab * 4
