"""The CPU comparison driver's pure parts: flags, the servers' and the client's command lines, the
summary from fake reports, and memory from a fake /proc. No server is started: the real run is
`bash benchmarks/compare_cpu.sh`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks import compare_cpu
from benchmarks.serving_metrics import RequestResult, calculate_metrics


@pytest.fixture
def gguf(tmp_path: Path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


@pytest.fixture
def peer(tmp_path: Path) -> str:
    """A stand-in llama-server binary: parse_args only checks that it is executable."""
    path = tmp_path / "llama-server"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def parse(gguf: str, peer: str, *argv: str):
    return compare_cpu.parse_args(["--model", gguf, "--llama-server", peer, *argv])


# ---- flags --------------------------------------------------------------------------------------
def test_defaults(gguf, peer):
    args = parse(gguf, peer)
    assert args.concurrency == [1, 16] and args.rounds == 2
    assert (args.llama_parallel, args.llama_ctx_size, args.llama_threads) == (16, 8192, 2)
    assert args.jaxserve_args == [""] and args.skip == []


@pytest.mark.parametrize("argv, message", [
    (["--input-len", "0"], "--input-len must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--warmups", "-1"], "--warmups must be >= 0"),
    (["--concurrency", "1,x"], "comma-separated integers"),
    # 8192 / 16 = 512 tokens per slot: 400 + 200 does not fit one.
    (["--input-len", "400", "--output-len", "200"], "do not fit a llama-server slot: -c 8192 / -np 16 = 512"),
])
def test_bad_arguments(gguf, peer, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(gguf, peer, *argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_model_and_missing_peer(gguf, tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_cpu.parse_args(["--model", "/nonexistent.gguf", "--skip", "llama-server"])
    assert "must be a .gguf file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_cpu.parse_args(["--model", gguf, "--llama-server", str(tmp_path / "absent")])
    assert "compare_cpu.sh" in capsys.readouterr().err
    # Left out, the peer need not exist, nor need the lengths fit its slots.
    args = compare_cpu.parse_args(["--model", gguf, "--llama-server", str(tmp_path / "absent"), "--skip",
                                   "llama-server", "--input-len", "1000"])
    assert [s.name for s in compare_cpu.systems(args)] == ["jaxserve"]


def test_help_explains_every_flag():
    for action in compare_cpu.build_parser()._actions:
        assert action.help


# ---- command lines ------------------------------------------------------------------------------
def test_server_commands(gguf, peer):
    args = parse(gguf, peer, "--jaxserve-args", "--dtype bfloat16", "--jaxserve-args",
                 "--quantization int8 --dtype bfloat16", "--llama-parallel", "8", "--llama-threads", "4",
                 "--llama-server-args", "-fa on")
    bf16, int8, llama = compare_cpu.systems(args)
    assert (bf16.name, int8.name, llama.name) == ("jaxserve --dtype bfloat16",
                                                  "jaxserve --quantization int8 --dtype bfloat16", "llama-server")
    assert int8.slug == "jaxserve-quantization-int8-dtype-bfloat16"
    assert int8.command(8123) == [sys.executable, "-m", "jaxserve", "--model", gguf, "--host", "127.0.0.1",
                                  "--port", "8123", "--max-num-seqs", "8", "--quantization", "int8",
                                  "--dtype", "bfloat16"]
    assert bf16.command(1)[-2:] == ["--dtype", "bfloat16"]
    assert bf16.env == {"JAX_PLATFORMS": "cpu"} and llama.env == {}
    assert llama.command(8124) == [peer, "-m", gguf, "-c", "8192", "-np", "8", "-t", "4", "--host", "127.0.0.1",
                                   "--port", "8124", "-fa", "on"]
    assert llama.ready_path == bf16.ready_path == "/health"


def test_default_jaxserve_is_plain(gguf, peer):
    jax, llama = compare_cpu.systems(parse(gguf, peer))
    assert jax.name == "jaxserve" and jax.command(5)[-2:] == ["--max-num-seqs", "16"]
    assert llama.name == "llama-server"


def test_same_workload_for_every_system(gguf, peer, tmp_path):
    args = parse(gguf, peer, "--input-len", "32", "--output-len", "16", "--concurrency", "1,4", "--seed", "7")
    cmds = [compare_cpu.serving_command(args, s.name, "http://127.0.0.1:1", tmp_path / "r.json")
            for s in compare_cpu.systems(args)]
    label_at = cmds[0].index("--label") + 1
    assert [c[label_at] for c in cmds] == ["jaxserve", "llama-server"]
    assert cmds[0][:label_at] + cmds[0][label_at + 1:] == cmds[1][:label_at] + cmds[1][label_at + 1:]
    flags = " ".join(cmds[0])
    for part in ("-m benchmarks.serving", "--backend openai", "--prompt-format token-ids", "--ignore-eos",
                 "--input-len 32", "--output-len 16", "--concurrency-sweep 1,4", "--num-prompts-per-concurrency 4",
                 "--num-warmups 2", "--seed 7", f"--tokenizer {gguf}"):
        assert part in flags


# ---- summary ------------------------------------------------------------------------------------
def report(label: str, per_concurrency: dict[int, tuple[float, float]]) -> dict:
    """A serving report whose run at concurrency c streamed 4 tokens with ITL itl_s and TTFT ttft_s."""
    runs = []
    for c, (ttft, itl) in per_concurrency.items():
        results = [RequestResult(prompt_len=8, expected_output_len=4, success=True, output_tokens=4, ttft=ttft,
                                 itl=[itl] * 3, latency=ttft + 3 * itl) for _ in range(c)]
        runs.append({"label": f"{label} c={c}", "max_concurrency": c,
                     "metrics": calculate_metrics(results, duration_s=1.0).to_dict()})
    return {"label": label, "runs": runs}


def measured(label: str, per_concurrency: dict[int, tuple[float, float]], rss: float) -> dict:
    return {"report": report(label, per_concurrency), "memory": {"rss_mib": rss, "peak_rss_mib": rss + 100},
            "ready_s": 3.0}


def two_rounds() -> list[dict]:
    rows = []
    for n, slow in ((1, 1.0), (2, 2.0)):
        rows += compare_cpu.rows_of("jaxserve", n, measured("jaxserve", {1: (0.1, 0.02 * slow), 16: (0.5, 0.05)},
                                                            500.0 * slow))
        rows += compare_cpu.rows_of("llama-server", n, measured("llama-server", {1: (0.05, 0.015), 16: (2.0, 0.01)},
                                                                300.0))
    return rows


def test_rows_and_medians():
    rows = two_rounds()
    assert len(rows) == 8
    jax16 = next(r for r in rows if r["system"] == "jaxserve" and r["concurrency"] == 16 and r["round"] == 1)
    # 16 requests x 4 tokens in 1 s; ITL 50 ms.
    assert jax16["output_tok_s"] == pytest.approx(64.0) and jax16["itl_median_ms"] == pytest.approx(50.0)
    assert (jax16["rss_mib"], jax16["peak_rss_mib"]) == (500.0, 600.0)
    medians = compare_cpu.median_rows(rows)
    assert len(medians) == 4 and {r["round"] for r in medians} == {"median"}
    jax1 = next(r for r in medians if r["system"] == "jaxserve" and r["concurrency"] == 1)
    assert jax1["itl_median_ms"] == pytest.approx(30.0)  # rounds at 20 and 40 ms
    assert jax1["rss_mib"] == pytest.approx(750.0) and jax1["requests"] == 2 and jax1["failed"] == 0


def test_markdown_table():
    rows = two_rounds()
    table = compare_cpu.markdown_table(rows + compare_cpu.median_rows(rows)).splitlines()
    assert table[0] == ("| system | round | concurrency | requests (failed) | output tok/s | TPOT median (ms) "
                        "| ITL median (ms) | TTFT median (ms) | RSS steady / peak (MiB) |")
    assert len(table) == 2 + 12
    # Concurrency first, systems in the order run, the median after the rounds.
    assert [line.split(" | ")[:3] for line in table[2:5]] == [["| jaxserve", "1", "1"], ["| jaxserve", "2", "1"],
                                                             ["| jaxserve", "median", "1"]]
    assert table[4] == "| jaxserve | median | 1 | 2 (0) | 4.0 | 30.0 | 30.0 | 100 | 750 / 850 |"
    assert table[5].startswith("| llama-server | 1 | 1 |")
    assert table[8].startswith("| jaxserve | 1 | 16 | 16 (0) | 64.0 |")


def test_goals_and_summary_markdown():
    rows = two_rounds()
    goals = compare_cpu.goal_lines(compare_cpu.median_rows(rows))
    assert goals[0] == "- every request generated exactly --output-len tokens"
    # 16 requests x 4 tokens / 1 s each: 1.00x, short of 2x; ITL 30 ms vs 15 ms: 2.00x, over.
    assert goals[1] == "- jaxserve: output tok/s at concurrency 16 >= 2x llama-server: 64.0 vs 64.0 = 1.00x (not met)"
    assert goals[2] == "- jaxserve: batch-1 ITL <= llama-server's: 30.0 ms vs 15.0 ms = 2.00x (not met)"
    md = compare_cpu.summary_markdown("HEAD", rows, 2)
    assert md.startswith("HEAD\n\nMedian of 2 round(s):\n\n| system |")
    assert "Every round:" in md and md.rstrip().endswith("2.00x (not met)")


def test_goals_need_both_systems():
    rows = compare_cpu.rows_of("jaxserve", 1, measured("jaxserve", {1: (0.1, 0.02)}, 1.0))
    assert compare_cpu.goal_lines(compare_cpu.median_rows(rows)) == [
        "- every request generated exactly --output-len tokens"]


# ---- memory -------------------------------------------------------------------------------------
STATUS = """Name:\tllama-server
State:\tS (sleeping)
Pid:\t{pid}
PPid:\t{ppid}
VmPeak:\t 1034340 kB
VmHWM:\t  {hwm} kB
VmRSS:\t  {rss} kB
Threads:\t26
"""


def test_parse_status_kib():
    assert compare_cpu.parse_status_kib(STATUS.format(pid=5, ppid=1, hwm=320340, rss=300000)) == {
        "VmHWM": 320340, "VmRSS": 300000}
    assert compare_cpu.parse_status_kib("Name:\tkthreadd\nState:\tS (sleeping)\n") == {}


def fake_proc(root: Path, procs: dict[int, tuple[int, int, int]]) -> Path:
    """pid -> (ppid, VmRSS KiB, VmHWM KiB) as /proc/PID/stat and status files."""
    for pid, (ppid, rss, hwm) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        # A command name with a space and a ')' that naive splitting would misread.
        (d / "stat").write_text(f"{pid} (odd) name) S {ppid} {pid} {pid} 0 -1\n")
        (d / "status").write_text(STATUS.format(pid=pid, ppid=ppid, hwm=hwm, rss=rss))
    (root / "self").mkdir()
    return root


def test_tree_memory_sums_the_server_and_its_descendants(tmp_path):
    proc = fake_proc(tmp_path / "proc", {100: (1, 1024, 2048), 101: (100, 512, 1024), 102: (101, 512, 512),
                                         200: (1, 99999, 99999)})
    assert compare_cpu.process_tree(100, proc) == [100, 101, 102]
    assert compare_cpu.tree_memory(100, proc) == {"rss_mib": 2.0, "peak_rss_mib": 3.5, "processes": 3}


def test_tree_memory_of_this_process():
    mem = compare_cpu.tree_memory(os.getpid())
    assert 0 < mem["rss_mib"] <= mem["peak_rss_mib"] and mem["processes"] >= 1
