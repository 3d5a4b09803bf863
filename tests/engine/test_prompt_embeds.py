"""Embeddings as prompt input (input_embeds / prompt_embeds, and the path images take): the engine
splices them in place of token embeddings inside chunked prefill, under preemption, and keys the
prefix cache by their content, not by their placeholder ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import run_to_completion
from jaxserve.engine.embeds import EmbedSpan, embeds_key
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.models.reference import greedy_reference
from jaxserve.weights import load_model
from tiny_models import make_tiny_model

PROMPT = [1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46]
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),  # 13 usable pages: three long requests preempt
    # One decode bucket: which bucket pads a batch changes no token.
    scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_prefill_seqs=2, max_model_len=48,
                              decode_buckets=(3,)),
    enable_prompt_embeds=True,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3")
    make_tiny_model("llama3", directory)
    model = load_model(directory, "float32", use_cache=False).model
    return model, build_engine(model, None, CONFIG)


def _table(model) -> np.ndarray:
    return np.asarray(model.embed_tokens.get_value())


def _span(embeds: np.ndarray, offset: int = 0) -> EmbedSpan:
    return EmbedSpan(offset, embeds, embeds_key(embeds))


def _run(engine, requests: dict[str, tuple[list[int], tuple[EmbedSpan, ...]]]) -> dict[str, list[int]]:
    for rid, (prompt, spans) in requests.items():
        engine.add_request(rid, prompt, GREEDY, embeds=spans)
    results = run_to_completion(engine, list(requests))
    engine.check_idle_integrity()
    return {rid: results[rid].outputs[0].token_ids for rid in requests}


def test_token_embeddings_as_input_give_the_tokens_output(tiny):
    """A prompt sent as its own token embeddings (whole, or a span in the middle crossing chunk
    and page boundaries) decodes exactly as the token prompt; three at once preempt."""
    model, engine = tiny
    expected = greedy_reference(model, [PROMPT], 16)[0]
    table = _table(model)
    whole = _span(table[PROMPT])
    middle = _span(table[PROMPT[5:14]], offset=5)
    placeholders = PROMPT[:5] + [0] * 9 + PROMPT[14:]
    before = engine.num_preemptions
    out = _run(engine, {"whole": ([0] * len(PROMPT), (whole,)), "middle": (placeholders, (middle,)),
                        "tokens": (PROMPT, ())})
    assert out == {"whole": expected, "middle": expected, "tokens": expected}
    assert engine.num_preemptions > before


def test_prefix_cache_keys_embeddings_by_content(tiny):
    """Equal embeddings share cached pages; different embeddings behind the same placeholder ids
    never do (the second must not read the first's K/V)."""
    model, engine = tiny
    engine.scheduler.allocator.reset_prefix_cache()
    table = _table(model)
    first = table[PROMPT]
    other = table[[(t * 7 + 3) % 256 for t in PROMPT]]
    prompt = [0] * len(PROMPT)
    engine.add_request("a", prompt, GREEDY, embeds=(_span(first),))
    run_to_completion(engine, ["a"])
    engine.add_request("same", prompt, GREEDY, embeds=(_span(first.copy()),))
    same = run_to_completion(engine, ["same"])["same"]
    assert same.num_cached_tokens >= 16
    engine.add_request("other", prompt, GREEDY, embeds=(_span(other),))
    result = run_to_completion(engine, ["other"])["other"]
    assert result.num_cached_tokens == 0
    expected = greedy_reference(model, [[(t * 7 + 3) % 256 for t in PROMPT]], 16)[0]
    assert result.outputs[0].token_ids == expected
    engine.check_idle_integrity()


def test_bad_embeddings_are_refused(tiny):
    model, engine = tiny
    hidden = model.cfg.hidden_size
    with pytest.raises(InvalidRequestError, match=rf"\[tokens, {hidden}\]") as e:
        engine.add_request("wide", [0] * 4, GREEDY, embeds=(_span(np.zeros((4, hidden + 1), np.float32)),))
    assert e.value.param == "input_embeds"
    with pytest.raises(InvalidRequestError, match="outside the 4-token prompt"):
        engine.add_request("long", [0] * 4, GREEDY, embeds=(_span(np.zeros((5, hidden), np.float32)),))
    with pytest.raises(InvalidRequestError, match="takes no images"):
        engine.add_request("image", [0] * 4, GREEDY, images=[object()])
    assert not engine.has_unfinished()


def test_embeddings_need_the_flag(tiny):
    model, _ = tiny
    engine = build_engine(model, None, dataclasses.replace(CONFIG, enable_prompt_embeds=False), compile=False)
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds"):
        engine.add_request("x", [0] * 4, GREEDY, embeds=(_span(np.zeros((4, model.cfg.hidden_size), np.float32)),))
