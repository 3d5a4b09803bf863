"""The engine's real prefill and decode steps for a random-weight Llama-3-8B, compiled by the real
TPU compiler for v5e and v6e chips (no TPU, no weights: jaxserve.plan), on one chip and with
tensor parallelism over 4 and 8: what makes a step fast, checked on every commit.

Per compiled step (per chip):
  - no weight is copied: a decode step's scratch is below 5% of one layer's weights plus the
    sampler's [rows, vocab] float32 arrays (at most sixteen at once, rows padded to the TPU's
    8-row tiles); the old layer scan copied a whole layer out of the stacked weights on every step;
  - the KV cache and the device batch are updated in place (donated and aliased);
  - weights, cache, device batch and scratch fit the chip's HBM at the configured page count;
  - a decode step's model reads (its bytes less the sampler's, which are reported apart) are at
    most 1/0.9 of what it must read anyway: every weight once plus the KV pages its rows can see
    (jaxserve.plan counts HBM bytes: VMEM prefetching off, and the VMEM side of what the compiler
    still stages there taken out; see there). Nor are they less than 1/1.02 of it (no step can
    read less than its floor): XLA:TPU reads a slice of a stacked weight in place, so a restored
    layer scan would copy nothing, but the cost analysis counts a loop's body once, and a scan
    over 32 layers would show as ~1/32 of the weights read; bytes the VMEM correction took out
    that were HBM traffic would show too, and so would a sampler measured on more of the
    vocabulary than the step's own shard. Every step measured 0.93-1.00 of its floor on
    2026-11-26 (benchmarks/RESULTS.md).

Compile time on two CPU cores is 5-40 s per step of a 32-layer model, so CI compiles the smallest
and largest decode buckets of every configuration, the largest prefill bucket on one chip, and the
whole of a serving grid (decode 1/4/16/64, prefill 256/1024) at TP 8 on v6e;
`python -m jaxserve.plan` compiles any grid on demand. benchmarks/RESULTS.md has the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GiB = 1 << 30
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 64
# (topology, tensor parallel size, full grid): Llama-3-8B's 16 GB of bf16 weights leave a v5e chip
# (16 GiB) almost no room for a KV cache, so one-chip serving is on v6e (32 GiB).
DECODE = dict(decode_buckets=(1, MAX_NUM_SEQS), kinds=("decode",))
GRID = dict(decode_buckets=(1, 4, 16, MAX_NUM_SEQS), prefill_buckets=(256, 1024))
CONFIGS = [("v6e:2x2", 1, dict(decode_buckets=(1, MAX_NUM_SEQS), prefill_buckets=(1024,))),
           ("v5e:2x2", 4, DECODE), ("v6e:2x2", 4, DECODE), ("v5e:2x4", 8, DECODE), ("v6e:2x4", 8, GRID)]


def _presets():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import dummy_model

    return dummy_model


def _llama3_8b():
    from jaxserve.models.config import decoder_config_from_hf

    return decoder_config_from_hf(_presets().PRESETS["llama-3-8b"])


@pytest.fixture(scope="module")
def plans(tpu_chip):
    """topology/tp -> jaxserve.plan.Plan, every step compiled once for the whole module."""
    from jaxserve.plan import CHIPS, GiB as _GiB, plan

    cfg = _llama3_8b()
    out = {}
    for topology, tp, grid in CONFIGS:
        chip = tpu_chip(topology)  # skips without libtpu
        hbm = CHIPS[chip.mesh.devices.flat[0].device_kind][0]
        # The configured page count: 90% of what the chip has left after the weights and 1.5 GiB
        # for the device batch and the steps' scratch (the server measures the scratch instead).
        weights = 2 * _presets().parameter_count(_presets().PRESETS["llama-3-8b"]) // tp
        page = 2 * cfg.num_layers * cfg.num_kv_heads * 16 * cfg.head_dim * 2 // min(tp, cfg.num_kv_heads)
        num_pages = int((hbm - weights - 1.5 * _GiB) * 0.9) // page
        out[f"{topology}/{tp}"] = plan(cfg, topology=topology, tensor_parallel_size=tp, max_model_len=MAX_MODEL_LEN,
                                       max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024, max_prefill_seqs=8,
                                       num_pages=num_pages, serving_compile=False, **grid)
    return out


def _cases() -> list[str]:
    return [f"{t}/{tp}" for t, tp, _ in CONFIGS]


@pytest.mark.parametrize("config", _cases())
def test_every_step_compiles_and_fits_the_chip(plans, config):
    p = plans[config]
    assert p.error is None, p.error
    kinds = {(s.kind, s.tokens) for s in p.steps}
    assert ("decode", 1) in kinds and ("decode", MAX_NUM_SEQS) in kinds
    assert p.kv_tokens >= MAX_NUM_SEQS * MAX_MODEL_LEN // 4, "the cache holds a useful batch"
    for s in p.steps:
        # arguments (weights, cache, device batch, inputs) plus scratch: the program's whole HBM.
        assert s.argument_bytes + s.temp_bytes <= p.hbm_bytes, (s.kind, s.tokens)
        # The donated cache and device batch are updated in place, never copied.
        assert s.alias_bytes >= p.kv_bytes + p.batch_bytes, (s.kind, s.tokens, s.alias_bytes)


@pytest.mark.parametrize("config", _cases())
def test_no_weight_is_copied(plans, config):
    p = plans[config]
    cfg = _llama3_8b()
    layer_bytes = (p.weights_bytes - 2 * cfg.vocab_size * cfg.hidden_size * 2 // p.tensor_parallel_size) / cfg.num_layers
    for s in p.steps:
        if s.kind == "decode":
            sampler = 16 * max(s.seqs, 8) * cfg.vocab_size * 4
            assert s.temp_bytes < 0.05 * layer_bytes + sampler, (s.seqs, s.temp_bytes, layer_bytes)


@pytest.mark.parametrize("config", _cases())
def test_decode_reads_little_more_than_its_floor(plans, config):
    from jaxserve.plan import floor_ratio

    p = plans[config]
    decodes = [s for s in p.steps if s.kind == "decode"]
    assert decodes
    for s in decodes:
        assert 0 < s.sampler_bytes < s.bytes_accessed
        assert 0.9 <= floor_ratio(s) <= 1.02, (s.tokens, s.floor_bytes, s.bytes_accessed, s.sampler_bytes)


def test_the_whole_grid_compiles(plans):
    p = plans["v6e:2x4/8"]
    assert sorted(s.tokens for s in p.steps if s.kind == "decode") == list(GRID["decode_buckets"])
    assert sorted(s.tokens for s in p.steps if s.kind == "prefill") == list(GRID["prefill_buckets"])


def test_plan_command_prints_the_table(tmp_path, capsys, tpu_chip):
    tpu_chip("v6e:2x2")
    from jaxserve import plan as plan_module

    # The command, not the model, is under test: 2 layers and a small vocabulary (whose sampler's
    # compile would otherwise be most of the time).
    small = dict(_presets().PRESETS["llama-3-8b"], num_hidden_layers=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(small))
    # With LoRA adapter slots (two of rank 16 on every projection): their factors are weights.
    code = plan_module.main(["--model", str(tmp_path), "--topology", "v6e:2x2", "--tp", "4", "--max-model-len",
                             "2048", "--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--prefill-buckets", "32",
                             "--max-loras", "2", "--max-lora-rank", "16", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tensor parallel over 4 chip(s)" in out and "KV cache:" in out and "tok/s" in out
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["error"] is None and report["num_pages"] > 1000
    assert {(s["kind"], s["tokens"]) for s in report["steps"]} == {("prefill", 32), ("decode", 1)}  # no prefill 16
    # Per layer, 32 columns (2 x 16) beside each projection's input and output: (4096 + 4096) for q
    # and o, (4096 + 1024) for k and v, (4096 + 14336) for gate, up and down; a factor is split 4
    # ways with its projection (k/v's too: 8 kv heads), the other replicated; bfloat16. The 2-layer
    # model's weights are what they are without slots plus exactly that.
    import jax.numpy as jnp

    from jaxserve.models.config import decoder_config_from_hf

    lora = 2 * 2 * 32 * sum(i + o // 4 if split_out else i // 4 + o for i, o, split_out in (
        (4096, 4096, True), (4096, 1024, True), (4096, 1024, True), (4096, 4096, False),
        (4096, 14336, True), (4096, 14336, True), (14336, 4096, False)))
    mesh = plan_module.topology_mesh("v6e:2x2", 4)
    base = plan_module.per_chip_bytes(plan_module.abstract_params(decoder_config_from_hf(small), jnp.bfloat16, mesh)[1])
    assert report["weights_bytes"] == base + lora
    # A bucket list the server would refuse is refused before anything compiles.
    code = plan_module.main(["--model", str(tmp_path), "--topology", "v6e:2x2", "--max-num-seqs", "8",
                             "--decode-buckets", "2", "4"])
    # In the flags' words, as the server's own command line says it (test_cli).
    assert code == 2 and "the largest of --decode-buckets (2, 4) must equal --max-num-seqs=8" in capsys.readouterr().err
    # Every other bad input is one line naming it (exit 2), never a traceback.
    (tmp_path / "cls").mkdir()
    classifier = dict(small, architectures=["LlamaForSequenceClassification"])
    (tmp_path / "cls" / "config.json").write_text(json.dumps(classifier))
    (tmp_path / "sizeless").mkdir()
    (tmp_path / "sizeless" / "config.json").write_text(json.dumps({k: v for k, v in small.items() if k != "hidden_size"}))
    for argv, said in (
        (["--topology", "bogus"], "--topology bogus: INVALID_ARGUMENT"),
        (["--topology", "v6e:2x2", "--tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
        (["--topology", "v6e:2x2", "--tp", "8"], "--tensor-parallel-size 8: the topology v6e:2x2 has 4 chips"),
        (["--topology", "v6e:2x2", "--page-size", "0"], "--page-size must be at least 1, got 0"),
        (["--topology", "v6e:2x2", "--kv-cache-memory-fraction", "0"], "--kv-cache-memory-fraction must be in (0, 1]"),
        (["--topology", "v6e:2x2", "--model", str(tmp_path / "cls")],
         "['LlamaForSequenceClassification'] is not supported"),
        (["--topology", "v6e:2x2", "--model", str(tmp_path / "sizeless")], "config.json: no 'hidden_size'"),
    ):
        argv = ["--model", str(tmp_path), *argv] if "--model" not in argv else argv
        assert plan_module.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (argv, err)


def test_v5e_tp4_small_batches_read_their_floor(tpu_chip):
    """At TP 4 with 2-8 rows XLA:TPU copies the q, k and v weight shards into VMEM, transposed, for
    the small-batch dots. The cost analysis counted the VMEM write and the dot's VMEM read of each
    copy as bytes accessed, ~1 GB per chip over the floor; HBM sees each weight once. Bounded from
    both sides: the correction must not take out real traffic either."""
    from jaxserve.plan import floor_ratio, plan

    tpu_chip("v5e:2x2")
    p = plan(_llama3_8b(), topology="v5e:2x2", tensor_parallel_size=4, max_model_len=MAX_MODEL_LEN,
             max_num_seqs=4, max_num_batched_tokens=1024, max_prefill_seqs=4, num_pages=8192,
             serving_compile=False, decode_buckets=(4,), kinds=("decode",))
    assert p.error is None, p.error
    (step,) = p.steps
    assert 0.95 <= floor_ratio(step) <= 1.05, (step.floor_bytes, step.bytes_accessed, step.sampler_bytes)


def test_int8_weights_halve_the_decode_read(tpu_chip):
    """--quantization int8: a decode step of Llama-3-8B's layers on one v6e chip reads about half
    the bytes of the bfloat16 step (the convert feeds the dot; no dequantized copy of a weight is
    written), still within its own floor, and holds half the weights."""
    from jaxserve.models.config import decoder_config_from_hf
    from jaxserve.plan import floor_ratio, plan

    tpu_chip("v6e:2x2")
    # Llama-3-8B's layers, 4 of them, and a small vocabulary: every assertion is a ratio, and the
    # 32-layer compiles with the 128k sampler took 77 s of CI.
    cfg = decoder_config_from_hf(dict(_presets().PRESETS["llama-3-8b"], num_hidden_layers=4, vocab_size=4096))
    steps, weights = {}, {}
    for q in ("none", "int8"):
        # A short context, so the KV pages (the same in both) are a small part of the read.
        p = plan(cfg, topology="v6e:2x2", tensor_parallel_size=1, max_model_len=512,
                 max_num_seqs=8, max_num_batched_tokens=512, max_prefill_seqs=4, num_pages=512,
                 serving_compile=False, decode_buckets=(8,), kinds=("decode",), quantization=q)
        assert p.error is None, p.error
        (steps[q],) = p.steps
        weights[q] = p.weights_bytes
    bf16, int8 = steps["none"], steps["int8"]
    model = lambda s: s.bytes_accessed - s.sampler_bytes  # noqa: E731
    assert 0.45 <= model(int8) / model(bf16) <= 0.56, (model(int8), model(bf16))
    assert 0.45 <= weights["int8"] / weights["none"] <= 0.55
    assert 0.9 <= floor_ratio(int8) <= 1.02, (int8.floor_bytes, int8.bytes_accessed, int8.sampler_bytes)
    assert int8.temp_bytes < bf16.temp_bytes + (64 << 20), (int8.temp_bytes, bf16.temp_bytes)


def test_an_8bit_kv_cache_halves_the_page_and_the_kv_read(tpu_chip):
    """--kv-cache-dtype fp8 planned for one v6e chip (Llama-3-8B's layer shapes, 2 layers to keep
    the compiles short): a page costs half the bytes (so twice the pages fit what the weights leave),
    and a long-context decode step reads half the KV bytes of the bfloat16 cache's step."""
    from jaxserve.models.config import decoder_config_from_hf
    from jaxserve.plan import format_plan, plan

    tpu_chip("v6e:2x2")
    # (a small vocabulary too: the sampler's compile, not the model's, is most of the time)
    cfg = decoder_config_from_hf(dict(_presets().PRESETS["llama-3-8b"], num_hidden_layers=2, vocab_size=4096))
    rows, pages_per_row = 16, 8192 // 16
    plans = {kv: plan(cfg, topology="v6e:2x2", tensor_parallel_size=1, max_model_len=8192, max_num_seqs=rows,
                      max_num_batched_tokens=256, max_prefill_seqs=4, num_pages=rows * pages_per_row + 1,
                      decode_buckets=(rows,), kinds=("decode",), serving_compile=False, kv_cache_dtype=kv)
             for kv in ("auto", "fp8")}
    bf16, fp8 = plans["auto"], plans["fp8"]
    assert bf16.error is None and fp8.error is None, (bf16.error, fp8.error)
    assert fp8.kv_page_bytes * 2 == bf16.kv_page_bytes
    assert "float8_e4m3fn); max_model_len" in format_plan(fp8) and "bfloat16); max_model_len" in format_plan(bf16)
    (s16,), (s8,) = bf16.steps, fp8.steps
    kv_read = rows * pages_per_row * bf16.kv_page_bytes  # every row at max_model_len, bfloat16
    model = lambda s: s.bytes_accessed - s.sampler_bytes  # noqa: E731
    assert model(s16) - model(s8) == pytest.approx(kv_read / 2, rel=0.05)
    assert s8.argument_bytes < s16.argument_bytes - 0.45 * rows * pages_per_row * bf16.kv_page_bytes


def test_a_head_dim_64_cache_is_written_and_read_in_place(tpu_chip):
    """Llama-3.2-1B's layer shapes (head_dim 64) on one v5e chip. XLA:TPU laid a [..., page_size, 64]
    cache out with the pages as its minor dim, which neither the kernels nor the row write can use,
    and copied the whole cache around every step (scratch ~3 caches, a decode step reading ~50x
    its floor). The cache is 128 lanes wide on a TPU (engine/kv_cache.py): a page costs what a
    head_dim-128 page does, and the steps are in place and read their floor like every other."""
    from jaxserve.models.config import decoder_config_from_hf
    from jaxserve.plan import floor_ratio, plan

    tpu_chip("v5e:2x2")
    cfg = decoder_config_from_hf(dict(_presets().PRESETS["llama-3.2-1b"], num_hidden_layers=2, vocab_size=4096))
    assert cfg.head_dim == 64
    rows, pages = 16, 16 * 4096 // 16 + 1
    p = plan(cfg, topology="v5e:2x2", tensor_parallel_size=1, max_model_len=4096, max_num_seqs=rows,
             max_num_batched_tokens=256, max_prefill_seqs=4, num_pages=pages, serving_compile=False,
             decode_buckets=(rows,), prefill_buckets=(256,))
    assert p.error is None, p.error
    assert p.kv_page_bytes == 2 * cfg.num_layers * cfg.num_kv_heads * 16 * 128 * 2
    steps = {s.kind: s for s in p.steps}
    assert set(steps) == {"prefill", "decode"}
    for s in p.steps:
        assert s.alias_bytes >= p.kv_bytes + p.batch_bytes, (s.kind, s.alias_bytes)
        # no copy of the cache (pages x 2 x 64 KiB = 512 MiB): the scratch is the step's own
        assert s.temp_bytes < 0.1 * p.kv_bytes, (s.kind, s.temp_bytes, p.kv_bytes)
    decode = steps["decode"]
    assert 0.9 <= floor_ratio(decode) <= 1.02, (decode.floor_bytes, decode.bytes_accessed, decode.sampler_bytes)


def test_steps_compile_on_a_pool_and_report_in_key_order():
    """The plan lowers steps one by one and compiles them on threads, as the server does: the
    results come back in the keys' order whatever order the compiles finish in, and a compiler
    error is raised as the plan's error, not lost in a thread."""
    import threading
    import time

    from jaxserve.engine.runner import compile_each

    threads = set()

    def compile_one(key: int, lowered: str) -> tuple[int, str]:
        threads.add(threading.current_thread().name)
        time.sleep(0.05 * (3 - key))  # the first key finishes last
        return key, lowered

    assert compile_each([0, 1, 2], lambda k: f"lowered {k}", compile_one, "steps") == [
        (0, "lowered 0"), (1, "lowered 1"), (2, "lowered 2")]
    assert threads and all(name.startswith("compile") for name in threads)

    def out_of_memory(key: int, lowered: str) -> int:
        if key == 1:
            raise ValueError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return key

    with pytest.raises(ValueError, match="RESOURCE_EXHAUSTED"):
        compile_each([0, 1, 2], str, out_of_memory, "steps")


def test_vmem_accesses_are_not_counted_as_hbm_traffic():
    """An optimized TPU module's text: a weight copied into VMEM (S(1)) and read there by a fusion.
    The copy's write and the fusion's read are VMEM accesses; the copy's read of the weight, the
    output's write, and a plain HBM copy are not."""
    from jaxserve.plan import vmem_access_bytes

    hlo = """HloModule step

%fused_computation (p0: bf16[1024,4096], p1: bf16[2,4096]) -> bf16[2,1024] {
  %p0 = bf16[1024,4096]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %copy.9 = bf16[1024,4096]{1,0:T(8,128)(2,1)S(1)} copy(%p0)
}

ENTRY %main (param.1: bf16[4096,1024], param.2: bf16[2,4096]) -> (bf16[2,1024], bf16[4096,1024]) {
  %param.1 = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="w"}
  %param.2 = bf16[2,4096]{1,0:T(2,128)(2,1)} parameter(1)
  %bitcast.1 = bf16[1024,4096]{0,1:T(8,128)(2,1)} bitcast(%param.1)
  %copy.1 = bf16[1024,4096]{1,0:T(8,128)(2,1)S(1)} copy(%bitcast.1), metadata={op_name="a/dot_general(x)"}
  %fusion.1 = bf16[2,1024]{1,0:T(2,128)(2,1)} fusion(%copy.1, %param.2), kind=kOutput, calls=%fused_computation
  %copy.2 = bf16[4096,1024]{1,0:T(8,128)(2,1)} copy(%param.1)
  %start = (bf16[2,4096]{1,0:T(2,128)(2,1)}, bf16[2,4096]{1,0:T(2,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%param.2)
  %many = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[8]{0:S(1)}) fusion(%param.2), kind=kLoop, calls=%fused_computation
  %loop = (f32[8]{0:S(1)}) while(%many), condition=%fused_computation, body=%fused_computation
  %slice.1 = bf16[2,4096]{1,0:T(2,128)(2,1)S(1)} slice(%copy.1), slice={[0:2], [0:4096]}
  ROOT %tuple.1 = (bf16[2,1024]{1,0:T(2,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}) tuple(%fusion.1, %copy.2)
}
"""
    weight, row = 1024 * 4096 * 2, 2 * 4096 * 2
    # copy.1's write + fusion.1's read of it; the prefetch's VMEM half (not its HBM source nor
    # its S(2) flag); the multi-output fusion's VMEM output (past a tuple's index comment); not
    # the loop's operand (XLA counts a loop's body, not its operands), nor the slice (XLA counts
    # only the part it reads), nor anything inside a called computation (not top level).
    assert vmem_access_bytes(hlo) == 2 * weight + row + 8 * 4
    assert vmem_access_bytes("HloModule empty") == 0


def test_a_weight_prefetched_into_vmem_counts_once(tpu_chip):
    """The real compiler's count: a [2, 4096] x [4096, 1024] product on a v5e chip prefetches the
    8 MiB weight into VMEM (copy-start / copy-done) and dots from there, and the cost analysis
    counts it about five times over; the HBM bytes are the weight, the input and the output once."""
    import jax
    import jax.numpy as jnp

    from jaxserve.plan import BYTES_OPTIONS, bytes_accessed, hbm_bytes_accessed

    chip = tpu_chip("v5e:2x2")
    replicated = jax.sharding.NamedSharding(chip.mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=replicated)
    with jax.sharding.use_abstract_mesh(chip.mesh.abstract_mesh):
        compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile(compiler_options=BYTES_OPTIONS)
    assert "S(1)" in compiled.as_text()  # the premise: the weight is staged in VMEM
    once = (2 * 4096 + 4096 * 1024 + 2 * 1024) * 2
    assert bytes_accessed(compiled) > 3 * once
    assert hbm_bytes_accessed(compiled) == pytest.approx(once, rel=0.01)


def test_experts_split_whole_read_their_floor(tpu_chip):
    """Qwen3-30B-A3B's layers (4 of them, a small vocabulary) at TP 8 on v6e: the 128 experts are
    split whole, 16 per chip (expert parallelism), and a decode step reads its weights once. Split
    by their width instead, each chip's 96 of 768 columns are no whole TPU lane tile (128) and
    XLA:TPU's ragged dot copied the gate and up kernels every step: 0.55-0.57 of the floor at 1-8
    rows for the whole model (benchmarks/RESULTS.md). With --quantization int8 the experts' int8
    values are read as they are: about half the bytes, still at the floor."""
    from jaxserve.models.config import decoder_config_from_hf
    from jaxserve.parallel import ShardingPlan
    from jaxserve.plan import floor_ratio, plan, topology_mesh

    tpu_chip("v6e:2x4")
    cfg = decoder_config_from_hf(dict(_presets().PRESETS["qwen3-30b-a3b"], num_hidden_layers=4, vocab_size=4096))
    assert ShardingPlan(topology_mesh("v6e:2x4", 8), cfg).rules == {
        "heads": "model", "kv_heads": None, "mlp": "model", "vocab": "model", "experts": "model",
        "expert_mlp": None, "shared_mlp": "model"}
    steps = {}
    for q in ("none", "int8"):  # int8: the ragged dot reads the experts' int8 values as they are
        p = plan(cfg, topology="v6e:2x4", tensor_parallel_size=8, max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=512, max_prefill_seqs=4, num_pages=512, serving_compile=False,
                 decode_buckets=(8,), kinds=("decode",), quantization=q)
        assert p.error is None, p.error
        (step,) = steps[q] = p.steps
        # The routing's own traffic (the sorted rows, float32 products, the scatter back: ~10 MB a
        # layer at 8 rows) weighs twice as much beside int8 experts; a dequantized copy of the
        # experts would read 2-3x their bytes. (The whole model: 0.93 of floor at 8 rows.)
        low = 0.9 if q == "none" else 0.85
        assert low <= floor_ratio(step) <= 1.05, (q, step.floor_bytes, step.bytes_accessed, step.sampler_bytes)
    model = lambda s: s.bytes_accessed - s.sampler_bytes  # noqa: E731
    assert 0.45 <= model(steps["int8"][0]) / model(steps["none"][0]) <= 0.6
