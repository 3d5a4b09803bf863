"""The engine end to end on the real SmolLM2 model (float32, CPU): paged, batched, chunked,
prefix-cached and preempted greedy decoding equals the no-cache reference token for token; stop
conditions, seeds, n/best_of, logprobs, abort, refusal, and no compilation after warm-up; the
overlapped engine and the device decode loop (several decode iterations per device step) give
exactly the outputs of one step at a time."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import Engine, run_to_completion
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import RequestTooLongError
from jaxserve.models.reference import greedy_choices

pytestmark = pytest.mark.slow

LONG = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The story should "
    "mention the sea, the weather, a seagull called Pip, and end with a surprising twist about the sender "
    "of the message, who turns out to be"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", LONG, "1, 2, 3, 4,"]
# 11 usable pages of 16 tokens (176 tokens): four concurrent 46-85-token sequences cannot all fit.
# Two decode buckets and one prefill bucket, not every power of two: each is a compile of the
# 30-layer model (5-7 s on two cores), and which bucket pads a batch changes no token.
# test_speculative.py builds the same steps (read back from the compilation cache).
SMALL = EngineConfig(
    cache=CacheConfig(page_size=16, num_pages=12),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=240,
                              decode_buckets=(2, 4), prefill_buckets=(32,)),
)


@pytest.fixture(scope="module")
def engine(model, smollm2_tokenizer):
    return build_engine(model, smollm2_tokenizer, SMALL)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, prefix: str) -> list:
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    results = run_to_completion(engine, ids)
    engine.check_idle_integrity()
    return [results[r] for r in ids]


def test_greedy_equals_reference_with_chunking_preemption_and_prefix_hits(engine, model, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > SMALL.scheduler.max_num_batched_tokens  # chunked prefill
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = engine.num_preemptions
    first = _run(engine, prompts, params, "greedy")
    expected = [r.outputs[0].token_ids for r in first]
    assert all(len(e) == 40 for e in expected)
    assert expected == greedy_choices(model, prompts, expected)  # each token the reference's argmax
    assert engine.num_preemptions > before  # the small page budget forced recompute
    second = _run(engine, prompts, params, "again")  # full prompt pages now come from the cache
    assert [r.outputs[0].token_ids for r in second] == expected
    assert any(r.num_cached_tokens >= 16 for r in second)
    assert all(r.outputs[0].text == smollm2_tokenizer.decode(e) for r, e in zip(second, expected))


def test_stop_string_across_tokens(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("The capital of France is")
    base = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), "base")[0]
    assert base.outputs[0].text.startswith(" Paris.\n\nThe answer is")
    cut = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=["answer is"]), "stop")[0]
    out = cut.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" Paris.\n\nThe ", "stop", "answer is")
    keep = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=["answer is"],
                                                 include_stop_str_in_output=True), "keep")[0]
    assert keep.outputs[0].text == " Paris.\n\nThe answer is"


def test_stop_token_ids_eos_min_tokens_and_length(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    natural = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=60), "eos")[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None  # EOS
    assert natural.token_ids[-1] == smollm2_tokenizer.eos_token_id
    assert natural.text == "The answer to this classic math problem is 4."
    n = len(natural.token_ids)
    forced = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=60, min_tokens=n + 3), "min")[0]
    assert len(forced.outputs[0].token_ids) >= n + 3
    assert smollm2_tokenizer.eos_token_id not in forced.outputs[0].token_ids[: n + 2]
    dot = natural.token_ids[-2]  # the "." before EOS
    by_id = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[dot]), "id")[0]
    assert by_id.outputs[0].token_ids == natural.token_ids[:-1]
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", dot)
    assert by_id.outputs[0].text == "The answer to this classic math problem is 4"  # the stop token's text cut
    # include_stop_str_in_output (SGLang's no_stop_trim) keeps a stop token's text, as vLLM's and
    # SGLang's do; EOS stays unseen (a special token, skipped).
    kept = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[dot],
                                                 include_stop_str_in_output=True), "id-kept")[0].outputs[0]
    assert (kept.text, kept.token_ids) == (natural.text, natural.token_ids[:-1])
    eos = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=60, include_stop_str_in_output=True),
               "eos-kept")[0].outputs[0]
    assert eos.text == natural.text
    short = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=3), "len")[0].outputs[0]
    assert (len(short.token_ids), short.finish_reason) == (3, "length")


def test_seeds_are_reproducible_whatever_the_batch(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("Once upon a time")
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _run(engine, [prompt], seeded, "s1")[0].outputs[0].token_ids
    others = [smollm2_tokenizer.encode(p) for p in PROMPTS[:2]]
    crowd = _run(engine, [prompt] + others, seeded, "s2")[0].outputs[0].token_ids
    assert alone == crowd
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
    assert _run(engine, [prompt], other_seed, "s3")[0].outputs[0].token_ids != alone


def test_n_best_of_and_logprobs(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("My favourite fruit is")
    res = _run(engine, [prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, logprobs=2,
                                                ignore_eos=True), "n")[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1
    for o in res.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 8
        for tid, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == tid and lp.logprob <= 0 and len(lp.top) == 2
            assert lp.top[0][1] >= lp.top[1][1] and lp.logprob <= lp.top[0][1] + 1e-6
        np.testing.assert_allclose(o.cumulative_logprob, sum(lp.logprob for lp in o.logprobs), rtol=1e-5)
    best = _run(engine, [prompt], SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=8, seed=7,
                                                 ignore_eos=True), "best")[0]
    assert len(best.outputs) == 1 and len(best.outputs[0].token_ids) == 8
    # Same seeds as the n=3 run for samples 0-2, so the best of 4 is at least as good as those.
    assert best.outputs[0].cumulative_logprob >= max(o.cumulative_logprob for o in res.outputs) - 1e-4


def test_each_sample_reports_its_finish_once(engine, smollm2_tokenizer):
    """n samples that end at different steps: a finished sample's finish goes out in one delta and
    the sample says nothing more while the others run (streamed choices end once, as OpenAI's do)."""
    prompt = smollm2_tokenizer.encode("The list:")
    engine.add_request("once", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, stop=["e"]))
    deltas, step = [], 0  # (engine step, output)
    while engine.has_unfinished():
        step += 1
        deltas += [(step, o) for r in engine.step() if r.request_id == "once" for o in r.outputs]
    engine.check_idle_integrity()
    ends = {}
    for index in range(3):
        outs = [(s, o) for s, o in deltas if o.index == index]
        finishes = [s for s, o in outs if o.finish_reason is not None]
        assert len(finishes) == 1 and outs[-1][1].finish_reason is not None, (index, [o.finish_reason for _, o in outs])
        ends[index] = finishes[0]
    assert len(set(ends.values())) > 1  # the premise: the samples ended in different steps


def test_abort_frees_everything(engine, smollm2_tokenizer):
    engine.add_request("abort-me", smollm2_tokenizer.encode(LONG), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    final = engine.abort("abort-me")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    engine.check_idle_integrity()


def test_aborting_one_sample_leaves_the_others_as_they_were(engine, smollm2_tokenizer):
    """SGLang aborts a sample of n by its own rid: that one ends with "abort" and frees its
    pages; the others run to the same tokens as without the abort (each sample's seed is its own)."""
    prompt = smollm2_tokenizer.encode(LONG)
    params = SamplingParams(n=3, max_tokens=12, ignore_eos=True, temperature=1.0, seed=7)

    def run(abort_after: int | None) -> tuple[dict[int, list[int]], dict[int, str]]:
        engine.add_request("n3", prompt, params)
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        reasons: dict[int, str] = {}
        steps, finished = 0, False
        while not finished:
            outs = engine.step()
            steps += 1
            if abort_after is not None and steps == abort_after:
                out = engine.abort_sample("n3", 1)
                assert out is not None and not out.finished and [o.index for o in out.outputs] in ([1], [])
                outs = [*outs, out]
                assert engine.abort_sample("n3", 1) is None  # already ended
            for out in outs:
                for o in out.outputs:
                    tokens[o.index] += o.token_ids
                    if o.finish_reason is not None:
                        reasons[o.index] = o.finish_reason
                finished = finished or out.finished
        return tokens, reasons

    whole, _ = run(None)
    cut, reasons = run(3)
    assert reasons == {0: "length", 1: "abort", 2: "length"}
    assert cut[0] == whole[0] and cut[2] == whole[2] and len(cut[1]) < 12 and cut[1] == whole[1][:len(cut[1])]
    assert engine.abort_sample("n3", 0) is None  # the request is gone
    engine.check_idle_integrity()
    # Aborting the last running sample ends the request.
    engine.add_request("n2", prompt, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort_sample("n2", 5) is None
    assert not engine.abort_sample("n2", 0).finished
    last = engine.abort_sample("n2", 1)
    assert last.finished and last.outputs[0].finish_reason == "abort" and not engine.has_unfinished()
    engine.check_idle_integrity()
    # best_of > n: which samples are returned is known only at the end; none is aborted alone.
    engine.add_request("best", prompt, SamplingParams(n=1, best_of=2, max_tokens=4, ignore_eos=True))
    assert engine.abort_sample("best", 1) is None
    engine.abort("best")
    engine.check_idle_integrity()


def test_requests_that_can_never_fit_are_refused(engine, smollm2_tokenizer):
    with pytest.raises(RequestTooLongError, match=r"5 tokens.*300.*240"):
        engine.add_request("too-long", smollm2_tokenizer.encode("The capital of France is"),
                           SamplingParams(max_tokens=300))
    assert not engine.has_unfinished()


def test_no_compilation_after_warm_up(engine, smollm2_tokenizer):
    import jax

    compiles: list[str] = []

    def listener(event: str, *args, **kwargs) -> None:
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
        _run(engine, prompts, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=20, seed=1,
                                             repetition_penalty=1.2, presence_penalty=0.5, logprobs=3,
                                             logit_bias={11: 2.0}, min_tokens=2, stop=["\n\n"]), "mix")
        _run(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=5, n=2), "mix2")
        served = list(compiles)
        jax.jit(lambda x: x * 3 + 1)(np.float32(2))  # control: the listener does see a compilation
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert served == []
    assert compiles, "the compile listener saw nothing, so it proves nothing"


def test_prompt_logprobs_match_the_full_forward(engine, model, smollm2_tokenizer):
    import jax
    import jax.numpy as jnp

    prompt = smollm2_tokenizer.encode(LONG)  # longer than one prefill chunk
    logits = np.asarray(model(jnp.asarray([prompt]), jnp.arange(len(prompt))[None], jnp.asarray([len(prompt)])))[0]
    expected = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for start, name in ((0, "plp"), (10, "plp-cached")):  # the second run would otherwise hit the cache
        res = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2,
                                                    prompt_logprobs_start=start), name)[0]
        lps = res.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        assert all(lp is None for lp in lps[1:start])
        for i in range(max(start, 1), len(prompt)):
            assert lps[i].token_id == prompt[i]
            np.testing.assert_allclose(lps[i].logprob, expected[i - 1, prompt[i]], atol=2e-4)
            top_ids = [t for t, _ in lps[i].top]
            assert top_ids == list(np.argsort(-expected[i - 1])[:2])


def test_structured_output_survives_preemption(engine, smollm2_tokenizer):
    """Constrained sequences preempted by the small page budget resume their grammar where they
    left off: greedy outputs equal those of the same requests run one at a time, and all match."""
    import re

    from jaxserve.structured import spec as S
    from jaxserve.structured.compiler import GrammarCompiler
    from jaxserve.structured.vocabulary import token_vocabulary

    compiler = GrammarCompiler(token_vocabulary(smollm2_tokenizer.hf, sorted(engine.eos_ids)), smollm2_tokenizer.hf)
    try:
        pattern = r"[A-Z][a-z]{0,11}( [a-z]{1,12}){25,30}\."
        grammar = compiler.get(S.regex(pattern, "regex"))
        prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=110, grammar=grammar)
        alone = [_run(engine, [p], params, f"alone{i}")[0].outputs[0] for i, p in enumerate(prompts)]
        before = engine.num_preemptions
        together = [r.outputs[0] for r in _run(engine, prompts, params, "together")]
        assert engine.num_preemptions > before
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        for o in together:
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
        # Sampled, n > 1, each sample keeps its own grammar state.
        sampled = _run(engine, prompts[:1], SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=110,
                                                           grammar=grammar), "sampled")[0]
        assert len(sampled.outputs) == 3
        assert all(re.fullmatch(pattern, o.text) for o in sampled.outputs), [o.text for o in sampled.outputs]
    finally:
        compiler.close()


def test_overlapped_steps_and_the_decode_loop_give_the_same_outputs(engine, model, smollm2_tokenizer):
    """The engine turns step N's tokens into text while step N+1 runs, so a stop string ends its
    sequence one step late and that step's token must vanish; the device decode loop runs up to 8
    decode iterations per step, ending rows on EOS, stop ids and length inside the loop, and a stop
    string found afterwards drops the tokens sampled after it. Everything a client sees (text,
    token ids, finish and stop reasons) must equal a run where every step completes before the
    next starts, one token at a time, for a batch mixing every kind of ending, greedy and seeded
    sampling; logprobs within 1e-4 (the loop admits waiting sequences when it returns, so the
    decode batches, and with them the last bits of float32 sums, can differ)."""
    import dataclasses

    assert engine.overlap and engine.info.decode_steps == 1
    serial = build_engine(model, smollm2_tokenizer, dataclasses.replace(SMALL, overlap=False))
    looped = build_engine(model, smollm2_tokenizer, dataclasses.replace(
        SMALL, scheduler=dataclasses.replace(SMALL.scheduler, decode_steps=8)))
    chat = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    france = smollm2_tokenizer.encode("The capital of France is")
    work = [
        (france, SamplingParams(temperature=0.0, max_tokens=12, stop=["answer is"])),  # stop string mid-run
        (france, SamplingParams(temperature=0.0, max_tokens=4, stop=["The"])),  # stop string and length race
        (chat, SamplingParams(temperature=0.0, max_tokens=60, logprobs=2)),  # EOS
        (chat, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[30])),  # stop token id (".")
        (smollm2_tokenizer.encode(LONG), SamplingParams(temperature=0.8, max_tokens=20, seed=3, n=2)),  # length
        # One sample stops while its sibling runs on: the request stays live around the dropped token.
        (smollm2_tokenizer.encode(LONG), SamplingParams(temperature=1.0, max_tokens=30, seed=5, n=2, stop=[" the"])),
    ]
    outputs, logprobs = [], []
    for name, eng in (("overlap", engine), ("serial", serial), ("loop", looped)):
        ids = [f"{name}-{i}" for i in range(len(work))]
        for rid, (prompt, params) in zip(ids, work):
            eng.add_request(rid, prompt, params)
        steps = eng.num_steps
        results = run_to_completion(eng, ids)
        eng.check_idle_integrity()
        outputs.append([[(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in results[r].outputs]
                        for r in ids])
        logprobs.append([[(t.token_id, t.logprob, t.top) for o in results[r].outputs for t in (o.logprobs or [])]
                         for r in ids])
        if name == "loop":
            assert eng.num_steps - steps < 40  # ~110 tokens of the longest rows: most steps ran several
        # Once nothing waits, decode steps are dispatched before the tokens of the step they follow
        # are read (Scheduler.schedule_ahead), and rows ended there (EOS, stop id) are dropped.
        assert (eng.num_steps_ahead > 0) == (name != "serial"), (name, eng.num_steps_ahead)
        # Every step was one timed call (the last one dispatched ahead may still be running when
        # the engine goes idle, and is counted when it returns); only a threaded dispatcher hands
        # over to a call already waiting, and the steps dispatched ahead were waiting when the one
        # before returned.
        stats = eng.stats
        assert eng.num_steps - 1 <= stats.step_calls <= eng.num_steps and stats.step_call_seconds > 0
        assert (stats.step_handover_seconds > 0) == (name != "serial"), (name, stats)
    assert outputs[0] == outputs[1] == outputs[2]
    for run in logprobs[1:]:
        for ours, theirs in zip(run, logprobs[0]):
            assert [(i, [t for t, _ in top]) for i, _, top in ours] == [(i, [t for t, _ in top]) for i, _, top in theirs]
            values = [[lp, *(v for _, v in top)] for _, lp, top in ours]
            assert np.allclose(values, [[lp, *(v for _, v in top)] for _, lp, top in theirs], atol=1e-4)
    reasons = [o[2] for request in outputs[0] for o in request]
    assert reasons.count("stop") >= 3 and "length" in reasons


def test_text_work_runs_while_a_blocking_step_call_waits(engine, smollm2_tokenizer):
    """On a GPU, calling a compiled decode loop returns only once the loop has ended (XLA:GPU reads
    the loop's condition back after every iteration). The engine calls the runner on its dispatch
    thread, so `step()` returns step N's text while step N+1's call still blocks: here a runner
    whose `execute` returns only when the test lets it. Outputs equal the engine's own."""
    import threading

    from jaxserve.engine.core import Engine

    gate, entered, inside = threading.Semaphore(0), threading.Semaphore(0), []

    class BlockingRunner:  # the engine's real runner; each call returns only when the gate opens
        def execute(self, step):
            inside.append(step)
            entered.release()
            try:
                handle = engine.runner.execute(step)
                assert gate.acquire(timeout=5), "the test never opened the gate: step() was blocked"
                return handle
            finally:
                inside.remove(step)

        def close(self) -> None:
            pass

    prompt = smollm2_tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = _run(engine, [prompt], params, "unblocked")[0].outputs[0]
    blocked = Engine(engine.scheduler, engine.builder, BlockingRunner(), engine.tokenizer, engine.info)
    blocked.add_request("blocked", prompt, params)
    text, tokens, finished = "", [], False
    while not finished:
        deltas = blocked.step()
        if blocked.has_unfinished():  # step() came back while the step it dispatched is inside the call
            assert entered.acquire(timeout=5) and len(inside) == 1
        for d in deltas:
            text, tokens, finished = text + d.outputs[0].text, tokens + d.outputs[0].token_ids, d.finished
        gate.release()
    blocked.close()
    engine.check_idle_integrity()
    assert (text, tokens) == (expected.text, expected.token_ids) and len(tokens) == 6


def test_a_row_that_ended_runs_nothing_in_the_step_dispatched_ahead(engine, smollm2_tokenizer):
    """The step after a plain decode step is dispatched before that step's tokens are read
    (Scheduler.schedule_ahead). A row that samples a stop id there is in the step already
    dispatched: the device sees its last token end it, so it samples nothing more. Every token the
    device samples is one the client gets: the prefill's, then the decode steps' (num_sampled),
    with none left over for the ended row."""
    from jaxserve.engine.core import Engine

    prompt = smollm2_tokenizer.encode("The capital of France is")
    base = _run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), "base")[0]
    stop_id = base.outputs[0].token_ids[2]
    assert stop_id not in base.outputs[0].token_ids[:2]
    steps = []

    class RecordingRunner:  # the engine's real runner; keeps each step's outputs
        def execute(self, step):
            handle = engine.runner.execute(step)
            steps.append(handle)
            return handle

        def close(self) -> None:
            pass

    recorded = Engine(engine.scheduler, engine.builder, RecordingRunner(), engine.tokenizer, engine.info)
    recorded.add_request("stops", prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id]))
    out = run_to_completion(recorded, ["stops"])["stops"].outputs[0]
    while recorded.step():  # the step dispatched ahead after the last one read, if any
        pass
    recorded.close()
    engine.check_idle_integrity()
    assert out.token_ids == base.outputs[0].token_ids[:3] and out.finish_reason == "stop"
    assert recorded.num_steps_ahead >= 2  # after the first decode step, and after the one that stopped
    decoded = [int(h.decode_output().num_sampled[0]) for h in steps if h.decode_output() is not None]
    assert decoded[-1] == 0  # the ended row's step dispatched ahead
    assert 1 + sum(decoded) == len(out.token_ids)
