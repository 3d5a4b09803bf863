"""The multi-host control channel in one process: every step's inputs survive packing into the
bucket's fixed-size int32 buffer bit for bit, and an engine whose steps all go through the channel
(broadcast to itself) generates exactly what it generates without one."""

from __future__ import annotations

import jax
import numpy as np

import jaxserve
from jaxserve.engine.runner import Bucket, build_inputs
from jaxserve.parallel.multihost import StepChannel, _Layout
from tiny_models import make_tiny_model, save_tiny_tokenizer

PROMPTS = [[5, 9, 13, 40, 77], [100, 3], [8, 8, 8, 21, 34, 55, 89, 144, 233, 17, 4, 6]]


def _llm(tmp_path) -> jaxserve.LLM:
    make_tiny_model("llama3", tmp_path)
    save_tiny_tokenizer(tmp_path)
    return jaxserve.LLM(str(tmp_path), dtype="float32", max_model_len=64, num_pages=32, max_num_seqs=4,
                        max_num_batched_tokens=32, max_prefill_seqs=2, cache_dir=tmp_path / "cache")


def test_layout_round_trips_every_leaf_exactly(tmp_path):
    llm = _llm(tmp_path)
    engine = llm.engine
    bucket = Bucket("prefill", 16, 2)
    params = jaxserve.SamplingParams(temperature=0.7, top_p=0.9, seed=3, logit_bias={7: -2.5}, max_tokens=4)
    engine.add_request("r", [1, 2, 3], params)
    seq = engine.requests["r"].seqs[0]
    inputs = build_inputs(bucket, [([1, 2, 3], 0, seq.pages or [1])], engine.allocator.page_size,
                          engine.max_pages_per_seq, engine._sampling([seq], bucket.seqs))
    layout = _Layout(engine.runner.abstract_inputs(bucket, engine._sampling([], bucket.seqs)))
    buf = layout.pack(inputs)
    assert buf.dtype == np.int32 and buf.shape == (layout.words,)
    back = layout.unpack(buf)
    for a, b in zip(jax.tree_util.tree_leaves(inputs), jax.tree_util.tree_leaves(back)):
        a = np.asarray(a)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()


def test_engine_through_the_channel_generates_the_same_tokens(tmp_path):
    llm = _llm(tmp_path)
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    engine = llm.engine
    engine.runner.channel = StepChannel(engine.step_buckets(),
                                        lambda b: engine.runner.abstract_inputs(b, engine._sampling([], b.seqs)))
    sent = []
    send = engine.runner.channel.send
    engine.runner.channel.send = lambda bucket, inputs: (sent.append(bucket), send(bucket, inputs))
    through = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert through == plain
    assert {b.kind for b in sent} == {"prefill", "decode"}
