"""The command line: every flag documented, YAML --config with rejection of unknown keys,
CLI-over-YAML precedence, clear refusals, and a real start-up on a tiny model."""

from __future__ import annotations

import json
import re
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
    # A default is said once, and only where it says something.
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "(default: parse)" in out


def test_model_name_and_prompt_flags(tmp_path):
    args = parse_args(["--model", "/m", "--served-model-name", "smollm2", "llama3", "smollm2",
                       "--accept-any-model-name", "--prompt-special-tokens", "text"])
    m = config_from_args(args).model
    assert m.served_model_names == ("smollm2", "llama3") and m.served_model_name == "smollm2"
    assert m.accept_any_model_name and m.prompt_special_tokens == "text"
    defaults = config_from_args(parse_args(["--model", "/m"])).model
    assert defaults.served_model_names == ("m",) and not defaults.accept_any_model_name
    assert defaults.prompt_special_tokens == "parse"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nserved-model-name: one\n")  # a YAML scalar is one name
    assert config_from_args(parse_args(["--config", str(cfg)])).model.served_model_names == ("one",)


def test_speculative_flags():
    sched = config_from_args(parse_args(["--model", "/m", "--speculative-method", "ngram",
                                         "--num-speculative-tokens", "3", "--max-ngram-size", "2"])).scheduler
    assert (sched.speculative_method, sched.num_speculative_tokens, sched.max_ngram_size) == ("ngram", 3, 2)
    assert config_from_args(parse_args(["--model", "/m"])).scheduler.speculative_method is None
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        config_from_args(parse_args(["--model", "/m", "--speculative-method", "ngram", "--num-speculative-tokens", "0"]))
    with pytest.raises(SystemExit):  # argparse: only the methods built
        parse_args(["--model", "/m", "--speculative-method", "eagle"])
    cfg = config_from_args(parse_args(["--model", "/m", "--speculative-model", "/d", "--num-speculative-tokens", "4"]))
    assert (cfg.scheduler.speculative_method, cfg.scheduler.num_speculative_tokens) == ("draft", 4)
    assert cfg.model.speculative_model == "/d"
    with pytest.raises(ConfigError, match="--speculative-model"):
        config_from_args(parse_args(["--model", "/m", "--speculative-model", "/d", "--speculative-method", "ngram"]))
    with pytest.raises(ConfigError, match="--speculative-model"):
        config_from_args(parse_args(["--model", "/m", "--speculative-method", "draft"]))


def test_lora_flags(tmp_path):
    cfg = tmp_path / "c.yaml"  # YAML: one entry as a scalar, entries as mappings
    cfg.write_text("model: /m\nlora-modules: sql=/a/sql\n")
    assert [s.name for s in config_from_args(parse_args(["--config", str(cfg)])).model.lora_modules] == ["sql"]
    cfg.write_text("model: /m\nlora-modules:\n  - {name: sql, path: /a/sql, base_model_name: m}\n  - poet=/p\n")
    specs = config_from_args(parse_args(["--config", str(cfg)])).model.lora_modules
    assert [(s.name, s.base_model_name) for s in specs] == [("sql", "m"), ("poet", None)]
    m = config_from_args(parse_args(["--model", "/m", "--enable-lora", "--lora-modules", "sql=/a/sql",
                                     '{"name": "poet", "path": "/a/poet"}', "--max-lora-rank", "16"])).model
    assert [(s.name, str(s.path)) for s in m.lora_modules] == [("sql", "/a/sql"), ("poet", "/a/poet")]
    assert m.max_lora_rank == 16 and m.enable_lora and m.max_loras is None
    m = config_from_args(parse_args(["--model", "/m", "--enable-lora", "--max-loras", "4"])).model
    assert m.enable_lora and m.max_loras == 4 and m.lora_modules == () and m.max_cpu_loras is None
    # More adapters than slots take turns in them.
    m = config_from_args(parse_args(["--model", "/m", "--lora-modules", "a=/a", "b=/b", "--max-loras", "1",
                                     "--max-cpu-loras", "3"])).model
    assert (len(m.lora_modules), m.max_loras, m.max_cpu_loras) == (2, 1, 3)
    # SGLang's flags: --lora-paths beside --lora-modules, its names for the counts, the targets.
    m = config_from_args(parse_args(["--model", "/m", "--enable-lora", "--lora-modules", "a=/a", "--lora-paths", "/p",
                                     '{"lora_name": "b", "lora_path": "/b", "pinned": true}', "--max-loras-per-batch",
                                     "2", "--max-loaded-loras", "4", "--lora-target-modules", "all"])).model
    assert [(s.name, s.pinned) for s in m.lora_modules] == [("a", False), ("/p", False), ("b", True)]
    assert (m.max_loras, m.max_cpu_loras, len(m.lora_target_modules)) == (2, 4, 7)
    assert m.lora_eviction_policy == "lru"
    assert config_from_args(parse_args(["--model", "/m", "--enable-lora", "--lora-eviction-policy", "fifo"]
                                       )).model.lora_eviction_policy == "fifo"
    m = config_from_args(parse_args(["--model", "/m", "--lora-modules", "a=/a", "--lora-target-modules", "v_proj",
                                     "q_proj"])).model
    assert m.lora_target_modules == ("q_proj", "v_proj")
    m = config_from_args(parse_args(["--model", "/m", "--enable-lora", "--lora-target-modules", "qkv_proj",
                                     "gate_up_proj"])).model  # Phi-3's fused names: their parts
    assert m.lora_target_modules == ("gate_proj", "k_proj", "q_proj", "up_proj", "v_proj")
    assert config_from_args(parse_args(["--model", "/m"])).model.lora_modules == ()
    for argv, words in ((["--lora-modules", "sql=/a", "sql=/b"], "given twice"),
                        (["--lora-modules", "m=/a"], "already a name of the served model"),
                        (["--lora-modules", "default=/a"], "already a name"),
                        (["--lora-modules", "sql"], "not name=path"),
                        (["--lora-modules", "sql=/a", "--max-lora-rank", "0"], "--max-lora-rank must be >= 1"),
                        (["--max-lora-rank", "8"], "need --lora-modules or --enable-lora"),
                        (["--max-loras", "2"], "need --lora-modules or --enable-lora"),
                        (["--lora-modules", "a=/a", "b=/b", "--max-cpu-loras", "1"], "fewer than the 2 adapter slots"),
                        (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "fewer than the 3 adapter"),
                        (["--max-cpu-loras", "2"], "need --lora-modules or --enable-lora"),
                        (["--lora-paths", '{"lora_name": "a", "lora_path": "/a", "pinned": true}', "b=/b",
                          "--max-loras", "1"], "the adapters not pinned need one"),
                        (["--lora-target-modules", "q_proj"], "need --lora-modules or --enable-lora"),
                        (["--lora-eviction-policy", "fifo"], "only with --lora-modules or --enable-lora"),
                        (["--enable-lora", "--lora-target-modules", "all", "q_proj"], "`all` goes alone"),
                        (["--enable-lora", "--lora-target-modules", "qkv"], "unknown qkv"),
                        (["--lora-modules", "a=/a", "--max-loras", "2"], "without --enable-lora nothing else")):
        with pytest.raises(ConfigError, match=words):
            config_from_args(parse_args(["--model", "/m", *argv]))


def test_bucket_flags(tmp_path):
    sched = config_from_args(parse_args(["--model", "/m", "--max-num-seqs", "32", "--decode-buckets", "4", "32",
                                         "--max-num-batched-tokens", "512", "--prefill-buckets", "512"])).scheduler
    assert (sched.decode_buckets, sched.prefill_buckets) == ((4, 32), (512,))
    default = config_from_args(parse_args(["--model", "/m"])).scheduler
    assert default.decode_buckets is None and default.prefill_buckets is None  # powers of two
    for flags, message in ((["--decode-buckets", "4", "8"], "the largest of --decode-buckets (4, 8) must equal "
                            "--max-num-seqs=16"),
                           (["--decode-buckets", "8", "4", "16"], "--decode-buckets must be strictly increasing"),
                           (["--prefill-buckets", "0", "256"], "--prefill-buckets must be positive integers"),
                           (["--prefill-buckets", "128"], "--max-num-batched-tokens=256")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_args(parse_args(["--model", "/m", *flags]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nmax-num-seqs: 8\ndecode-buckets: [2, 8]\nprefill-buckets: 256\n")
    sched = config_from_args(parse_args(["--config", str(cfg)])).scheduler
    assert (sched.decode_buckets, sched.prefill_buckets) == ((2, 8), (256,))


def test_yaml_config_and_cli_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nport: 9000\nmax-model-len: 512\napi_key: secret\ndtype: bfloat16\n")
    args = parse_args(["--config", str(cfg), "--port", "9001"])
    config = config_from_args(args)
    assert config.server.port == 9001  # the command line wins
    assert config.model.max_model_len == 512 and config.model.dtype == "bfloat16"
    assert config.server.api_keys == ("secret",)
    assert config.model.served_model_name == "m"
    # A JSON flag takes YAML's own mapping, or the JSON text the command line takes.
    cfg.write_text("model: /m\nhf-overrides:\n  rope_theta: 1000.0\nlimit-mm-per-prompt: '{\"image\": 2}'\n")
    args = parse_args(["--config", str(cfg)])
    assert args.hf_overrides == {"rope_theta": 1000.0} and args.limit_mm_per_prompt == {"image": 2}


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("modle: /m\n", "unknown key 'modle'"),
        ("port: eighty\n", "port"),
        ("dtype: float64\n", "dtype must be one of"),
        ("- a\n- b\n", "expected a mapping"),
        ("a: [\n", "not valid YAML"),
        ("distributed: 'false'\n", "distributed must be true or false"),
        ("hf-overrides: '{bad'\n", "hf-overrides: not JSON"),
    ],
)
def test_bad_yaml_is_refused(tmp_path, capsys, yaml_text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
    assert message in capsys.readouterr().err


def test_tensor_parallel_size_beyond_the_devices_is_refused():
    import jax

    have = jax.local_device_count()
    with pytest.raises(ConfigError, match=f"--tensor-parallel-size {have + 1} needs {have + 1} devices, but this "
                       f"host has only {have} "):
        config_from_args(parse_args(["--model", "/m", "--tensor-parallel-size", str(have + 1)]))
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be >= 1, got 0"):
        config_from_args(parse_args(["--model", "/m", "--tensor-parallel-size", "0"]))
    tp = config_from_args(parse_args(["--model", "/m", "--tensor-parallel-size", str(have)])).parallel
    assert tp.tensor_parallel_size == have


@pytest.mark.parametrize("argv, message", [
    (["--cpu-kv-cache-gib", "nan"], "--cpu-kv-cache-gib must be a size > 0 in GiB, got nan"),
    (["--cpu-kv-cache-gib", "0"], "--cpu-kv-cache-gib must be a size > 0 in GiB, got 0.0"),
    (["--request-timeout", "nan"], "--request-timeout must be > 0 seconds, got nan"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0 seconds, got nan"),
    (["--media-fetch-timeout", "nan"], "--media-fetch-timeout must be > 0 seconds, got nan"),
])
def test_sizes_and_timeouts_that_are_no_number_are_refused(argv, message):
    """Refused when parsed (NaN fails every comparison, so `x <= 0` let it through), never after
    the model has loaded, or as a traceback."""
    with pytest.raises(ConfigError, match=message):
        config_from_args(parse_args(["--model", "/m", *argv]))


@pytest.mark.parametrize("key", ["", "  ", " k", "k\n", "clé"])
def test_an_api_key_that_would_open_the_server_is_refused(key, tmp_path):
    """An empty key matched a request with no Authorization at all (`--api-key "$KEY"` with KEY
    unset served everyone), and one with spaces around it could never be sent."""
    with pytest.raises(ConfigError, match=re.escape(f"--api-key must be a non-empty key of printable ASCII without "
                                                    f"surrounding spaces, got {key!r}")):
        config_from_args(parse_args(["--model", "/m", "--api-key", "good", "--api-key", key]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: /m\napi-key: {json.dumps(key)}\n")  # YAML reads JSON's escapes
    with pytest.raises(ConfigError, match="--api-key must be a non-empty key"):
        config_from_args(parse_args(["--config", str(cfg)]))
    assert config_from_args(parse_args(["--model", "/m", "--api-key", "a b"])).server.api_keys == ("a b",)
    from jaxserve.server.base_app import base_app

    with pytest.raises(ValueError, match="an API key must not be empty"):  # whoever builds the app
        base_app(object(), ("k", ""), 1024, healthy=lambda: True)


def test_cors_and_request_id_flags(tmp_path):
    """vLLM's spellings: a JSON list (as vLLM's flag takes it) or plain words, and in --config."""
    srv = config_from_args(parse_args(["--model", "/m"])).server
    assert (srv.allowed_origins, srv.allowed_methods, srv.allowed_credentials, srv.request_id_headers) == (
        ("*",), ("*",), False, False)
    srv = config_from_args(parse_args([
        "--model", "/m", "--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods", "GET",
        "POST", "--allowed-credentials", "--enable-request-id-headers"])).server
    assert srv.allowed_origins == ("https://a.example", "https://b.example")
    assert srv.allowed_methods == ("GET", "POST") and srv.allowed_credentials and srv.request_id_headers
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nallowed-origins: [https://c.example]\n")
    assert config_from_args(parse_args(["--config", str(cfg)])).server.allowed_origins == ("https://c.example",)
    with pytest.raises(ConfigError, match="allowed methods must be among"):
        config_from_args(parse_args(["--model", "/m", "--allowed-methods", "FETCH"]))


def test_generation_config_flags_are_read_before_the_model_loads(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert config_from_args(parse_args(["--model", str(model)])).model.sampling_defaults == {
        "temperature": 0.6, "top_p": 0.95}
    args = ["--model", str(model), "--generation-config", "vllm", "--override-generation-config", '{"top_k": 20}']
    assert config_from_args(parse_args(args)).model.sampling_defaults == {"top_k": 20}
    (tmp_path / "generation_config.json").write_text('{"top_p": 2}')
    # The file "auto" found is refused when a generation engine starts (before any weight loads):
    # a classification or embedding model beside a broken one still serves.
    config = config_from_args(parse_args(["--model", str(model)]))
    assert config.model.sampling_defaults == {}
    assert "generation_config.json: top_p 2 is not a value it can take" in config.model.generation_config_error
    from jaxserve.cli import check_pooling_flags
    from jaxserve.startup import start_engine

    check_pooling_flags(config)  # the pooling server's check: nothing set away from its default
    with pytest.raises(ValueError, match="top_p 2 is not a value it can take.*--generation-config vllm, or LLM"):
        start_engine(config)
    assert config_from_args(parse_args(["--model", str(model), "--generation-config", "vllm"])
                            ).model.generation_config_error is None
    # A file or key the user named is refused at once.
    with pytest.raises(ConfigError, match="generation_config.json: top_p 2 is not a value it can take"):
        config_from_args(parse_args(["--model", str(model), "--generation-config", str(tmp_path)]))
    with pytest.raises(ConfigError, match="unknown key 'temp'"):
        config_from_args(parse_args(["--model", str(model), "--override-generation-config", '{"temp": 1}']))


def test_a_missing_draft_model_is_refused_before_the_served_model_loads(monkeypatch, tmp_path):
    from jaxserve import startup
    from jaxserve.weights.safetensors_dir import WeightsError

    def no_load(*args, **kwargs):
        raise AssertionError("the served model was loaded before the draft was checked")

    monkeypatch.setattr(startup, "load", no_load)
    missing = tmp_path / "draft"
    config = config_from_args(parse_args(["--speculative-model", str(missing)]))
    with pytest.raises(WeightsError, match=re.escape(f"--speculative-model: model path '{missing}' does not exist")):
        startup.start_engine(config)
    missing.mkdir()
    with pytest.raises(WeightsError, match="--speculative-model: .* has neither config.json nor a .gguf file"):
        startup.start_engine(config)


def test_default_model_is_the_packaged_smollm2():
    assert default_model().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config_from_args(parse_args([])).model.served_model_name == "SmolLM2-135M-Instruct"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_python_m_jaxserve_serves_and_stops_on_sigterm(tmp_path):
    """The real entry point: load, compile, answer a completion on a real port, exit 0 on SIGTERM."""
    import signal
    import time

    import httpx

    from tiny_models import save_tiny_tokenizer

    make_tiny_model("qwen3", tmp_path / "tiny")
    save_tiny_tokenizer(tmp_path / "tiny")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve", "--model", str(tmp_path / "tiny"), "--cache-dir", str(tmp_path / "c"),
         "--max-model-len", "128", "--port", str(port), "--served-model-name", "tiny", "alias", "--max-num-seqs", "2",
         "--max-num-batched-tokens", "16", "--num-pages", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    body = {"model": "alias", "prompt": "w5 w9 w13", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    loading: list[httpx.Response] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if status == 200:
                break
            assert status == 503
            if not loading:  # the port is open while the model loads; inference waits for it
                loading.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10))
            time.sleep(0.2)
        assert loading, "never saw the loading state (the port opens before the model is ready)"
        assert loading[0].status_code == 503 and loading[0].json()["error"]["code"] == 503
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Qwen3ForCausalLM" in out and "max_model_len 128" in out and "ready in" in out
    # Start-up shows jaxserve's own lines, not third-party INFO chatter (orbax, absl, jax's backends).
    chatter = [line for line in out.splitlines() if " INFO " in line and " jaxserve" not in line]
    assert not chatter, chatter[:5]


def test_max_model_len_beyond_the_model_is_refused(tmp_path):
    make_tiny_model("qwen3", tmp_path / "tiny")
    from tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path / "tiny")
    too_long = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--model", str(tmp_path / "tiny"), "--max-model-len", "100000",
         "--no-weight-cache"],
        capture_output=True, text=True, timeout=300,
    )
    assert too_long.returncode == 1 and "exceeds the model's max_position_embeddings 256" in too_long.stderr


def test_multi_host_flags():
    from jaxserve.parallel.multihost import initialize_kwargs

    single = config_from_args(parse_args(["--model", "/m"])).parallel.distributed
    assert not single.enabled
    cfg = config_from_args(parse_args(["--model", "/m", "--coordinator-address", "10.0.0.2:8476", "--num-processes",
                                       "4", "--process-id", "3", "--tensor-parallel-size", "16"])).parallel
    assert cfg.distributed.enabled and cfg.tensor_parallel_size == 16  # checked against all hosts' devices later
    # The coordinator binds where it was told, never to every interface by default.
    assert initialize_kwargs(cfg.distributed) == dict(
        coordinator_address="10.0.0.2:8476", coordinator_bind_address="10.0.0.2:8476", num_processes=4,
        process_id=3, initialization_timeout=300)
    auto = config_from_args(parse_args(["--model", "/m", "--distributed"])).parallel.distributed
    assert auto.enabled and initialize_kwargs(auto) == dict(initialization_timeout=300)  # all auto-detected
    bound = config_from_args(parse_args(["--model", "/m", "--coordinator-bind-address", "10.0.0.2:8476"]))
    assert bound.parallel.distributed.enabled
    assert initialize_kwargs(bound.parallel.distributed)["coordinator_bind_address"] == "10.0.0.2:8476"
    for argv, message in [
        (["--coordinator-address", "10.0.0.2"], "--coordinator-address must be HOST:PORT"),
        (["--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1, got 2"),
        (["--num-processes", "0"], "--num-processes must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_args(parse_args(["--model", "/m", *argv]))


def test_an_absent_tpu_is_not_tried(monkeypatch):
    """With libtpu installed and no TPU device files, the CLI names the platforms the machine has
    (jax would otherwise try the TPU and log a page of errors); JAX_PLATFORMS given wins."""
    import importlib.util

    from jaxserve.cli import skip_absent_tpu

    given = {"JAX_PLATFORMS": "tpu"}
    skip_absent_tpu(given)
    assert given == {"JAX_PLATFORMS": "tpu"}
    env: dict[str, str] = {}
    skip_absent_tpu(env)
    if importlib.util.find_spec("libtpu") is None:
        assert env == {}
    else:  # this machine has no TPU
        assert env["JAX_PLATFORMS"] in ("cpu", "cuda,cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no libtpu: nothing to skip
    env = {}
    skip_absent_tpu(env)
    assert env == {}


def test_gpu_memory_utilization_sets_xla_fraction_before_start():
    """--gpu-memory-utilization is XLA's preallocated fraction: the flag wins over the environment,
    the environment over jaxserve's default (0.92, where XLA alone would take 0.75 and leave the KV
    cache a third fewer pages on an 80 GB card); out of range is refused naming the flag."""
    from jaxserve.cli import GPU_MEMORY_UTILIZATION, apply_gpu_memory_utilization

    env: dict[str, str] = {}
    apply_gpu_memory_utilization(None, env)
    assert env == {"XLA_CLIENT_MEM_FRACTION": str(GPU_MEMORY_UTILIZATION)}
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):  # the current and the old name
        env = {name: "0.5"}
        apply_gpu_memory_utilization(None, env)
        assert env == {name: "0.5"}
        apply_gpu_memory_utilization(0.8, env)  # jax refuses both names at once: the flag replaces either
        assert env == {"XLA_CLIENT_MEM_FRACTION": "0.8"}
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
            apply_gpu_memory_utilization(bad, {})
    assert parse_args(["--model", "/m", "--gpu-memory-utilization", "0.7"]).gpu_memory_utilization == 0.7


def test_mm_processor_kwargs_flag_is_read_and_checked_against_the_model(tmp_path):
    """--mm-processor-kwargs reaches the model config; a text-only model, or a key the model's
    image processor does not take, is refused before anything compiles."""
    import types

    from jaxserve.startup import vision_encoder

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    config = config_from_args(parse_args(["--model", str(model), "--mm-processor-kwargs", '{"max_pixels": 3136}']))
    assert config.model.mm_processor_kwargs == {"max_pixels": 3136}
    text_only = types.SimpleNamespace(source=types.SimpleNamespace(config={"architectures": ["LlamaForCausalLM"]},
                                                                   path=tmp_path))
    with pytest.raises(ValueError, match="--mm-processor-kwargs: this model takes no images"):
        vision_encoder(text_only, "auto", {"max_pixels": 3136})
    assert vision_encoder(text_only, "auto", None) is None
    qwen = types.SimpleNamespace(source=types.SimpleNamespace(
        config={"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": {}}, path=tmp_path))
    with pytest.raises(ValueError, match="--mm-processor-kwargs: unknown key.*'num_crops'"):
        vision_encoder(qwen, "auto", {"num_crops": 4})
