"""The HTTP layer without a model (fast): a scripted engine that fails mid-stream shows each
protocol's error event and framing; a failure before the first token is a clean status."""

from __future__ import annotations

import asyncio
import json

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.engine.info import EngineInfo, Stats
from jaxserve.engine.output import CompletionOutput, RequestOutput
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import RequestTooLongError
from jaxserve.server.app import create_app


class FakeTokenizer:
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    encode_prompt = encode  # no special tokens to parse

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


class FailingEngine:
    """Yields one delta, then the device "fails"; refuses max_tokens over 100 up front."""

    error = None

    info = EngineInfo(architecture="FakeForCausalLM", vocab_size=256, eos_ids=(0,), max_model_len=100, max_n=8, max_num_seqs=4, page_size=16,
                      num_pages=8, decode_steps=1)
    stats = Stats(num_usable_pages=8)

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0):
        if params.max_tokens is not None and params.max_tokens > 100:
            raise RequestTooLongError("max_tokens", f"prompt has {len(prompt_ids)} tokens and max_tokens is "
                                      f"{params.max_tokens}: over the context limit of 100 tokens")
        return self._deltas(request_id, prompt_ids)

    async def _deltas(self, request_id: str, prompt_ids: list[int]):
        yield RequestOutput(request_id, prompt_ids, [CompletionOutput(0, "Hi", [72, 105])], False)
        raise EngineDeadError("the engine stopped: device lost")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def abort_all(self) -> None:
        self.aborted.append("*")


def _post(path: str, body: dict) -> tuple[int, bytes, FailingEngine]:
    engine = FailingEngine()
    app = create_app(engine, FakeTokenizer(), "fake", 100)  # type: ignore[arg-type]

    async def go() -> tuple[int, bytes]:
        response = await app.test_client().post(path, json=body)
        return response.status_code, await response.get_data()

    status, data = asyncio.run(go())
    return status, data, engine


def _events(data: bytes) -> list:
    blocks = data.decode().split("\n\n")
    assert blocks[-1] == ""
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in blocks[:-1]]


def test_openai_stream_error_event_then_done():
    status, data, engine = _post("/v1/completions", {"prompt": "x", "stream": True})
    events = _events(data)
    assert status == 200 and events[0]["choices"][0]["text"] == "Hi"
    assert events[1]["error"]["type"] == "service_unavailable" and "device lost" in events[1]["error"]["message"]
    assert events[2] == "[DONE]"
    assert engine.aborted  # the request is released in the engine


def test_chat_and_sglang_stream_error_events():
    _, data, _ = _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})
    events = _events(data)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "error" in events[-2] and events[-1] == "[DONE]"
    _, data, _ = _post("/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 8}})
    events = _events(data)
    assert events[0]["text"] == "Hi" and "device lost" in events[1]["error"]["message"] and events[2] == "[DONE]"


def test_triton_stream_error_event_without_done():
    _, data, _ = _post("/v2/models/fake/generate_stream", {"text_input": "x"})
    events = _events(data)
    assert events[0]["text_output"] == "xHi"  # the prompt first, as the vLLM backend sends it
    assert "device lost" in events[1]["error"] and len(events) == 2


def test_failure_before_streaming_is_a_status():
    status, data, _ = _post("/v1/completions", {"prompt": "x", "max_tokens": 101, "stream": True})
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "max_tokens" and "context limit of 100" in err["message"]
    status, data, _ = _post("/v1/completions", {"prompt": "x"})
    assert status == 503 and "device lost" in json.loads(data)["error"]["message"]
    status, data, _ = _post("/v2/models/fake/generate", {"text_input": "x"})
    assert status == 503 and "device lost" in json.loads(data)["error"]


def test_a_busy_port_is_refused_before_anything_loads():
    import socket

    import pytest

    from jaxserve.server.loading import check_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", port)  # free again


def test_a_signal_while_the_model_loads_ends_the_process_at_once(tmp_path):
    """Ctrl-C (or SIGTERM) during a load that takes minutes: the process exits now, with the
    signal's status, while /health still says 503."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import time\nfrom jaxserve.server.loading import serve_while_loading\n"
              f"serve_while_loading(lambda: time.sleep(600), '127.0.0.1', {port})\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        # Meanwhile every route answers 503 in its own protocol's error body.
        said = {path: httpx.post(f"http://127.0.0.1:{port}{path}", json={}, timeout=5) for path in
                ("/v1/completions", "/v1/classify", "/v2/models/m/generate", "/generate")}
        assert {r.status_code for r in said.values()} == {503}
        assert said["/v1/completions"].json()["error"] == {"message": "the model is still loading",
                                                           "type": "service_unavailable", "param": None,
                                                           "code": 503}
        assert said["/v1/classify"].json()["error"]["type"] == "ServiceUnavailableError"
        assert said["/v2/models/m/generate"].json() == {"error": "the model is still loading"}
        assert said["/generate"].json() == {"error": {"message": "the model is still loading"}}
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 128 + signal.SIGINT
        assert time.monotonic() - start < 10
        assert "SIGINT while the model loads: exiting" in proc.stderr.read()
    finally:
        proc.kill()


def test_truncating_a_prompt_moves_its_images_and_refuses_to_split_one():
    import pytest

    from jaxserve.engine.embeds import ImageItem
    from jaxserve.server.errors import ApiError
    from jaxserve.server.generation import truncate_prompt

    prompt = list(range(20))
    image = ImageItem(offset=10, num_tokens=4, key="k", data=None)
    kept, images = truncate_prompt(prompt, [image], 12, max_model_len=64)
    assert kept == prompt[8:] and images[0].offset == 2 and images[0].num_tokens == 4
    assert truncate_prompt(prompt, [image], -1, max_model_len=64) == (prompt, [image])
    for keep in (9, 10):  # into the image, or just past its start marker
        with pytest.raises(ApiError, match="cut an image"):
            truncate_prompt(prompt, [image], keep, max_model_len=64)
    for bad in (0, -3, 65):
        with pytest.raises(ApiError) as e:
            truncate_prompt(prompt, [], bad, max_model_len=64)
        assert e.value.param == "truncate_prompt_tokens"


def test_cors_preflight_skips_auth_and_responses_carry_the_allow_headers():
    """A browser's preflight (no Authorization) is answered before the API key is checked; the
    request itself still needs the key and carries Access-Control-Allow-Origin; X-Request-Id is
    echoed when asked for (vLLM's --enable-request-id-headers)."""
    from jaxserve.server.cors import CorsPolicy

    origin = "https://app.example"

    async def go(app) -> list:
        client = app.test_client()
        pre = await client.options("/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        no_key = await client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": origin})
        models = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer k",
                                                         "X-Request-Id": "mine"})
        other = await client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        return [pre, no_key, models, other]

    app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100, api_keys=("k",),  # type: ignore[arg-type]
                     request_id_headers=True)
    pre, no_key, models, other = asyncio.run(go(app))
    assert pre.status_code == 200 and pre.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert no_key.status_code == 401 and no_key.headers["Access-Control-Allow-Origin"] == "*"
    assert models.status_code == 200 and models.headers["X-Request-Id"] == "mine"
    assert len(other.headers["X-Request-Id"]) == 32

    strict = CorsPolicy(origins=(origin,), methods=("GET", "POST"), headers=("authorization",), credentials=True)
    app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100, api_keys=("k",), cors=strict)  # type: ignore[arg-type]
    pre, _, models, other = asyncio.run(go(app))
    assert pre.status_code == 200 and pre.headers["Access-Control-Allow-Origin"] == origin
    assert pre.headers["Access-Control-Allow-Credentials"] == "true" and pre.headers["Vary"] == "Origin"
    assert models.headers["Access-Control-Allow-Origin"] == origin and "X-Request-Id" not in models.headers
    assert "Access-Control-Allow-Origin" not in other.headers  # the browser withholds the answer

    async def refused(app) -> tuple[int, str]:
        r = await app.test_client().options("/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "DELETE"})
        return r.status_code, (await r.get_data()).decode()

    assert asyncio.run(refused(app)) == (400, "Disallowed CORS method")
    app = create_app(FailingEngine(), FakeTokenizer(), "fake", 100, cors=None)  # type: ignore[arg-type]
    assert "Access-Control-Allow-Origin" not in asyncio.run(go(app))[2].headers


def test_the_loading_gate_answers_preflights_and_its_503s_carry_the_cors_headers():
    """While the model loads, a browser page's preflight gets the policy's answer and the 503 it
    then gets carries Access-Control-Allow-Origin, so the page can read "still loading" (without
    it the browser reports a network error)."""
    from jaxserve.server.cors import CorsPolicy
    from jaxserve.server.loading import LoadingGate

    origin = "https://app.example"

    def call(gate: LoadingGate, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path,
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        asyncio.run(gate(scope, receive, send))
        start, body = sent
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body["body"]

    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    gate = LoadingGate(CorsPolicy())
    status, headers, _ = call(gate, "OPTIONS", "/v1/completions", preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    status, headers, body = call(gate, "POST", "/v1/completions", {"Origin": origin})
    assert status == 503 and headers["access-control-allow-origin"] == "*" and headers["retry-after"] == "5"
    assert json.loads(body)["error"]["message"] == "the model is still loading"
    assert call(gate, "GET", "/health", {"Origin": origin})[1]["access-control-allow-origin"] == "*"

    strict = LoadingGate(CorsPolicy(origins=(origin,), methods=("POST",)))
    assert call(strict, "OPTIONS", "/v1/completions", preflight)[1]["access-control-allow-origin"] == origin
    status, _, body = call(strict, "OPTIONS", "/v1/completions", preflight | {"Access-Control-Request-Method": "PUT"})
    assert (status, body) == (400, b"Disallowed CORS method")
    assert "access-control-allow-origin" not in call(strict, "POST", "/generate", {"Origin": "https://evil.example"})[1]
    # No policy (cors=None): no headers and an OPTIONS is just another 503.
    status, headers, _ = call(LoadingGate(None), "OPTIONS", "/v1/completions", preflight)
    assert status == 503 and "access-control-allow-origin" not in headers


def test_background_responses_get_the_shutdown_grace():
    """Hypercorn waits for connections only; a background response (which outlives its own) is
    waited for before the event loop would cancel it, within the shutdown timeout."""
    from jaxserve.server.app import finish_background, state_of

    async def go() -> tuple[list[int], float]:
        import time

        state = state_of(create_app(FailingEngine(), FakeTokenizer(), "fake", 100))  # type: ignore[arg-type]
        done: list[int] = []

        async def work(delay: float) -> None:
            await asyncio.sleep(delay)
            done.append(1)

        state.background_tasks.update({asyncio.create_task(work(0.2)), asyncio.create_task(work(60))})
        start = time.monotonic()
        await finish_background(state, shutdown_timeout=0.5)  # the drain's timer aborts what runs on
        return done, time.monotonic() - start

    done, waited = asyncio.run(go())
    assert done == [1] and 0.2 <= waited < 10
