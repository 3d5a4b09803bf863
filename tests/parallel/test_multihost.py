"""Multi-host serving on one machine: two `python -m jaxserve` processes with 4 virtual CPU devices
each join one jax.distributed job (CPU collectives over gloo), form one 8-device mesh, and serve
completions through process 0's HTTP port. Greedy output equals a single-process run, and stopping
process 0 stops process 1 too."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tiny_models import make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["w5 w9 w13 w40 w77", "w100 w3", "w8 w8 w8 w21 w34 w55 w89 w144 w233"]
MAX_TOKENS = 8
ENGINE_FLAGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                "--max-prefill-seqs", "2", "--max-model-len", "64", "--num-pages", "48",
                # one step shape of each kind: two processes compile every program, and the grid is not
                # what is under test here
                "--decode-buckets", "4", "--prefill-buckets", "32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(text: str) -> list[int]:
    return [int(w) for w in re.findall(r"w(\d+)", text)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("multihost") / "llama3"
    make_tiny_model("llama3", directory)
    save_tiny_tokenizer(directory)
    return directory


def _reference(model_dir: Path) -> list[list[int]]:
    import jaxserve

    llm = jaxserve.LLM(str(model_dir), dtype="float32", max_model_len=64, num_pages=48, max_num_seqs=4,
                       max_num_batched_tokens=32, max_prefill_seqs=2, cache_dir=model_dir.parent / "ref-cache")
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt_ids = [llm.tokenizer.encode_prompt(p) for p in PROMPTS]  # as the server tokenizes raw prompts
    outputs = llm.generate(prompt_ids, params)
    return [o.outputs[0].token_ids for o in outputs]


def test_two_processes_serve_as_one_mesh(model_dir: Path, tmp_path: Path):
    coordinator, http = _free_port(), _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for pid in (0, 1):
        log = open(tmp_path / f"process{pid}.log", "w")
        logs.append(log)
        cmd = [sys.executable, "-m", "jaxserve", "--model", str(model_dir), *ENGINE_FLAGS,
               "--tensor-parallel-size", "8", "--coordinator-address", f"127.0.0.1:{coordinator}",
               "--num-processes", "2", "--process-id", str(pid), "--port", str(http),
               "--cache-dir", str(tmp_path / f"cache{pid}")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    def log_tail(pid: int) -> str:
        return (tmp_path / f"process{pid}.log").read_text()[-3000:]

    try:
        base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 600
        while True:
            for pid, p in enumerate(procs):
                assert p.poll() is None, f"process {pid} exited with {p.returncode}:\n{log_tail(pid)}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready in time:\n{log_tail(0)}\n{log_tail(1)}"
            time.sleep(1)

        # One mesh over both processes' devices, weights and cache split over all eight.
        assert "tensor parallel over 8 devices" in log_tail(0) or "8 devices" in (tmp_path / "process0.log").read_text()
        assert "process 1 of 2, 4 local / 8 global devices" in (tmp_path / "process1.log").read_text()
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        got = []
        for prompt in PROMPTS:  # one after another, then together (a batched step across both hosts)
            r = client.completions.create(model="llama3", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                          extra_body={"ignore_eos": True})
            got.append(_ids(r.choices[0].text))
        r = client.completions.create(model="llama3", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        together = [_ids(c.text) for c in sorted(r.choices, key=lambda c: c.index)]
    except Exception as e:
        raise AssertionError(f"{e}\nprocess 0:\n{log_tail(0)}\nprocess 1:\n{log_tail(1)}") from e
    finally:
        procs[0].send_signal(signal.SIGINT)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=120))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append("hung")
        for log in logs:
            log.close()

    # Both processes end cleanly once process 0 is stopped.
    assert codes == [0, 0], f"exit codes {codes}:\n{log_tail(0)}\n{log_tail(1)}"
    assert "process 0 stopped after" in (tmp_path / "process1.log").read_text()
    expected = _reference(model_dir)
    assert got == expected
    assert together == expected
