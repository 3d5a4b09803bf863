"""End to end: python -m benchmarks.serving against a live jaxserve (a few short requests)."""

from __future__ import annotations

import json

import pytest

from benchmarks import serving

pytestmark = pytest.mark.slow


@pytest.fixture
def shared_tokenizer_cache(cache_dir, smollm2_tokenizer, monkeypatch):
    # The tool loads the tokenizer from jaxserve's cache directory: point it at this test run's,
    # where the smollm2_tokenizer fixture already converted the GGUF tokenizer.
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(cache_dir))


def test_completions_sweep_report_and_plots(live_jaxserve, shared_tokenizer_cache, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code = serving.main(["--base-url", live_jaxserve.url, "--backend", "openai", "--input-len", "12",
                         "--output-len", "6", "--num-prompts", "3", "--concurrency-sweep", "1,2",
                         "--result-json", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path),
                         "--label", "live", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Successful requests:" in out and "| concurrency |" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == "smollm2" and [r["max_concurrency"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["length_mismatches"]) == (3, 0, 0)
        # Token-exact prompts (the server's own count) and exact output lengths (ignore_eos).
        assert m["total_input_tokens"] == 3 * 12 and m["total_output_tokens"] == 3 * 6
        assert run["output_tokens_source"] == ["usage"]
        assert 0 < m["ttft_ms"]["median"] < m["e2el_ms"]["median"]
        assert m["tpot_ms"]["count"] == 3 and m["output_throughput"] > 0
    assert report["runs"][1]["metrics"]["max_concurrent_requests"] == 2
    assert (tmp_path / "live_latency_cdf.png").exists() and (tmp_path / "live_sweep.png").exists()


def test_sglang_generate_backend(live_jaxserve, shared_tokenizer_cache, tmp_path, capsys):
    code = serving.main(["--base-url", live_jaxserve.url, "--backend", "sglang", "--input-len", "8",
                         "--output-len", "4", "--num-prompts", "2", "--num-warmups", "0",
                         "--result-json", str(tmp_path / "g.json"), "--save-detailed", "--disable-tqdm"])
    assert code == 0, capsys.readouterr().out
    run = json.loads((tmp_path / "g.json").read_text())["runs"][0]
    assert run["metrics"]["total_output_tokens"] == 8 and run["metrics"]["total_input_tokens"] == 16
    assert all(r["generated_text"] for r in run["requests"])


def test_a_wrong_endpoint_fails_at_the_warm_up(live_jaxserve, shared_tokenizer_cache, capsys):
    code = serving.main(["--base-url", live_jaxserve.url, "--endpoint", "/v1/nothing", "--num-prompts", "1",
                         "--input-len", "4", "--output-len", "2", "--disable-tqdm"])
    assert code == 1
    err = capsys.readouterr().err
    assert "warm-up request 1" in err and "HTTP 404" in err and "--endpoint" in err
