"""The multi-host control channel in one process: every command's payload survives packing into
its key's fixed-size int32 buffer bit for bit, and an engine whose commands all go through the
channel (broadcast to itself) generates exactly what it generates without one."""

from __future__ import annotations

import numpy as np

import jaxserve
from jaxserve.parallel.multihost import StepChannel, _Layout
from tiny_models import make_tiny_model, save_tiny_tokenizer

PROMPTS = [[5, 9, 13, 40, 77], [100, 3], [8, 8, 8, 21, 34, 55, 89, 144, 233, 17, 4, 6]]


def _llm(tmp_path) -> jaxserve.LLM:
    make_tiny_model("llama3", tmp_path)
    save_tiny_tokenizer(tmp_path)
    return jaxserve.LLM(str(tmp_path), dtype="float32", max_model_len=64, num_pages=32, max_num_seqs=4,
                        max_num_batched_tokens=32, max_prefill_seqs=2, cache_dir=tmp_path / "cache")


def test_layout_round_trips_every_array_exactly(tmp_path):
    llm = _llm(tmp_path)
    engine = llm.engine
    params = jaxserve.SamplingParams(temperature=0.7, top_p=0.9, seed=3, logit_bias={7: -2.5}, max_tokens=4,
                                     repetition_penalty=1.2)
    engine.add_request("r", [1, 2, 3], params)
    out = engine.scheduler.schedule()
    step = engine.builder.build(out, [None] * len(out.prefills))
    assert {c.key[0] for c in step.commands} == {"rows", "tokens", "prefill"}
    for command in step.commands:
        layout = _Layout(engine.builder.abstract(command.key))
        buf = layout.pack(command.payload)
        assert buf.dtype == np.int32 and buf.shape == (layout.words,)
        back = layout.unpack(buf)
        assert back.keys() == command.payload.keys()
        for name, a in command.payload.items():
            b = back[name]
            assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes(), (command.key, name)


def test_engine_through_the_channel_generates_the_same_tokens(tmp_path):
    llm = _llm(tmp_path)
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    engine = llm.engine
    engine.runner.channel = StepChannel(engine.builder.keys(), engine.builder.abstract)
    sent = []
    send = engine.runner.channel.send
    engine.runner.channel.send = lambda key, payload: (sent.append(key), send(key, payload))
    through = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert through == plain
    assert {k[0] for k in sent} >= {"rows", "prefill", "decode"}
