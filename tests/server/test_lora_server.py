"""LoRA adapters through a real server (SmolLM2, real port, the official openai client): a server
started with --lora-modules answers a request naming an adapter exactly as the `peft` library's
model of that adapter decodes (greedy), on OpenAI completions and chat (whole and streamed),
SGLang's lora_path and Triton's model name; the base model's answers do not change beside them;
/v1/models lists the adapters; unknown adapters are refused by name. With --enable-lora, vLLM's
and SGLang's load/unload routes add and remove adapters while serving; more adapters than slots
take turns in them, and a pinned one keeps its own."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from live_server import MAX_MODEL_LEN, MODEL, small_engine, start_server
from lora_adapters import make_adapter

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.app import create_app
from jaxserve.server.model_names import ModelNames
from jaxserve.weights.lora_adapter import LoraModuleSpec

pytestmark = pytest.mark.slow

PROMPT = "The three most useful SQL commands are"
TOKENS = 24


@pytest.fixture(scope="module")
def adapters(hf_smollm2, tmp_path_factory):
    """name -> (directory, PEFT model): small random factors, which change SmolLM2's answers
    without turning them into noise."""
    out = {}
    for i, name in enumerate(("sql", "poet")):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, make_adapter(hf_smollm2, name, path, seed=20 + i, scale=0.05))
    return out


@pytest.fixture(scope="module")
def lora_server(cache_dir, smollm2_tokenizer, adapters):
    specs = tuple(LoraModuleSpec(name, path) for name, (path, _) in adapters.items())
    # One bucket of each kind: the adapters' steps are programs of their own, each a compile.
    # Two slots for up to three adapters: a third one loaded takes turns with them.
    engine = AsyncEngine(small_engine(cache_dir, lora_modules=specs, enable_lora=True, max_loras=2, max_cpu_loras=3,
                                      decode_buckets=(8,), prefill_buckets=(64,)))
    names = ModelNames((MODEL,), adapters=tuple((s.name, str(s.path), None) for s in specs))
    live = start_server(create_app(engine, smollm2_tokenizer, names, MAX_MODEL_LEN, runtime_lora=True))
    yield live
    live.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    import openai

    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _peft_text(model: torch.nn.Module, tokenizer, prompt_ids: list[int]) -> str:
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                             pad_token_id=0)
    return tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


def test_completions_and_chat_decode_as_peft(lora_client, client, adapters, smollm2_tokenizer):
    tok = smollm2_tokenizer
    base = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    texts = {}
    for name, (_, peft_model) in adapters.items():
        out = lora_client.completions.create(model=name, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
        assert out.model == name
        texts[name] = out.choices[0].text
        assert texts[name] == _peft_text(peft_model, tok, tok.encode(PROMPT))
        assert texts[name] != base.choices[0].text
    assert texts["sql"] != texts["poet"]
    # The base model beside the adapters: the plain server's answer.
    same = lora_client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    assert same.model == MODEL and same.choices[0].text == base.choices[0].text

    messages = [{"role": "user", "content": "Write one line about the sea."}]
    chat = lora_client.chat.completions.create(model="poet", messages=messages, temperature=0, max_tokens=TOKENS)
    assert chat.model == "poet"
    assert chat.choices[0].message.content == _peft_text(adapters["poet"][1], tok, tok.encode_chat(messages))
    stream = lora_client.chat.completions.create(model="poet", messages=messages, temperature=0, max_tokens=TOKENS,
                                                 stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"poet"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    # The Responses API renders the same chat: the same reply, reported under the adapter's name.
    response = lora_client.responses.create(model="poet", input=messages[0]["content"], temperature=0,
                                            max_output_tokens=TOKENS)
    assert response.model == "poet" and response.output_text == chat.choices[0].message.content


def test_models_sglang_triton_and_refusals(lora_server, lora_client, adapters):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert list(cards) == [MODEL, "sql", "poet"]
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters["sql"][0])
    url = lora_server.url
    ref = lora_client.completions.create(model="sql", prompt=PROMPT, temperature=0, max_tokens=TOKENS).choices[0].text
    base = lora_client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS).choices[0].text
    sampling = {"temperature": 0, "max_new_tokens": TOKENS}
    one = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": sampling, "lora_path": "sql"},
                     timeout=120).json()
    assert one["text"] == ref
    by_path = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": sampling,
                                                  "lora_path": str(adapters["sql"][0])}, timeout=120).json()
    assert by_path["text"] == ref
    batch = httpx.post(url + "/generate", json={"text": [PROMPT, PROMPT], "sampling_params": sampling,
                                                "lora_path": [None, "sql"]}, timeout=120).json()
    assert [item["text"] for item in batch] == [base, ref]
    triton = httpx.post(url + "/v2/models/sql/generate", json={"text_input": PROMPT, "parameters": {
        "temperature": 0, "max_tokens": TOKENS, "exclude_input_in_output": True}}, timeout=120).json()
    assert triton["model_name"] == "sql" and triton["text_output"] == ref

    metrics = httpx.get(url + "/metrics", timeout=30).text  # vLLM's info gauge, for LoRA-aware routers
    assert 'jaxserve:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    bad = httpx.post(url + "/generate", json={"text": PROMPT, "lora_path": "nope"}, timeout=30)
    assert bad.status_code == 400 and "lora_path" in bad.text and "sql, poet" in bad.text
    bad = httpx.post(url + "/generate", json={"text": [PROMPT], "lora_path": ["sql", "x"]}, timeout=30)
    assert bad.status_code == 400 and "lora_path" in bad.text
    bad = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": PROMPT}, timeout=30)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    # An adapter shares the tokenizer; it has no classification head.
    tokens = httpx.post(url + "/tokenize", json={"model": "sql", "prompt": PROMPT}, timeout=30).json()["tokens"]
    assert tokens == httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()["tokens"]
    bad = httpx.post(url + "/v1/classify", json={"model": "sql", "input": PROMPT}, timeout=30)
    assert bad.status_code == 400


def test_load_and_unload_while_serving(lora_server, lora_client, client, adapters):
    url = lora_server.url
    ref = lora_client.completions.create(model="sql", prompt=PROMPT, temperature=0, max_tokens=TOKENS).choices[0].text
    poet_ref = lora_client.completions.create(model="poet", prompt=PROMPT, temperature=0,
                                              max_tokens=TOKENS).choices[0].text
    # vLLM's route: the sql adapter's files under a new name, a third adapter for the two slots.
    done = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(adapters["sql"][0])},
                      timeout=120)
    assert done.status_code == 200 and done.text == "Success: LoRA adapter 'sql2' added successfully."
    assert [m.id for m in lora_client.models.list().data] == [MODEL, "sql", "poet", "sql2"]
    out = lora_client.completions.create(model="sql2", prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    assert out.model == "sql2" and out.choices[0].text == ref
    # All three at once, twice each, and the base model: they take turns in the two slots, each
    # answer its own adapter's.
    jobs = ["sql", "poet", "sql2", MODEL] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda m: lora_client.completions.create(model=m, prompt=PROMPT, temperature=0,
                                                                       max_tokens=TOKENS).choices[0].text, jobs))
    base = lora_client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS).choices[0].text
    assert texts == [ref, poet_ref, ref, base] * 2
    # SGLang's route: a fourth adapter (--max-cpu-loras 3), then a bad path, each refused with
    # the loaded adapters.
    full = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["poet"][0])},
                      timeout=120)
    assert full.status_code == 400 and not full.json()["success"] and "--max-cpu-loras" in full.json()["error_message"]
    assert set(full.json()["loaded_adapters"]) == {"sql", "poet", "sql2"}
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/nowhere",
                                                          "load_inplace": True}, timeout=120)
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    # load_inplace: sql2 replaced by the poet's files.
    done = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(adapters["poet"][0]),
                                                           "load_inplace": True}, timeout=120)
    assert done.status_code == 200
    poet = lora_client.completions.create(model="poet", prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    again = lora_client.completions.create(model="sql2", prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    assert again.choices[0].text == poet.choices[0].text
    gone = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "sql2"}, timeout=120).json()
    assert gone["success"] and set(gone["loaded_adapters"]) == {"sql", "poet"}
    # SGLang's pinned: it keeps one slot, and sql and poet take turns in the other.
    pinned = httpx.post(url + "/load_lora_adapter", json={"lora_name": "pin", "lora_path": str(adapters["poet"][0]),
                                                          "pinned": True}, timeout=120).json()
    assert pinned["success"], pinned
    jobs = ["sql", "poet", "pin", "sql"]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda m: lora_client.completions.create(model=m, prompt=PROMPT, temperature=0,
                                                                       max_tokens=TOKENS).choices[0].text, jobs))
    assert texts == [ref, poet_ref, poet_ref, ref]
    # A second pin would leave sql no slot to take turns in (poet unloaded for room: --max-cpu-loras 3).
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "poet"}, timeout=120).json()["success"]
    second = httpx.post(url + "/load_lora_adapter", json={"lora_name": "pin2", "lora_path": str(adapters["sql"][0]),
                                                          "pinned": True}, timeout=120).json()
    assert not second["success"] and "are pinned already" in second["error_message"]
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "pin"}, timeout=120).json()["success"]
    missing = httpx.post(url + "/v1/completions", json={"model": "sql2", "prompt": PROMPT}, timeout=30)
    assert missing.status_code == 404
    twice = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}, timeout=30)
    assert twice.status_code == 404 and "no LoRA adapter named 'sql2'" in twice.text
    typo = httpx.post(url + "/unload_lora_adapter", json={"lora": "sql"}, timeout=30)  # SGLang's shape, for errors too
    assert typo.status_code == 400 and not typo.json()["success"] and "lora" in typo.json()["error_message"]
    clash = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "/x"}, timeout=30)
    assert clash.status_code == 400 and "name of the served model" in clash.text
    # The plain server has no --enable-lora: its routes say so.
    off = httpx.post(client.base_url.join("/v1/load_lora_adapter").__str__(),
                     json={"lora_name": "a", "lora_path": "/x"}, timeout=30)
    assert off.status_code == 400 and "--enable-lora" in off.text
