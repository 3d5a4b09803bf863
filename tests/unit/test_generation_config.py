"""The model's sampling defaults from generation_config.json (jaxserve.generation_config), read
as vLLM reads them."""

from __future__ import annotations

import json

import pytest

from jaxserve.generation_config import for_server, sampling_defaults


def _model(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    (tmp_path / "model.gguf").write_bytes(b"")
    return str(tmp_path)


def test_auto_reads_the_keys_that_differ_from_hf_defaults(tmp_path):
    # Qwen2.5-Instruct's file; top_k 50 and temperature 1.0 are HF's defaults, which vLLM skips.
    model = _model(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                              "repetition_penalty": 1.05, "max_new_tokens": 2048})
    assert sampling_defaults(model) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                        "max_tokens": 2048}
    assert sampling_defaults(str(tmp_path / "model.gguf")) == sampling_defaults(model)  # beside a GGUF file too
    assert sampling_defaults(_model(tmp_path, {"temperature": 1.0, "top_k": 50})) == {}
    assert sampling_defaults(model, "vllm") == {}


def test_overrides_and_a_folder_of_its_own(tmp_path):
    model = _model(tmp_path, {"temperature": 0.6})
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.05}))
    assert sampling_defaults(model, str(other)) == {"min_p": 0.05}
    assert sampling_defaults(model, overrides={"temperature": 0.2, "top_k": 5}) == {"temperature": 0.2, "top_k": 5}
    assert sampling_defaults(model, "vllm", {"top_p": 0.9}) == {"top_p": 0.9}
    (tmp_path / "bare").mkdir()
    assert sampling_defaults(tmp_path / "bare") == {}  # no file: no defaults


@pytest.mark.parametrize("mode, config, overrides, message", [
    ("auto", {"temperature": -1}, None, "temperature -1 is not a value it can take"),
    ("auto", {"top_k": 2.5}, None, "top_k 2.5"),
    ("auto", {"top_p": 0}, None, "top_p 0"),
    ("auto", {}, {"temp": 1}, "unknown key 'temp'"),
    ("auto", {}, {"max_new_tokens": 0}, "max_new_tokens 0"),
    ("/no/such/folder", {}, None, "--generation-config /no/such/folder: no generation_config.json there"),
])
def test_bad_values_are_refused_naming_them(tmp_path, mode, config, overrides, message):
    model = _model(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        sampling_defaults(model, mode, overrides)


def test_a_server_defers_a_broken_file_that_auto_found(tmp_path):
    """The task is not known when the flags are read; only a generation model reads the file."""
    model = _model(tmp_path, {})
    (tmp_path / "generation_config.json").write_text("{not json")
    defaults, error = for_server(model)
    assert defaults == {} and "generation_config.json: not valid JSON" in error
    assert for_server(model, overrides={"top_k": 3})[0] == {}  # the file's error wins: the overrides wait with it
    with pytest.raises(ValueError, match="unknown key 'temp'"):
        for_server(model, overrides={"temp": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        for_server(model, str(tmp_path))  # named by the user: refused now
    assert for_server(_model(tmp_path, {"top_p": 0.5})) == ({"top_p": 0.5}, None)
