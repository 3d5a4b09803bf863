"""Tool calls on the host: what parsing a streamed call costs, and what constraining an auto
request costs per token (the grammar's mask), on the CPU.

    python -m benchmarks.tool_parsing [--chunk 4] [--json out.json]

Parsing: each format's call with a 4 KB and a 20 KB argument, and a list of 100 calls, fed to
jaxserve.server.tool_parsers.ToolCallStream --chunk characters at a time (a token is ~4), as the
chat stream feeds it; reported per piece (mean and worst) and in total.

Masks: SmolLM2's vocabulary (49,152 tokens), a hermes `tool_choice: "auto"` grammar over two tools
(jaxserve.structured.compose), walked token by token through free text, then a call; reported is
the mean time to fill one token mask in each phase, against an unconstrained step's zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

SCHEMAS = {"write": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                     "required": ["path", "content"]},
           "get_time": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}


def _outputs(size: int) -> dict[str, str]:
    code = ("def f(x):\n    return {'a': x}  # \"quoted\"\n" * (size // 40 + 1))[:size]
    args = json.dumps({"path": "a.py", "content": code})
    return {
        "hermes": f'<tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>',
        "llama3_json": f'{{"name": "write", "parameters": {args}}}',
        "mistral": f'[TOOL_CALLS] [{{"name": "write", "arguments": {args}}}]',
        "qwen3_coder": ("<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
                        f"{code}\n</parameter>\n</function>\n</tool_call>"),
        "pythonic": f"[write(path='a.py', content={json.dumps(code)})]",
    }


def _many(n: int) -> dict[str, str]:
    one = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    return {"mistral": "[TOOL_CALLS] [" + ", ".join([one] * n) + "]",
            "pythonic": "[" + ", ".join(["get_time(zone='UTC')"] * n) + "]"}


def parse_costs(chunk: int) -> list[dict]:
    from jaxserve.server import tool_parsers as T

    rows = []
    cases = [(f"{k // 1000} KB argument", _outputs(k)) for k in (4000, 20000)] + [("100 calls", _many(100))]
    for label, outputs in cases:
        for fmt, text in outputs.items():
            stream = T.ToolCallStream(T.FORMATS[fmt], SCHEMAS)
            times = []
            start = time.perf_counter()
            for i in range(0, len(text), chunk):
                t = time.perf_counter()
                stream.feed(text[i:i + chunk])
                times.append(time.perf_counter() - t)
            stream.finish()
            total = time.perf_counter() - start
            assert stream.calls, (fmt, label)
            rows.append({"case": label, "format": fmt, "chars": len(text), "pieces": len(times),
                         "mean_us": 1e6 * total / len(times), "worst_us": 1e6 * max(times), "total_ms": 1e3 * total})
    return rows


def mask_costs() -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from smollm2 import GGUF_NAME, smollm2_dir

    from jaxserve.server import tool_parsers as T
    from jaxserve.structured import compose
    from jaxserve.structured.compiler import GrammarCompiler
    from jaxserve.structured.vocabulary import token_vocabulary
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir(), GGUF_NAME)
    vocabulary = token_vocabulary(tok.hf, [2])
    compiler = GrammarCompiler(vocabulary, tok.hf, workers=1)
    try:
        spec = compose.compose(compose.ToolRules(T.FORMATS["hermes"].lark(SCHEMAS, True, lambda _: None)), None, "t")
        matcher = compiler.get(spec).matcher()
        mask = np.zeros((vocabulary.size + 31) // 32, np.uint32)
        text = ("Let me look that up for you. " * 8) + '<tool_call>\n{"name": "write", "arguments": ' + json.dumps(
            {"path": "a.py", "content": "print('hello world')\n" * 8}) + "}\n</tool_call>"
        phases: dict[str, list[float]] = {"free text": [], "inside the call": []}
        ids = tok.hf.encode(text, add_special_tokens=False)
        for k, t in enumerate(ids):
            in_call = "<tool_call>" in tok.hf.decode(ids[:k])
            start = time.perf_counter()
            matcher.fill_mask(mask)
            phases["inside the call" if in_call else "free text"].append(time.perf_counter() - start)
            assert matcher.advance(t)
        return [{"phase": k, "tokens": len(v), "mean_us": 1e6 * sum(v) / len(v)} for k, v in phases.items()]
    finally:
        compiler.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=4, help="characters per streamed piece (a token is ~4)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    parsing, masks = parse_costs(args.chunk), mask_costs()
    print(f"{'case':16s} {'format':12s} {'chars':>7s} {'pieces':>7s} {'mean us':>8s} {'worst us':>9s} {'total ms':>9s}")
    for r in parsing:
        print(f"{r['case']:16s} {r['format']:12s} {r['chars']:7d} {r['pieces']:7d} {r['mean_us']:8.1f} "
              f"{r['worst_us']:9.1f} {r['total_ms']:9.1f}")
    print()
    for r in masks:
        print(f"mask, {r['phase']:16s} {r['tokens']:4d} tokens: {r['mean_us']:.0f} us per token")
    if args.json:
        args.json.write_text(json.dumps({"parsing": parsing, "masks": masks}, indent=1))


if __name__ == "__main__":
    main()
