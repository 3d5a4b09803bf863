"""Argument validation, run planning, server probing and the report/plot outputs (no server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket

import httpx
import pytest

from benchmarks import serving
from benchmarks.serving_metrics import RequestResult, calculate_metrics


def error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        serving.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_defaults():
    args = serving.parse_args([])
    assert (args.backend, args.base_url, args.dataset) == ("openai", "http://127.0.0.1:8000", "random")
    assert (args.input_len, args.output_len, args.num_prompts) == (128, 128, 100)
    assert math.isinf(args.request_rate) and args.max_concurrency is None
    assert args.ignore_eos and args.percentiles == [50.0, 90.0, 99.0] and args.num_warmups == 1
    assert serving.plan_runs(args) == [(None, 100)]


def test_sweeps_and_their_prompt_counts():
    args = serving.parse_args(["--concurrency-sweep", "1,4,16", "--num-prompts", "8"])
    assert serving.plan_runs(args) == [(1, 8), (4, 8), (16, 8)]
    args = serving.parse_args(["--concurrency-sweep", "1,4", "--num-prompts-per-concurrency", "3"])
    assert serving.plan_runs(args) == [(1, 3), (4, 12)]
    args = serving.parse_args(["--max-concurrency", "2", "--num-prompts", "5"])
    assert serving.plan_runs(args) == [(2, 5)]


def test_parsed_values():
    args = serving.parse_args(["--base-url", "http://h:1/", "--goodput", "ttft:500", "tpot:50",
                               "--percentiles", "50,99.9", "--extra-body", '{"top_k": 1}', "--request-rate", "2.5",
                               "--no-ignore-eos"])
    assert args.base_url == "http://h:1"
    assert args.goodput == [("ttft", 500.0), ("tpot", 50.0)]
    assert args.percentiles == [50.0, 99.9] and args.extra_body == {"top_k": 1}
    assert args.request_rate == 2.5 and not args.ignore_eos


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--num-prompts", "x"], "--num-prompts must be an integer"),
    (["--input-len", "-3"], "--input-len must be >= 1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--range-ratio", "1.0"], "--range-ratio must be in [0, 1)"),
    (["--request-rate", "0"], "--request-rate must be a positive number or inf"),
    (["--request-rate", "nan"], "--request-rate must be a positive number"),
    (["--burstiness", "inf"], "--burstiness must be a positive number"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--concurrency-sweep", "1,x"], "comma-separated integers"),
    (["--concurrency-sweep", "0,4"], "positive integers"),
    (["--concurrency-sweep", "4,4"], "duplicate"),
    (["--max-concurrency", "4", "--concurrency-sweep", "1,4"], "not both"),
    (["--num-prompts-per-concurrency", "2"], "only applies to --concurrency-sweep"),
    (["--percentiles", "0,50"], "(0, 100]"),
    (["--percentiles", "p99"], "comma-separated numbers"),
    (["--goodput", "latency:5"], "METRIC:MS"),
    (["--goodput", "ttft:-5"], "must be positive"),
    (["--goodput", "ttft:5", "ttft:6"], "each metric at most once"),
    (["--extra-body", "{bad"], "not valid JSON"),
    (["--extra-body", "[1]"], "a JSON object"),
    (["--base-url", "localhost:8000"], "must start with http://"),
    (["--endpoint", "v1/completions"], "starting with '/'"),
    (["--dataset", "jsonl"], "needs --dataset-path"),
    (["--dataset-path", "x.jsonl"], "only read with --dataset jsonl"),
    (["--dataset", "jsonl", "--dataset-path", "/nonexistent.jsonl"], "is not a file"),
    (["--backend", "openai-chat", "--prompt-format", "token-ids"], "text prompts only"),
    (["--backend", "tgi"], "invalid choice"),
    (["--tokenizer", "/nonexistent/tok"], "does not exist"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
    (["--wait-for-server", "-1"], "--wait-for-server must be >= 0"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    assert message in error_of(argv, capsys)


def test_help_explains_every_flag():
    parser = serving.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error(capsys):
    code = serving.main(["--base-url", f"http://127.0.0.1:{_closed_port()}", "--disable-tqdm"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the server at http://127.0.0.1:")
    assert "is it running?" in err and "--wait-for-server" in err


def probe(argv: list[str], handler) -> str | None:
    args = serving.parse_args(argv)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serving.probe_server(client, args)

    return asyncio.run(go())


def test_probe_finds_the_model_name():
    seen = []

    def handler(request):
        seen.append(request.url.path)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "SmolLM2", "object": "model"}]})

    assert probe([], handler) == "SmolLM2" and seen == ["/v1/models"]
    assert probe(["--model", "mine"], handler) == "mine"


def test_probe_for_sglang_checks_health():
    seen = []

    def handler(request):
        seen.append(request.url.path)
        return httpx.Response(200)

    assert probe(["--backend", "sglang"], handler) is None and seen == ["/health"]


def test_probe_waits_while_the_server_loads():
    answers = iter([httpx.ConnectError("refused"), 503, 200])

    def handler(request):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"data": [{"id": "m"}]})

    assert probe(["--wait-for-server", "10"], handler) == "m"


@pytest.mark.parametrize("status, message", [(401, "--api-key"), (404, "pass --model"), (503, "HTTP 503")])
def test_probe_errors(status, message):
    with pytest.raises(serving.BenchmarkError, match=message):
        probe([], lambda request: httpx.Response(status, text="no"))


def test_probe_with_a_model_given_only_needs_an_answer():
    assert probe(["--model", "m"], lambda request: httpx.Response(404)) == "m"
    assert probe(["--backend", "sglang"], lambda request: httpx.Response(404)) is None
    with pytest.raises(serving.BenchmarkError, match="not ready"):
        probe(["--model", "m"], lambda request: httpx.Response(503))


def test_probe_with_an_empty_model_list():
    with pytest.raises(serving.BenchmarkError, match="listed no model"):
        probe([], lambda request: httpx.Response(200, json={"data": []}))


def _report(api_key: str | None = None) -> dict:
    args = serving.parse_args(["--concurrency-sweep", "1,2"] + (["--api-key", api_key] if api_key else []))
    runs = []
    for c in (1, 2):
        results = [RequestResult(prompt_len=4, expected_output_len=3, success=True, output_tokens=3, ttft=0.1 * c,
                                 itl=[0.02, 0.03], latency=0.1 * c + 0.05, generated_text="abc"),
                   RequestResult(prompt_len=4, expected_output_len=3, error="HTTP 500: boom", latency=0.01)]
        metrics = calculate_metrics(results, 1.0)
        runs.append({"label": f"s c={c}", "max_concurrency": c, "metrics": metrics.to_dict(),
                     "requests": [serving.request_record(r, True) for r in results]})
    return {"label": "s", "config": serving._jsonable(vars(args) | {"api_key": "<set>" if api_key else None}),
            "runs": runs}


def test_json_report_drops_details_unless_asked(tmp_path):
    report = _report()
    serving.write_json(report, tmp_path / "a.json", detailed=False)
    serving.write_json(report, tmp_path / "b.json", detailed=True)
    plain = json.loads((tmp_path / "a.json").read_text())
    detailed = json.loads((tmp_path / "b.json").read_text())
    assert "itl" not in plain["runs"][0]["requests"][0] and "generated_text" not in plain["runs"][0]["requests"][0]
    assert detailed["runs"][0]["requests"][0]["itl"] == [0.02, 0.03]
    assert plain["runs"][0]["requests"][1]["error"] == "HTTP 500: boom"
    assert plain["runs"][0]["metrics"]["failures"] == [{"index": 1, "error": "HTTP 500: boom"}]
    assert plain["config"]["request_rate"] == "inf"


def test_the_api_key_is_not_written(tmp_path):
    serving.write_json(_report(api_key="sk-secret"), tmp_path / "r.json", detailed=True)
    assert "sk-secret" not in (tmp_path / "r.json").read_text()


def test_sweep_table_has_a_row_per_run():
    table = serving.sweep_table(_report()).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| 1 | 2 | 1 |") and table[3].startswith("| 2 | 2 | 1 |")


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.serving_plots import main as plots_main
    from benchmarks.serving_plots import plot_report

    report = _report()
    paths = plot_report(report, tmp_path)
    assert [p.name for p in paths] == ["s_latency_cdf.png", "s_sweep.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert plots_main([str(tmp_path / "r.json"), str(tmp_path / "r.json"), "--out-dir", str(tmp_path / "cmp")]) == 0
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["comparison_latency_cdf.png",
                                                                    "comparison_sweep.png"]


def test_namespace_is_jsonable():
    assert serving._jsonable(argparse.Namespace(a=1).__dict__ | {"r": math.inf}) == {"a": 1, "r": "inf"}
