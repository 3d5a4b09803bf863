"""The command line: every flag documented, YAML --config with rejection of unknown keys,
CLI-over-YAML precedence, clear refusals, and a real start-up on a tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.cli import ConfigError, build_parser, config_from_args, default_model, parse_args
from tiny_models import make_tiny_model

REQUIRED_FLAGS = ["--model", "--host", "--port", "--served-model-name", "--max-model-len", "--dtype",
                  "--tensor-parallel-size", "--api-key", "--config"]


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "jaxserve", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in REQUIRED_FLAGS:
        assert flag in out
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_yaml_config_and_cli_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nport: 9000\nmax-model-len: 512\napi_key: secret\ndtype: bfloat16\n")
    args = parse_args(["--config", str(cfg), "--port", "9001"])
    config = config_from_args(args)
    assert config.server.port == 9001  # the command line wins
    assert config.model.max_model_len == 512 and config.model.dtype == "bfloat16"
    assert config.server.api_keys == ("secret",)
    assert config.model.served_model_name == "m"


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("modle: /m\n", "unknown key 'modle'"),
        ("port: eighty\n", "port"),
        ("dtype: float64\n", "dtype must be one of"),
        ("- a\n- b\n", "expected a mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_yaml_is_refused(tmp_path, capsys, yaml_text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
    assert message in capsys.readouterr().err


def test_unimplemented_parallelism_is_refused():
    with pytest.raises(ConfigError, match="tensor parallelism is not implemented"):
        config_from_args(parse_args(["--model", "/m", "--tensor-parallel-size", "2"]))


def test_default_model_is_the_packaged_smollm2():
    assert default_model().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config_from_args(parse_args([])).model.served_model_name == "SmolLM2-135M-Instruct"


def test_start_up_loads_the_model_and_refuses_to_pretend(tmp_path):
    make_tiny_model("qwen3", tmp_path / "tiny")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2").save_pretrained(tmp_path / "tiny")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--model", str(tmp_path / "tiny"), "--cache-dir", str(tmp_path / "c"),
         "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300,
    )
    assert "Qwen3ForCausalLM" in proc.stderr and "max_model_len 128" in proc.stderr
    assert "HTTP server is not built yet" in proc.stderr
    assert proc.returncode == 3
    too_long = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--model", str(tmp_path / "tiny"), "--max-model-len", "100000",
         "--no-weight-cache"],
        capture_output=True, text=True, timeout=300,
    )
    assert too_long.returncode == 1 and "exceeds the model's max_position_embeddings 256" in too_long.stderr


def test_every_preset_loads_into_the_config():
    from pathlib import Path

    presets = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert presets
    for preset in presets:
        config_from_args(parse_args(["--config", str(preset)]))
