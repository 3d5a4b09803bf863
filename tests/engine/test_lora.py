"""LoRA adapters in the engine against the `peft` library's own models: two adapters (different
ranks, targets, alphas, rsLoRA) and the base model decoding side by side in one batch give each
request the tokens and logprobs of its own PEFT model; the prefix cache never lends one adapter's
pages to another; adapters load into free slots and unload at run time (a reloaded name decodes
with its new weights); more adapters than slots take turns in them, in arrival order; bad adapters,
too many adapters and unknown names are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_requests import run_requests
from lora_adapters import make_adapter
from tiny_models import make_tiny_model

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.models.lora import add_lora_slots, target_shapes
from jaxserve.weights import WeightsError, load_model
from jaxserve.weights.lora_adapter import TARGETS, LoraModuleSpec, load_adapter

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=64),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=4, max_model_len=64,
                              decode_buckets=(4,), prefill_buckets=(32,)),
    check_integrity=True,
)
PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [1, 42, 7], [1, 9, 8, 7, 6, 5, 4, 3, 2]]
MAX_TOKENS = 12


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by full forwards of the HF (or PEFT) model, EOS included
    like any token (the engine's requests set ignore_eos)."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            tokens.append(token)
            logprobs.append(logp[token].item())
    return tokens, logprobs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny base model's directory and its HF model."""
    base_dir = tmp_path_factory.mktemp("base")
    return base_dir, make_tiny_model("llama3", base_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, base):
    base_dir, hf = base
    references = {None: hf}
    specs = []
    for i, name in enumerate(("sql", "poet")):
        path = tmp_path_factory.mktemp(name)
        references[name] = make_adapter(hf, name, path, seed=10 + i)
        specs.append(LoraModuleSpec(name, path))
    decoder = load_model(base_dir, "float32", use_cache=False).model
    shapes = target_shapes(decoder)
    add_lora_slots(decoder, 3, 8, TARGETS)
    engine = build_engine(decoder, None, CONFIG, eos_ids=[2])
    assert [engine.load_lora(s.name, s.path).rank for s in specs] == [8, 4]
    return engine, references, specs, shapes


def test_adapters_and_base_in_one_batch_match_peft(setup):
    engine, references, _, _ = setup
    assert engine.lora.names == ("sql", "poet") and (engine.info.max_loras, engine.info.max_lora_rank) == (3, 8)
    expected = {name: [_hf_greedy(ref, p) for p in PROMPTS] for name, ref in references.items()}
    assert expected["sql"] != expected[None] and expected["poet"] != expected[None]  # the adapters matter
    # Every prompt under every adapter and the base model, interleaved in one batch.
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in (None, "sql", "poet")]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, lora=name)
              for name, _ in jobs]
    outs = run_requests(engine, [PROMPTS[i] for _, i in jobs], params, "mixed")
    for (name, i), out in zip(jobs, outs):
        tokens, logprobs = expected[name][i]
        assert out.outputs[0].token_ids == tokens, (name, i)
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=2e-4), (name, i)


def test_prefix_cache_is_per_adapter(setup):
    """The base model's pages of a prompt are never read by an adapter's request of the same
    prompt (its K/V differ): the adapter's output stays its PEFT model's, and its own second run
    hits its own cache."""
    engine, references, _, _ = setup
    prompt = [1, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95]  # 4 full pages + 1
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    (base,) = run_requests(engine, [prompt], SamplingParams(**greedy), "base")
    for round_ in range(2):
        (out,) = run_requests(engine, [prompt], SamplingParams(**greedy, lora="poet"), f"poet{round_}")
        tokens, logprobs = _hf_greedy(references["poet"], prompt)
        assert out.outputs[0].token_ids == tokens
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=2e-4)
        assert out.num_cached_tokens == (0 if round_ == 0 else 16)
    assert base.outputs[0].token_ids == _hf_greedy(references[None], prompt)[0]


def test_unknown_adapter_refused(setup):
    engine = setup[0]
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", [1, 2, 3], SamplingParams(lora="nope"))
    assert e.value.param == "lora" and "sql, poet" in str(e.value)


def test_bad_adapters_refused(setup, tmp_path):
    _, _, specs, shapes = setup
    good = specs[0].path
    config = json.loads((good / "adapter_config.json").read_text())

    def refused(change: dict, words: str) -> None:
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        (bad / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        with pytest.raises(WeightsError, match=words):
            load_adapter(LoraModuleSpec("bad", bad), 3, shapes)

    refused({"use_dora": True}, "DoRA")
    refused({"bias": "lora_only"}, "biases")
    refused({"modules_to_save": ["lm_head"]}, "modules_to_save")
    with pytest.raises(WeightsError, match="for layer 2, and the model has 2"):
        load_adapter(specs[0], 2, shapes)
    with pytest.raises(WeightsError, match="needs"):
        load_adapter(specs[0], 3, dict(shapes, q_proj=(64, 32)))
    with pytest.raises(WeightsError, match="no adapter_config.json"):
        load_adapter(LoraModuleSpec("none", tmp_path), 3, shapes)


def test_load_and_unload_at_run_time(setup, tmp_path):
    engine, references, specs, _ = setup
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run_requests(engine, [PROMPTS[0]], SamplingParams(**greedy), "base-before")  # cached for the end
    # A third adapter takes the free slot: the poet's files under another name decode as the poet.
    engine.load_lora("verse", specs[1].path)
    (out,) = run_requests(engine, [PROMPTS[0]], SamplingParams(**greedy, lora="verse"), "verse")
    assert out.outputs[0].token_ids == _hf_greedy(references["poet"], PROMPTS[0])[0]
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("verse", specs[0].path)
    # In use: refused until its request ends.
    engine.add_request("running", PROMPTS[1], SamplingParams(**greedy, lora="verse"))
    with pytest.raises(ValueError, match="in use by 1 running request"):
        engine.unload_lora("verse")
    engine.step()
    assert engine.stats.running_loras == ("verse",) and engine.stats.waiting_loras == ()  # /metrics' info
    engine.abort("running")
    # Unloaded and loaded again under the same name with other weights (sql's): its requests
    # decode with the new ones, never the old pages of the same prompt.
    engine.unload_lora("verse")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'verse'"):
        engine.add_request("gone", PROMPTS[0], SamplingParams(lora="verse"))
    engine.load_lora("verse", specs[0].path)
    (out,) = run_requests(engine, [PROMPTS[0]], SamplingParams(**greedy, lora="verse"), "verse2")
    assert out.outputs[0].token_ids == _hf_greedy(references["sql"], PROMPTS[0])[0]
    assert out.num_cached_tokens == 0
    engine.unload_lora("verse")
    assert engine.lora.names == ("sql", "poet")
    (base,) = run_requests(engine, [PROMPTS[0]], SamplingParams(**greedy), "base-after")
    assert base.num_cached_tokens == 8  # unloading keeps the other adapters' and the base model's pages
    with pytest.raises(ValueError, match="no LoRA adapter named 'verse'"):
        engine.unload_lora("verse")


def test_static_slots_refuse_what_they_cannot_hold(tmp_path):
    """Slots made for given adapters (--lora-modules without --enable-lora) cover only their
    projections and rank: another adapter is refused, naming what is missing."""
    hf = make_tiny_model("llama3", tmp_path / "base")
    make_adapter(hf, "sql", tmp_path / "sql")
    decoder = load_model(tmp_path / "base", "float32", use_cache=False).model
    add_lora_slots(decoder, 2, 4, ("q_proj", "v_proj", "down_proj"))
    engine = build_engine(decoder, None, CONFIG, eos_ids=[2], compile=False)
    with pytest.raises(ValueError, match="rank 8, above this server's --max-lora-rank 4"):
        engine.load_lora("sql", tmp_path / "sql")
    assert engine.lora.names == ()


def test_start_up_sizes_the_slots(tmp_path):
    """--lora-modules alone: one slot per adapter, of their largest rank, on the projections they
    adapt; --enable-lora: every projection, at least rank 16, --max-loras slots."""
    from jaxserve.config import ModelConfig
    from jaxserve.models.lora import slot_targets
    from jaxserve.startup import add_lora_capacity

    hf = make_tiny_model("llama3", tmp_path / "base")
    make_adapter(hf, "poet", tmp_path / "poet")  # rank 4 on q, v and down
    poet = LoraModuleSpec("poet", tmp_path / "poet")
    for config, (slots, rank, targets) in (
            (dict(lora_modules=(poet,)), (1, 4, ("q_proj", "v_proj", "down_proj"))),
            (dict(lora_modules=(poet,), enable_lora=True, max_loras=3), (3, 16, tuple(TARGETS))),
            (dict(enable_lora=True, max_lora_rank=8), (1, 8, tuple(TARGETS)))):
        decoder = load_model(tmp_path / "base", "float32", use_cache=False).model
        add_lora_capacity(decoder, ModelConfig(model="m", served_model_name="m", **config))
        assert (decoder.lora_slots, decoder.lora_rank, slot_targets(decoder)) == (slots, rank, targets)


def test_fused_projection_adapter_matches_peft(tmp_path):
    """A Phi-3 adapter on the fused qkv_proj and gate_up_proj serves as its PEFT model: the model
    holds q/k/v and gate/up apart, and the adapter's B splits by their rows under one A."""
    hf = make_tiny_model("phi3", tmp_path / "base")
    reference = make_adapter(hf, "phi3-fused", tmp_path / "fused")
    decoder = load_model(tmp_path / "base", "float32", use_cache=False).model
    adapter = load_adapter(LoraModuleSpec("fused", tmp_path / "fused"), decoder.cfg.num_layers,
                           target_shapes(decoder))
    assert adapter.targets == sorted(TARGETS)
    add_lora_slots(decoder, 1, 4, TARGETS)
    engine = build_engine(decoder, None, CONFIG, eos_ids=[2])
    engine.load_lora("fused", tmp_path / "fused")
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora=name)
              for name in ("fused", None)]
    outs = run_requests(engine, [PROMPTS[0]] * 2, params, "phi3")
    assert outs[0].outputs[0].token_ids == _hf_greedy(reference, PROMPTS[0])[0]
    assert outs[1].outputs[0].token_ids == _hf_greedy(hf, PROMPTS[0])[0] != outs[0].outputs[0].token_ids


def test_more_adapters_than_slots_take_turns(tmp_path, base, setup):
    """Three adapters and one slot (--max-loras 1 --max-cpu-loras 3): every request still decodes
    as its PEFT model, at most one adapter runs per step, and an adapter waiting for the slot is
    not passed by later requests of the adapter in it (the slot drains for it, in arrival order);
    base-model requests run beside any adapter. A fourth adapter is refused."""
    base_dir, hf = base
    _, references, specs, _ = setup
    references = dict(references, third=make_adapter(hf, "sql", tmp_path / "third", seed=77))
    decoder = load_model(base_dir, "float32", use_cache=False).model
    add_lora_slots(decoder, 1, 8, TARGETS)
    engine = build_engine(decoder, None, dataclasses.replace(CONFIG, max_cpu_loras=3), eos_ids=[2])
    for spec in specs:
        engine.load_lora(spec.name, spec.path)
    engine.load_lora("third", tmp_path / "third")
    with pytest.raises(ValueError, match=r"3 LoRA adapters are loaded .*\(--max-cpu-loras\)"):
        engine.load_lora("fourth", specs[0].path)
    assert engine.lora.resident == ("sql",)  # the first loaded took the free slot

    # Arrival order: poet waits for sql's slot; sql's second request, behind it, waits too, and
    # poet's second waits for the adapters before it.
    jobs = [("sql", 0), ("poet", 1), (None, 2), ("sql", 2), ("third", 0), (None, 0), ("poet", 0)]
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for k, (name, i) in enumerate(jobs):
        engine.add_request(f"turn-{k}", PROMPTS[i], SamplingParams(**greedy, lora=name))
    started: dict[str, int] = {}
    outs: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
        step += 1
        running = engine.scheduler.running
        assert len({s.params.lora for s in running} - {None}) <= 1, step
        for seq in running:
            started.setdefault(seq.request_id, step)
    engine.check_idle_integrity()
    for k, (name, i) in enumerate(jobs):
        assert outs[f"turn-{k}"] == _hf_greedy(references[name], PROMPTS[i])[0], (k, name)
    order = sorted(range(len(jobs)), key=lambda k: started[f"turn-{k}"])
    adapters = [jobs[k][0] for k in order if jobs[k][0] is not None]
    assert adapters == ["sql", "poet", "sql", "third", "poet"]  # strictly in arrival order
    assert started["turn-2"] == started["turn-0"] and started["turn-5"] == started["turn-0"]  # base: at once
