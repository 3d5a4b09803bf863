"""Host time per engine step, and how it grows (or not) with max_model_len.

    python -m benchmarks.host_step [--before PATH] [--batches 1 16 64 256] [--max-model-lens 2048 131072]

Each (batch, max_model_len) runs in a fresh process: a tiny random-weight Llama (2 layers, hidden
64, SmolLM2's 49,152-token vocabulary, so the device's work is small and the host's shows) decodes
`batch` requests of 64 tokens, one step at a time (no overlap, so the device never runs beside the
timed host work). Per steady decode step it reports:

  prepare  scheduling, building the step's inputs and dispatching it: the host's critical path,
           which the device waits for between steps (Engine._dispatch)
  host     everything the step costs the host: prepare, reading the tokens back into the
           sequences, and the text work (detokenizing, stop strings, deltas), minus the time spent
           waiting for the device
  sent     bytes the step sends to the device (host-to-device inputs)

With --before PATH (a checkout of an earlier jaxserve, e.g. `git worktree add /tmp/before <rev>`),
the same runs of that version are interleaved with this one's, so both are measured in one run on
the same machine. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

OUTPUT_LEN = 64
PROMPT_LEN = 16


def _model_dir(work: Path, max_model_len: int) -> Path:
    """config.json + SmolLM2's tokenizer: a tiny Llama whose context allows max_model_len."""
    from jaxserve.cli import default_model

    directory = work / f"tiny-{max_model_len}"
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": max_model_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    gguf = Path(default_model())
    from jaxserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gguf.parent, gguf.name, cache_dir=work / "cache")
    tokenizer.hf.save_pretrained(directory)
    return directory


def worker(batch: int, max_model_len: int, work: Path) -> dict:
    """One measurement, in this process, of whatever jaxserve is on sys.path."""
    import jax
    import numpy as np

    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.engine.request import SamplingParams
    from jaxserve.startup import load

    ready = load(ModelConfig(model=str(_model_dir(work, max_model_len)), served_model_name="tiny", dtype="float32",
                             load_format="dummy", weight_cache=False, cache_dir=work / "cache"))
    pages_per_seq = -(-(PROMPT_LEN + OUTPUT_LEN) // 16)
    cache = CacheConfig(page_size=16, num_pages=batch * pages_per_seq + 8)
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN, max_prefill_seqs=batch,
                            max_model_len=max_model_len, decode_buckets=(batch,),
                            prefill_buckets=(batch * PROMPT_LEN,))
    waits: list[float] = []
    sent: list[int] = []
    try:  # this version: the builder
        from jaxserve.engine import runner as runner_module
        from jaxserve.engine.build import EngineConfig, build_engine

        engine = build_engine(ready.loaded.model, ready.tokenizer, EngineConfig(
            cache=cache, scheduler=sched, overlap=False, check_integrity=False))
        wait_module = runner_module
        execute = engine.runner.execute

        def counted(step):
            sent.append(step.nbytes)
            return execute(step)

        engine.runner.execute = counted
    except ImportError:  # earlier versions: Engine wired itself
        from jaxserve.engine import engine as engine_module
        from jaxserve.engine.engine import Engine, EngineConfig

        engine = Engine(ready.loaded.model, ready.tokenizer, EngineConfig(cache=cache, scheduler=sched, overlap=False))
        engine.compile()
        wait_module = engine_module
        run = engine.runner.run

        def counted(bucket, inputs):
            sent.append(sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(inputs)))
            return run(bucket, inputs)

        engine.runner.run = counted
    to_host = wait_module.to_host

    def timed_to_host(tree):
        start = time.perf_counter()
        out = to_host(tree)
        waits.append(time.perf_counter() - start)
        return out

    wait_module.to_host = timed_to_host
    dispatch = engine._dispatch
    prepare: list[float] = []

    def timed_dispatch():
        start = time.perf_counter()
        dispatch()
        prepare.append(time.perf_counter() - start)

    engine._dispatch = timed_dispatch
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    rng = np.random.default_rng(0)
    for round_ in range(2):  # the first round warms up
        for i in range(batch):
            engine.add_request(f"{round_}-{i}", rng.integers(100, 40000, PROMPT_LEN).tolist(), params)
        rows = []
        while engine.has_unfinished():
            del waits[:], prepare[:], sent[:]
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            rows.append((sum(prepare), wall - sum(waits), sum(sent)))
    steady = rows[4:-4]  # decode steps: past the prefill, before the batch drains
    return {"batch": batch, "max_model_len": max_model_len, "steps": len(steady),
            "prepare_ms": 1e3 * statistics.median(r[0] for r in steady),
            "host_ms": 1e3 * statistics.median(r[1] for r in steady),
            "sent_bytes": int(statistics.median(r[2] for r in steady))}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--max-model-lens", type=int, nargs="+", default=[2048, 131072])
    p.add_argument("--before", default=None, help="a checkout of an earlier jaxserve to measure in the same run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", nargs=3, metavar=("BATCH", "MAX_MODEL_LEN", "WORK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), int(args.worker[1]), Path(args.worker[2]))))
        return
    versions = {"after": str(Path(__file__).resolve().parents[1])}
    if args.before:
        versions = {"before": str(Path(args.before).resolve()), **versions}
    results = []
    with tempfile.TemporaryDirectory() as work:
        for batch in args.batches:
            for max_len in args.max_model_lens:
                for name, root in versions.items():  # interleaved: the machine's drift hits both alike
                    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
                    # This file's worker, on that version's jaxserve.
                    done = subprocess.run([sys.executable, __file__, "--worker", str(batch), str(max_len), work],
                                          env=env, cwd=root, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(f"{name} batch {batch} max_model_len {max_len} failed:\n{done.stderr[-3000:]}")
                        continue
                    row = json.loads(done.stdout.strip().splitlines()[-1]) | {"version": name}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\n{'version':<8} {'batch':>5} {'max_model_len':>13} {'prepare ms':>10} {'host ms':>8} {'sent KiB':>9}")
    for r in results:
        print(f"{r['version']:<8} {r['batch']:>5} {r['max_model_len']:>13} {r['prepare_ms']:>10.2f} "
              f"{r['host_ms']:>8.2f} {r['sent_bytes'] / 1024:>9.1f}")


if __name__ == "__main__":
    main()
