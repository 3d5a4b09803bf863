"""Unknown request fields, without a model (fast): every field is honoured, accepted and ignored
(jaxserve.server.accepted_fields, which changes nothing the engine sees), or refused with a 400
naming it; a typo gets the nearest honoured name. On the scripted engine of
test_speculative_server, and through the official openai client on a real port."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from live_server import start_server
from openai.types import completion_create_params
from openai.types.chat import chat_completion_stream_options_param
from openai.types.chat import completion_create_params as chat_create_params
from test_speculative_server import CHAT, FakeTokenizer, RecordingEngine, _error, _post

from jaxserve.server import accepted_fields
from jaxserve.server.app import create_app
from jaxserve.server.classify import ClassifyRequest, LegacyClassifyRequest
from jaxserve.server.embeddings import EmbeddingRequest
from jaxserve.server.errors import to_api_error
from jaxserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from jaxserve.server.openai_responses import ResponsesRequest
from jaxserve.server.scoring import RerankRequest, ScoreRequest

TRITON = "/v2/models/fake/generate"

# (path, body with a typo, the field the 400 names, the honoured name it suggests)
TYPOS = [
    ("/v1/completions", {"prompt": "x", "max_token": 3}, "max_token", "max_tokens"),
    ("/v3/completions", {"prompt": "x", "temprature": 0.5}, "temprature", "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_token": 3}, "max_token", "max_tokens"),
    ("/v3/chat/completions", {"messages": CHAT, "temprature": 0.5}, "temprature", "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usge": True}},
     "stream_options.include_usge", "include_usage"),
    ("/generate", {"text": "x", "return_logprobs": True}, "return_logprobs", "return_logprob"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_token": 2}}, "sampling_params.max_new_token",
     "max_new_tokens"),
    ("/generate", {"text": ["x", "y"], "sampling_params": [{}, {"temprature": 0.5}]}, "sampling_params.1.temprature",
     "temperature"),
    ("/v1/responses", {"input": "x", "max_output_token": 2}, "max_output_token", "max_output_tokens"),
]


@pytest.mark.parametrize("path,body,name,near", TYPOS, ids=[f"{t[0]}-{t[2]}" for t in TYPOS])
def test_a_typo_is_refused_naming_it(path, body, name, near):
    status, reply, engine = _post(path, body)
    message, param = _error(reply)
    assert status == 400, reply
    assert message == f"{name}: unknown parameter, refused rather than ignored (did you mean '{near}'?)"
    if "param" in reply["error"]:  # OpenAI's shape; SGLang's body carries the message only
        assert (param, reply["error"]["code"]) == (name, "unknown_parameter")
    assert not engine.params  # nothing reached the engine


def test_every_unknown_field_is_named():
    status, reply, _ = _post("/v1/chat/completions", {"messages": CHAT, "zzz": 1, "max_token": 2})
    assert status == 400 and reply["error"]["param"] == "zzz"
    assert reply["error"]["message"] == "zzz: unknown parameter, refused rather than ignored; also not accepted: max_token"


def _openai(path: str, base: dict):
    return lambda fields: (path, base | fields)


def _sglang_top(fields: dict) -> tuple[str, dict]:
    return "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}, **fields}


def _sglang_sampling(fields: dict) -> tuple[str, dict]:
    return "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, **fields}}


def _triton(fields: dict) -> tuple[str, dict]:
    return TRITON, {"text_input": "x", "parameters": {"max_tokens": 2, **fields}}


IGNORED = [
    (_openai("/v1/completions", {"prompt": "x"}), accepted_fields.OPENAI_COMPLETIONS),
    (_openai("/v3/completions", {"prompt": "x"}), accepted_fields.OPENAI_COMPLETIONS),
    (_openai("/v1/chat/completions", {"messages": CHAT}), accepted_fields.OPENAI_CHAT),
    (_openai("/v3/chat/completions", {"messages": CHAT}), accepted_fields.OPENAI_CHAT),
    (_sglang_top, accepted_fields.SGLANG_GENERATE),
    (_sglang_sampling, accepted_fields.SGLANG_SAMPLING),
    (_triton, accepted_fields.TRITON),
]


@pytest.mark.parametrize("request_of,table", IGNORED,
                         ids=["completions", "v3-completions", "chat", "v3-chat", "sglang", "sglang-sampling",
                              "triton"])
def test_accepted_and_ignored_fields_change_nothing(request_of, table):
    _, _, plain = _post(*request_of({}))
    # Strings fit every declared one (`user`); the others are dropped unread, whatever their value.
    values = {name: False if name == "stream" else "x" for name in table}
    status, reply, engine = _post(*request_of(values))
    assert status == 200, reply
    assert engine.params == plain.params  # the engine got exactly what it gets without them


def test_fastdeploy_fields_with_their_own_values():
    body = {"messages": CHAT, "mm_hashes": ["9f2c"], "include_draft_logprobs": True,
            "max_streaming_response_tokens": 4, "user": "u1", "store": True, "metadata": {"run": "1"}}
    status, reply, _ = _post("/v1/chat/completions", body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "Hi"
    status, reply, _ = _post("/v1/chat/completions", body | {"user": 5})  # a declared one is still typed
    assert status == 400 and reply["error"]["param"] == "user"


@pytest.mark.parametrize("name", sorted(accepted_fields.OPENAI_CHAT_REFUSED))
def test_known_chat_fields_that_would_change_the_answer_are_refused_with_the_reason(name):
    status, reply, engine = _post("/v1/chat/completions", {"messages": CHAT, name: {}})
    err = reply["error"]
    assert status == 400 and (err["param"], err["code"]) == (name, "not_supported")
    assert err["message"] == f"{name}: {accepted_fields.OPENAI_CHAT_REFUSED[name]}"
    assert not engine.params


@pytest.mark.parametrize("fields,status,param", [
    ({"modalities": ["text"]}, 200, None),
    ({"modalities": ["text", "audio"]}, 400, "modalities"),
    ({"stream": True, "stream_options": {"include_obfuscation": False}}, 200, None),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, 400, "stream_options.include_obfuscation"),
])
def test_chat_fields_honoured_for_the_values_that_ask_for_text(fields, status, param):
    got, reply, _ = _post("/v1/chat/completions", {"messages": CHAT, **fields})
    assert got == status, reply
    if param is not None:
        assert reply["error"]["param"] == param


def test_every_parameter_of_the_openai_client_is_honoured_ignored_or_refused():
    """A new parameter in the official client must be sorted into one of the three."""
    for params, model in ((completion_create_params.CompletionCreateParamsBase, CompletionRequest),
                          (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest)):
        known = set(model.model_fields) | set(model.IGNORED) | set(model.REFUSED)
        assert set(params.__annotations__) - known == set(), model.__name__
    stream_options = chat_completion_stream_options_param.ChatCompletionStreamOptionsParam
    assert set(stream_options.__annotations__) <= set(StreamOptions.model_fields)


def test_tables_are_consistent():
    for model in (CompletionRequest, ChatCompletionRequest):
        assert not set(model.REFUSED) & (set(model.IGNORED) | set(model.model_fields))
    assert not set(accepted_fields.RESPONSES) - set(ResponsesRequest.model_fields)  # all declared there


# ---- Triton: free-form by its spec, checked against its own names -------------------------------
def test_triton_end_id_must_be_the_models_end_and_pad_id_is_ignored():
    status, reply, engine = _post(TRITON, {"text_input": "x", "max_tokens": 2, "end_id": 0, "pad_id": 0})
    assert status == 200 and len(engine.params) == 1, reply
    for end_id in (5, True, "0"):
        status, reply, engine = _post(TRITON, {"text_input": "x", "parameters": {"end_id": end_id}})
        assert status == 400 and reply["error"].startswith("end_id: only the model's end-of-sequence id(s) [0]")
        assert not engine.params


# ---- pooling routes: the request models alone -----------------------------------------------------
@pytest.mark.parametrize("model,body,name", [
    (ClassifyRequest, {"input": "x", "activaton": False}, "activaton"),
    (LegacyClassifyRequest, {"text": "x", "rids": "a"}, "rids"),
    (EmbeddingRequest, {"input": "x", "dimension": 8}, "dimension"),
    (ScoreRequest, {"text_1": "a", "text_2": "b", "text_3": "c"}, "text_3"),
    (RerankRequest, {"query": "q", "documents": ["d"], "topn": 1}, "topn"),
])
def test_pooling_requests_refuse_unknown_fields_and_take_user(model, body, name):
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    err = to_api_error(e.value)
    assert (err.status, err.param, err.code) == (400, name, "unknown_parameter")
    assert err.message.startswith(f"{name}: unknown parameter")
    accepted = {k: v for k, v in body.items() if k != name} | {next(iter(model.IGNORED)): "u"}
    model.model_validate_json(json.dumps(accepted))


def test_rerank_document_objects_keep_their_own_keys():
    req = RerankRequest.model_validate_json(json.dumps({"query": "q", "documents": [{"text": "d", "id": 7}]}))
    assert req.documents[0].text == "d"


# ---- the official client on a real port -----------------------------------------------------------
@pytest.fixture(scope="module")
def fake_client():
    live = start_server(create_app(RecordingEngine(), FakeTokenizer(), "fake", 100))  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    live.close()


def test_the_official_client_with_fields_we_ignore_and_a_typo(fake_client):
    r = fake_client.chat.completions.create(
        model="fake", messages=CHAT, max_completion_tokens=2, user="u1", metadata={"run": "1"}, store=True,
        service_tier="auto", safety_identifier="s", prompt_cache_key="k", prompt_cache_retention="24h",
        prediction={"type": "content", "content": "Hi"}, modalities=["text"],
        extra_body={"mm_hashes": ["9f2c"], "include_draft_logprobs": True})
    assert r.choices[0].message.content == "Hi"
    c = fake_client.completions.create(model="fake", prompt="x", max_tokens=2, user="u1",
                                       extra_body={"mm_hashes": ["9f2c"]})
    assert c.choices[0].text == "Hi"
    with pytest.raises(openai.BadRequestError) as e:
        fake_client.chat.completions.create(model="fake", messages=CHAT, extra_body={"max_token": 2})
    assert (e.value.param, e.value.code) == ("max_token", "unknown_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        fake_client.chat.completions.create(model="fake", messages=CHAT, reasoning_effort="high")
    assert (e.value.param, e.value.code) == ("reasoning_effort", "not_supported")
