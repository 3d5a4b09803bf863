"""The CPU comparison driver's pure parts: argument checks, the summary table and the goal lines."""

from __future__ import annotations

import pytest

from benchmarks import compare_cpu
from benchmarks.serving_metrics import RequestResult, calculate_metrics


def report(label: str, per_concurrency: dict[int, tuple[float, float]]) -> dict:
    """A serving report whose run at concurrency c streamed 4 tokens with ITL itl_s and TTFT ttft_s."""
    runs = []
    for c, (ttft, itl) in per_concurrency.items():
        results = [RequestResult(prompt_len=8, expected_output_len=4, success=True, output_tokens=4, ttft=ttft,
                                 itl=[itl] * 3, latency=ttft + 3 * itl) for _ in range(c)]
        runs.append({"label": f"{label} c={c}", "max_concurrency": c,
                     "metrics": calculate_metrics(results, duration_s=1.0).to_dict()})
    return {"label": label, "runs": runs}


HF = {"label": "HF transformers", "dtype": "float32",
      "points": [{"concurrency": 1, "output_throughput": 10.0, "request_throughput": 0.1, "ttft_ms": 50.0,
                  "tpot_ms": 20.0, "e2el_ms": 2000.0}]}


def test_summary_table_and_goals():
    rows = compare_cpu.summary_rows([report("jaxserve", {1: (0.1, 0.02), 16: (0.5, 0.05)}),
                                     report("llama.cpp", {1: (0.05, 0.015), 16: (2.0, 0.01)})], HF)
    assert len(rows) == 5
    jax16 = next(r for r in rows if r["system"] == "jaxserve" and r["concurrency"] == 16)
    assert jax16["output_tok_s"] == pytest.approx(64.0) and jax16["itl_median_ms"] == pytest.approx(50.0)
    table = compare_cpu.markdown_table(rows).splitlines()
    assert len(table) == 2 + 5
    assert table[2].startswith("| HF generate, offline (float32; concurrency = batch) | 1 | 1 (0) | 10.0 |")
    goals = compare_cpu.goal_lines(rows)
    assert goals[0] == "- every request generated exactly --output-len tokens"
    # 16 requests x 4 tokens / 1 s each: 1.00x, short of 2x; ITL 20 ms vs 15 ms: within 2x.
    assert goals[1].endswith("= 1.00x (not met)")
    assert goals[2] == "- batch-1 ITL within 2x of llama.cpp: 20.0 ms vs 15.0 ms = 1.33x (met)"


def test_goals_need_both_systems():
    rows = compare_cpu.summary_rows([report("jaxserve", {1: (0.1, 0.02)})], None)
    assert compare_cpu.goal_lines(rows) == ["- every request generated exactly --output-len tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--input-len", "0"], "--input-len must be >= 1"),
    (["--model", "/nonexistent.gguf"], "must be a .gguf file"),
    (["--llamacpp-python", "/nonexistent/python"], "compare_cpu.sh"),
    (["--concurrency", "1,x"], "comma-separated integers"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare_cpu.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag():
    for action in compare_cpu.build_parser()._actions:
        assert action.help
