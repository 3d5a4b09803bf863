"""The HTTP side of speculative decoding, without a model (fast): OVMS's num_assistant_tokens and
max_ngram_size reach SamplingParams on every protocol; fields we know and cannot honour yet
(assistant_confidence_threshold, beam search) get a 400 naming them; the speculative counts appear
in OpenAI usage, SGLang meta_info and /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from jaxserve.engine.info import EngineInfo, Stats
from jaxserve.engine.output import CompletionOutput, RequestOutput
from jaxserve.engine.request import SamplingParams
from jaxserve.server.app import create_app

CHAT = [{"role": "user", "content": "x"}]


class FakeTokenizer:
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    encode_prompt = encode

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


class RecordingEngine:
    """Records each request's SamplingParams and answers "Hi" in two deltas, the last carrying the
    request's speculative totals (as the engine's latest delta does)."""

    error = None

    def __init__(self, speculative: bool = False, drafted: int = 0, accepted: int = 0, stats: Stats | None = None):
        self.info = EngineInfo(architecture="FakeForCausalLM", vocab_size=256, eos_ids=(0,), max_model_len=100,
                               max_n=8, max_num_seqs=4, page_size=16, num_pages=8, decode_steps=1,
                               speculative_method="ngram" if speculative else None,
                               num_speculative_tokens=4 if speculative else 0, max_ngram_size=3 if speculative else 0)
        self.stats = stats or Stats(num_usable_pages=8)
        self.drafted, self.accepted = drafted, accepted
        self.params: list[SamplingParams] = []

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0):
        self.params.append(params)
        return self._deltas(request_id, prompt_ids, params.n)

    async def _deltas(self, request_id: str, prompt_ids: list[int], n: int):
        yield RequestOutput(request_id, prompt_ids, [CompletionOutput(i, "H", [72]) for i in range(n)], False,
                            num_draft_tokens=self.drafted // 2, num_accepted_draft_tokens=self.accepted // 2)
        yield RequestOutput(request_id, prompt_ids, [CompletionOutput(i, "i", [105], finish_reason="length")
                                                     for i in range(n)], True,
                            num_draft_tokens=self.drafted, num_accepted_draft_tokens=self.accepted)

    def abort(self, request_id: str) -> None:
        pass

    def abort_all(self) -> None:
        pass


def _call(engine: RecordingEngine, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    app = create_app(engine, FakeTokenizer(), "fake", 100)  # type: ignore[arg-type]

    async def go() -> tuple[int, bytes]:
        client = app.test_client()
        response = await (client.post(path, json=body) if method == "POST" else client.get(path))
        return response.status_code, await response.get_data()

    return asyncio.run(go())


def _post(path: str, body: dict, engine: RecordingEngine | None = None) -> tuple[int, Any, RecordingEngine]:
    engine = engine or RecordingEngine()
    status, data = _call(engine, "POST", path, body)
    text = data.decode()
    return status, (json.loads(text) if not text.startswith("data: ") else _events(text)), engine


def _events(text: str) -> list:
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ") and b[6:] != "[DONE]"]


# Each protocol's request with extra sampling fields, and where its errors name them.
def _completions(fields: dict) -> tuple[str, dict, str]:
    return "/v1/completions", {"prompt": "x", **fields}, ""


def _chat(fields: dict) -> tuple[str, dict, str]:
    return "/v1/chat/completions", {"messages": CHAT, **fields}, ""


def _v3_chat(fields: dict) -> tuple[str, dict, str]:
    return "/v3/chat/completions", {"messages": CHAT, **fields}, ""


def _sglang(fields: dict) -> tuple[str, dict, str]:
    return "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, **fields}}, "sampling_params."


def _triton(fields: dict) -> tuple[str, dict, str]:
    return "/v2/models/fake/generate", {"text_input": "x", "parameters": {"max_tokens": 2, **fields}}, ""


PROTOCOLS = [_completions, _chat, _v3_chat, _sglang, _triton]
IDS = ["completions", "chat", "v3-chat", "sglang", "triton"]


def _error(body: Any) -> tuple[str, str | None]:
    """(message, param) of any protocol's error body (Triton's and SGLang's carry no param)."""
    err = body["error"]
    if isinstance(err, str):
        return err, None
    return err["message"], err.get("param")


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=IDS)
def test_prompt_lookup_fields_reach_sampling_params(protocol):
    path, body, _ = protocol({"num_assistant_tokens": 3, "max_ngram_size": 2})
    status, reply, engine = _post(path, body, RecordingEngine(speculative=True))
    assert status == 200, reply
    (params,) = engine.params
    assert (params.num_assistant_tokens, params.max_ngram_size) == (3, 2)
    path, body, _ = protocol({"num_assistant_tokens": 0})  # 0: off for this request
    _, _, engine = _post(path, body, RecordingEngine(speculative=True))
    assert (engine.params[0].num_assistant_tokens, engine.params[0].max_ngram_size) == (0, None)
    path, body, _ = protocol({})  # absent: the server's defaults
    _, _, engine = _post(path, body, RecordingEngine(speculative=True))
    assert (engine.params[0].num_assistant_tokens, engine.params[0].max_ngram_size) == (None, None)


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=IDS)
@pytest.mark.parametrize("name", ["num_assistant_tokens", "max_ngram_size"])
def test_prompt_lookup_fields_must_be_integers(protocol, name):
    path, body, prefix = protocol({name: "3"})
    status, reply, engine = _post(path, body)
    message, param = _error(reply)
    assert status == 400 and name in message and not engine.params
    assert param in (None, name, prefix + name)


# (fields, the field the 400 names, words its message must contain)
REFUSED = [
    ({"num_assistant_tokens": 3, "assistant_confidence_threshold": 0.4}, "assistant_confidence_threshold",
     "mutually exclusive"),
]


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=IDS)
@pytest.mark.parametrize("fields,name,words", REFUSED, ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_unhonoured_fields_are_refused_by_name(protocol, fields, name, words):
    path, body, prefix = protocol(fields)
    status, reply, engine = _post(path, body, RecordingEngine(speculative=True))
    message, param = _error(reply)
    assert status == 400, reply
    assert message.startswith(prefix) and prefix + name in message and words in message, message
    assert param in (None, prefix + name)
    if "mutually exclusive" in words:  # both are named, the check comes before either refusal
        assert prefix + "num_assistant_tokens" in message and "draft model" not in message
    assert not engine.params  # nothing reached the engine


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=IDS)
def test_a_confidence_threshold_reaches_the_engine(protocol):
    # The engine refuses it unless a draft model drafts (tests/engine/test_draft_model.py).
    path, body, _ = protocol({"assistant_confidence_threshold": 0.4})
    status, reply, engine = _post(path, body, RecordingEngine(speculative=True))
    assert status == 200 and engine.params[0].assistant_confidence_threshold == 0.4, reply


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=IDS)
def test_beam_search_fields_that_ask_nothing_are_fine(protocol):
    # vLLM's defaults, which some clients send with every request.
    path, body, _ = protocol({"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False})
    status, reply, engine = _post(path, body)
    assert status == 200 and len(engine.params) == 1, reply


def test_triton_use_beam_search_must_be_a_boolean():
    status, reply, _ = _post(*_triton({"use_beam_search": "false"})[:2])
    assert status == 400 and reply["error"].startswith("use_beam_search: expected bool")


# ---- reporting ------------------------------------------------------------------------------------
PREDICTIONS = {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 3}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_usage_reports_accepted_and_rejected_drafts(path, body):
    _, reply, _ = _post(path, body, RecordingEngine(speculative=True, drafted=10, accepted=7))
    assert reply["usage"]["completion_tokens"] == 2
    assert reply["usage"]["completion_tokens_details"] == PREDICTIONS
    _, reply, _ = _post(path, body, RecordingEngine(speculative=True))  # speculating, nothing drafted
    assert reply["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0}
    _, reply, _ = _post(path, body)  # no speculation: OpenAI's plain usage
    assert "completion_tokens_details" not in reply["usage"]


def test_usage_sums_drafts_over_a_batch_of_prompts():
    _, reply, _ = _post("/v1/completions", {"prompt": ["x", "y"]}, RecordingEngine(speculative=True, drafted=10,
                                                                                     accepted=7))
    assert reply["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 14,
                                                           "rejected_prediction_tokens": 6}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_streamed_usage_reports_drafts(path, body):
    options = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, events, _ = _post(path, body | options, RecordingEngine(speculative=True, drafted=10, accepted=7))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens_details"] == PREDICTIONS
    running = [e["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for e in events]
    assert running == sorted(running) and running[-1] == 7  # continuous usage: the totals so far


def test_responses_usage_reports_drafts():
    body = {"input": "x"}
    _, reply, _ = _post("/v1/responses", body, RecordingEngine(speculative=True, drafted=10, accepted=7))
    assert reply["usage"]["output_tokens_details"] == {"reasoning_tokens": 0, **PREDICTIONS}
    _, reply, _ = _post("/v1/responses", body)
    assert reply["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def test_sglang_meta_info_reports_drafts():
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    _, reply, _ = _post("/generate", body, RecordingEngine(speculative=True, drafted=10, accepted=7))
    meta = reply["meta_info"]
    assert (meta["spec_draft_token_num"], meta["spec_accept_token_num"], meta["spec_accept_rate"]) == (10, 7, 0.7)
    _, reply, _ = _post("/generate", body, RecordingEngine(speculative=True))
    assert reply["meta_info"]["spec_accept_rate"] == 0.0  # nothing drafted: no division by zero
    _, events, _ = _post("/generate", body | {"stream": True}, RecordingEngine(speculative=True, drafted=10,
                                                                                accepted=7))
    assert [e["meta_info"]["spec_draft_token_num"] for e in events] == [5, 10]
    _, reply, _ = _post("/generate", body)
    assert not any(k.startswith("spec_") for k in reply["meta_info"])


def test_metrics_render_speculative_counters():
    stats = dataclasses.replace(Stats(num_usable_pages=8), num_draft_tokens=10, num_accepted_draft_tokens=7)
    status, data = _call(RecordingEngine(speculative=True, stats=stats), "GET", "/metrics")
    lines = data.decode().splitlines()
    assert status == 200
    for name, value in (("jaxserve:spec_decode_num_draft_tokens_total", "10.0"),
                        ("jaxserve:spec_decode_num_accepted_tokens_total", "7.0")):
        assert f"# TYPE {name} counter" in lines and f"{name} {value}" in lines
