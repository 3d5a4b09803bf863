"""Running a batch of requests through an engine to the end, for the engine tests."""

from __future__ import annotations

from jaxserve.engine.core import Engine, run_to_completion
from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import SamplingParams


def run_requests(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 prefix: str = "r") -> list[RequestOutput]:
    """Add one request per prompt (`params` for all, or one each), step until all finish, check the
    scheduler's idle invariants; the outputs in prompt order."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    for rid, prompt, p in zip(ids, prompts, each):
        engine.add_request(rid, prompt, p)
    results = run_to_completion(engine, ids)
    engine.check_idle_integrity()
    return [results[r] for r in ids]
