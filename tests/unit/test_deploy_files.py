"""Deployment files (configs/, tpu/): every YAML parses, every preset loads into the config
dataclasses, every flag the manifests, launcher and runbook pass to jaxserve exists, and the
multi-host leader and workers agree. Fast: no network, no model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxserve.cli import build_parser, parse_args
from jaxserve.plan import build_parser as plan_parser

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TPU_YAMLS = sorted((ROOT / "tpu").rglob("*.yaml"))
GKE = ROOT / "tpu" / "gke"
LAUNCH = ROOT / "tpu" / "launch.sh"
RUNBOOK = ROOT / "tpu" / "README.md"
FLAGS = set(build_parser()._option_string_actions)
PLAN_FLAGS = set(plan_parser()._option_string_actions)

EXPECTED = {  # preset -> key fields
    "cpu-dev.yaml": dict(tp=1, distributed=False, dtype="float32"),
    "h100-llama3-8b.yaml": dict(tp=1, distributed=False, dtype="bfloat16", max_num_seqs=256,
                                max_num_batched_tokens=2048, max_model_len=8192,
                                model="/models/Meta-Llama-3-8B-Instruct"),
    "tpu-v5e-8-llama3-8b.yaml": dict(tp=8, distributed=False, dtype="bfloat16",
                                     model="/models/Meta-Llama-3-8B-Instruct"),
    "tpu-v6e-8-llama3-70b.yaml": dict(tp=8, distributed=False, dtype="bfloat16",
                                      model="/models/Meta-Llama-3-70B-Instruct"),
    "tpu-v6e-8-gemma3-27b.yaml": dict(tp=8, distributed=False, dtype="bfloat16", max_num_seqs=64,
                                      model="/models/gemma-3-27b-it"),
    "tpu-v6e-8-qwen3-30b-a3b.yaml": dict(tp=8, distributed=False, dtype="bfloat16", max_num_seqs=64,
                                         model="/models/Qwen3-30B-A3B"),
    "tpu-v5e-16-llama3-70b.yaml": dict(tp=16, distributed=True, dtype="bfloat16",
                                       model="/models/Meta-Llama-3-70B-Instruct"),
    "tpu-v6e-16-llama3-70b.yaml": dict(tp=16, distributed=True, dtype="bfloat16",
                                       model="/models/Meta-Llama-3-70B-Instruct"),
}

# Loads every preset in one child: tp 8 presets check the local device count, so the child gets
# 8 virtual CPU devices.
_LOADER = r"""
import json, sys
from jaxserve.cli import config_from_args, parse_args
out = {}
for path in sys.argv[1:]:
    c = config_from_args(parse_args(["--config", path]))
    d = c.parallel.distributed
    out[path] = dict(tp=c.parallel.tensor_parallel_size, distributed=d.enabled, dtype=c.model.dtype,
                     model=c.model.model, max_model_len=c.model.max_model_len,
                     max_num_seqs=c.scheduler.max_num_seqs,
                     max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                     host=c.server.host, coordinator=d.coordinator_address, process_id=d.process_id,
                     num_processes=d.num_processes, attention_backend=c.attention_backend)
print(json.dumps(out))
"""


def _config_path(path: str) -> Path:
    return ROOT / path[len("/app/"):] if path.startswith("/app/") else ROOT / path


def _flags_in(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--")]


def _containers() -> list[tuple[str, dict]]:
    """(where, container) for every container of every manifest that runs jaxserve."""
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            if "containers" in node:
                for c in node["containers"]:
                    if "jaxserve" in " ".join(map(str, c.get("command", []) + c.get("args", []))):
                        found.append((f"{where}:{c['name']}", c))
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path in sorted(GKE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc, path.name)
    return found


def _argv(container: dict) -> list[str]:
    return [str(x) for x in container.get("command", []) + container.get("args", [])]


def _shell_jaxserve_calls(text: str) -> list[str]:
    """The argument text of each `-m jaxserve` call in shell text (continuations joined), up to the
    end of that command."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [re.split(r"[;|&>'\"]", m)[0] for m in re.findall(r"-m jaxserve\b([^\n]*)", joined)]


def _lws() -> dict:
    docs = list(yaml.safe_load_all((GKE / "leaderworkerset-v5e-16.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "LeaderWorkerSet")


def _opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_expected_files_exist():
    assert {p.name for p in CONFIGS} >= set(EXPECTED)
    for name in ("deployment-v5e-8.yaml", "service.yaml", "leaderworkerset-v5e-16.yaml"):
        assert (GKE / name).is_file()
    assert LAUNCH.is_file() and RUNBOOK.is_file()


@pytest.mark.parametrize("path", CONFIGS + TPU_YAMLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_has_usage_header(path):
    head = path.read_text().split("\n", 1)[0]
    assert head.startswith("#")
    assert f"--config configs/{path.name}" in path.read_text()


def test_presets_load_into_config():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _LOADER, *map(str, CONFIGS)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = {Path(k).name: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    for name, want in EXPECTED.items():
        got = loaded[name]
        for key, value in want.items():
            assert got[key] == value, (name, key, got[key], value)
    # Model paths such as /models/... need not exist to load a config (here they do not).
    missing = [n for n, got in loaded.items() if got["model"].startswith("/models/") and not Path(got["model"]).exists()]
    assert missing or all(Path(g["model"]).exists() for g in loaded.values())
    for name, got in loaded.items():
        # Auto-detected on TPU pods: no preset hard-codes them.
        assert got["coordinator"] is None and got["process_id"] is None and got["num_processes"] is None, name
        assert got["host"] == "127.0.0.1", name  # 0.0.0.0 only on the command line of in-cluster pods


def test_unknown_preset_key_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "tpu-v5e-8-llama3-8b.yaml").read_text() + "tensor-parallel: 8\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(bad)])
    assert e.value.code == 2
    assert "unknown key 'tensor-parallel'" in capsys.readouterr().err


def test_manifest_flags_and_configs_exist():
    containers = _containers()
    assert len(containers) == 3  # the Deployment, the LWS leader and worker
    for where, c in containers:
        argv = _argv(c)
        assert argv[:3] == ["python", "-m", "jaxserve"], where
        for flag in _flags_in(argv):
            assert flag in FLAGS, (where, flag)
        config = _opt(argv, "--config")
        assert config and _config_path(config).is_file(), (where, config)


def test_launch_and_runbook_flags_and_configs_exist():
    calls = _shell_jaxserve_calls(LAUNCH.read_text())
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", RUNBOOK.read_text(), re.S)
    calls += [c for b in blocks for c in _shell_jaxserve_calls(b)]
    assert len(calls) >= 4
    launch_flags = set(re.findall(r"--[a-z][a-z0-9-]*", calls[0]))
    assert {"--config", "--coordinator-address", "--num-processes", "--process-id"} <= launch_flags
    for call in calls:
        # `-m jaxserve.plan` has its own command line; everything else is the server's.
        known = PLAN_FLAGS if call.startswith(".plan ") else FLAGS
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", call):
            assert flag in known, (flag, call)
        for path in re.findall(r"--config\s+(\S+)", call):
            if "$" not in path:
                assert _config_path(path).is_file(), path
    # Every configs/... path the runbook and launcher name exists.
    for text in (LAUNCH.read_text(), RUNBOOK.read_text()):
        for path in re.findall(r"configs/[\w.-]+\.yaml", text):
            assert (ROOT / path).is_file(), path


def test_launch_script_syntax():
    bash = shutil.which("bash")
    assert bash
    subprocess.run([bash, "-n", str(LAUNCH)], check=True)
    text = LAUNCH.read_text()
    assert "set -euo pipefail" in text
    # Bad arguments: usage and exit 2, before any gcloud call.
    proc = subprocess.run([bash, str(LAUNCH), "only-a-name"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_deployment_single_host():
    dep = yaml.safe_load((GKE / "deployment-v5e-8.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "2x4"}
    (c,) = pod["containers"]
    assert c["resources"]["requests"]["google.com/tpu"] == c["resources"]["limits"]["google.com/tpu"] == 8
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    argv = _argv(c)
    assert _opt(argv, "--config") == "/app/configs/tpu-v5e-8-llama3-8b.yaml"
    assert _opt(argv, "--host") == "0.0.0.0"
    assert "/models" in {m["mountPath"] for m in c["volumeMounts"]}


def test_lws_leader_and_workers_agree():
    lws = _lws()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    size = tmpl["size"]
    assert size == 4
    (leader,) = tmpl["leaderTemplate"]["spec"]["containers"]
    (worker,) = tmpl["workerTemplate"]["spec"]["containers"]
    la, wa = _argv(leader), _argv(worker)
    assert _opt(la, "--config") == _opt(wa, "--config")
    assert "--distributed" in la and "--distributed" in wa
    coord = _opt(la, "--coordinator-address")
    assert coord == _opt(wa, "--coordinator-address") == "$(LWS_LEADER_ADDRESS):8476"
    port = coord.rsplit(":", 1)[1]
    assert _opt(la, "--coordinator-bind-address") == f"0.0.0.0:{port}"
    assert _opt(wa, "--coordinator-bind-address") is None  # only process 0 runs the coordinator
    assert _opt(la, "--num-processes") == _opt(wa, "--num-processes") == str(size)
    assert _opt(la, "--process-id") == _opt(wa, "--process-id") == "$(LWS_WORKER_INDEX)"
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    for c in (leader, worker):
        assert c["resources"]["limits"]["google.com/tpu"] == 4
    # The preset the pods run is the multi-host one.
    preset = yaml.safe_load(_config_path(_opt(la, "--config")).read_text())
    assert preset["distributed"] is True and preset["tensor-parallel-size"] == 4 * size


def test_service_selects_server_pods_and_only_the_lws_leader():
    services = {d["metadata"]["name"]: d for d in yaml.safe_load_all((GKE / "service.yaml").read_text())}
    dep = yaml.safe_load((GKE / "deployment-v5e-8.yaml").read_text())
    lws = _lws()
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    lws_labels = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}  # set by LWS on its pods
    leader = {**tmpl["leaderTemplate"]["metadata"]["labels"], **lws_labels}
    worker = {**tmpl["workerTemplate"]["metadata"]["labels"], **lws_labels}
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]

    def selects(svc, labels):
        return all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())

    for svc in services.values():
        assert svc["spec"]["type"] == "ClusterIP"
        assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    single = [s for s in services.values() if selects(s, pod_labels)]
    multi = [s for s in services.values() if selects(s, leader)]
    assert single and multi
    for svc in services.values():
        assert not selects(svc, worker), svc["metadata"]["name"]
