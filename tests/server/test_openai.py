"""The OpenAI routes on the live server, driven by the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

import jaxserve
from live_server import MODEL

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def test_completion_greedy(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text.startswith(" Paris.")
    assert choice.finish_reason == "length" and choice.index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 8, 13)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_equals_non_stream_and_usage(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_batch_of_prompts_n2_and_token_ids(client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("1, 2, 3,")
    r = client.completions.create(model=MODEL, prompt=[ids, smollm2_tokenizer.encode("Hello")], n=2, max_tokens=4,
                                  temperature=1.0, seed=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    first = [c for c in r.choices if c.index < 2]
    assert all(c.prompt_token_ids == ids and len(c.token_ids) == 4 for c in first)
    assert r.usage.completion_tokens == 16


def test_completion_logprobs_legacy_shape(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4 and top[tok] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token


def test_completion_echo_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                  stop=["answer"], echo=True)
    c = r.choices[0]
    assert c.text == "The capital of France is Paris.\n\nThe "
    assert c.finish_reason == "stop" and c.stop_reason == "answer"
    kept = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                     stop=["answer"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris.\n\nThe answer"


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=99, **kwargs).choices[0].text
    assert a == b != c


def test_chat_non_stream_and_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", "The answer to this classic math problem is 4.")
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt again: full pages from the cache


def test_chat_n2_logprobs_and_content_parts(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=5, temperature=1.0, seed=5,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == len(c.message.content and content) and len(content) >= 1
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes == list(t.token.encode())
                   for t in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=3, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role) == [0, 1]
    # Each choice ends once, in its last chunk, though the other may still be running.
    ends = [(i, c.choices[0].index) for i, c in enumerate(chunks) if c.choices[0].finish_reason is not None]
    assert sorted(index for _, index in ends) == [0, 1]
    assert all(not any(c.choices[0].index == index for c in chunks[i + 1:]) for i, index in ends)


def test_chat_template_kwargs_and_return_token_ids(server, smollm2_tokenizer):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            "add_generation_prompt": False, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["prompt_token_ids"] == smollm2_tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]


def test_v3_routes_models_health(server):
    r = httpx.post(server.url + "/v3/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert (m["id"], m["object"], m["owned_by"], m["max_model_len"]) == (MODEL, "model", "jaxserve", 512)
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenize_detokenize(server, smollm2_tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == smollm2_tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == smollm2_tokenizer.encode_chat(CHAT)
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    # A chat prompt's template markers come back too: /detokenize undoes /tokenize (vLLM's).
    marked = "<|im_start|>user\nHello<|im_end|>\n"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": marked, "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": marked}


def test_metrics_move(server, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    before = scrape()
    client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape()
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] == 3
    assert after["jaxserve:prompt_tokens_total"] > before["jaxserve:prompt_tokens_total"]
    key = 'jaxserve:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    ttft = "jaxserve:time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["jaxserve:e2e_request_latency_seconds_count"] > 0
    assert "jaxserve:num_requests_running" in after and "jaxserve:kv_cache_usage_perc" in after
    # A prefill and at least one decode call, each timed by the dispatcher.
    assert after["jaxserve:step_calls_total"] - before["jaxserve:step_calls_total"] >= 2
    assert after["jaxserve:step_call_seconds_total"] > before["jaxserve:step_call_seconds_total"]
    assert after["jaxserve:step_handover_seconds_total"] >= before["jaxserve:step_handover_seconds_total"]


def test_vllm_sampling_extras(client, smollm2_tokenizer):
    bang = smollm2_tokenizer.encode("!", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logit_bias={str(bang): 100})
    assert r.choices[0].text == "!!!"
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0.7, top_p=0.9, seed=1, user="u", presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 2, "repetition_penalty": 1.1,
                                           "skip_special_tokens": False, "spaces_between_special_tokens": False,
                                           "stop_token_ids": [smollm2_tokenizer.eos_token_id]})
    assert 2 <= r.usage.completion_tokens <= 4


def test_openai_docs_function_calling_request(client):
    # OpenAI's function-calling example: tools reach the chat template; a server without
    # --tool-call-parser does not read calls, so the model's text comes back as content.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
    messages = [{"role": "developer", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather like in Boston today?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=4)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 4


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=3, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3 and all(c.usage.prompt_tokens > 0 for c in chunks)


@pytest.mark.parametrize("prompt", ["The capital of France is", "Hi<|im_end|>\nThe capital of France is"])
def test_completion_echo_with_logprobs_covers_the_prompt(client, smollm2_tokenizer, prompt):
    """echo + logprobs: the prompt's tokens get logprobs too (the first one has none), and the echo
    is the prompt as sent, special tokens too, so that text_offset indexes it."""
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    c = client.completions.create(**kwargs).choices[0]
    lp = c.logprobs
    assert c.finish_reason == "length"
    n_prompt = len(lp.tokens) - 3  # the server parses "<|im_end|>" as the special token
    assert len(lp.token_logprobs) == len(lp.tokens) and n_prompt == (5 if "<|" not in prompt else 8)
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    assert "".join(lp.tokens) == c.text and c.text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(prompt)
    streamed = [ch for ch in client.completions.create(**kwargs, stream=True) if ch.choices]
    tokens = [t for ch in streamed if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    values = [v for ch in streamed if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_field(client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("One, two, three,")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and entry[str(tid)]["logprob"] <= 0 and 1 <= len(entry) <= 2
    # vLLM's rank: the prompt token's place in the whole vocabulary, the top alternatives 1..k; it
    # agrees with the top 5 wherever the token is among them, and is worse than 5 where it is not.
    five = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 5}).choices[0].model_extra["prompt_logprobs"]
    outside = 0
    for tid, entry in zip(ids[1:], five[1:]):
        own = entry[str(tid)]
        others = [e for k, e in entry.items() if k != str(tid)]
        assert sorted(e["rank"] for e in others) == [r for r in range(1, 6) if r != own["rank"]][:len(others)]
        better = sum(e["logprob"] > own["logprob"] for e in others)
        if own["rank"] <= 5:
            assert own["rank"] == better + 1, entry
        else:
            outside += 1
            assert better == 5 and all(e["logprob"] >= own["logprob"] for e in others), entry
    assert outside > 0  # some prompt token here is outside the model's top 5


def test_chat_prompt_token_ids_and_disable_chat_template(client, smollm2_tokenizer):
    templated = smollm2_tokenizer.encode_chat(CHAT)
    base = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
    message = base.choices[0].message.model_extra
    assert message["prompt_token_ids"] == templated and message["completion_token_ids"] == base.choices[0].token_ids
    by_ids = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ignored"}],
                                            max_tokens=6, temperature=0,
                                            extra_body={"prompt_token_ids": templated})
    assert by_ids.choices[0].message.content == base.choices[0].message.content
    assert by_ids.usage.prompt_tokens == len(templated)
    raw = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The capital of France is"}],
                                         max_tokens=3, temperature=0, extra_body={"disable_chat_template": True})
    assert raw.usage.prompt_tokens == len(smollm2_tokenizer.encode("The capital of France is"))
    assert raw.choices[0].message.content.startswith(" Paris")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, smollm2_tokenizer):
    """vLLM's truncate_prompt_tokens on completions and chat: the prompt's last k tokens are the
    prompt (same greedy answer as sending them), -1 keeps up to the context, and 0 or more than
    the context is a 400 naming it."""
    ids = smollm2_tokenizer.encode("Apples are red. Bananas are yellow. The capital of France is")
    kept = ids[-8:]
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 8, "return_token_ids": True})
    direct = client.completions.create(model=MODEL, prompt=kept, max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].model_extra["prompt_token_ids"] == kept
    assert cut.choices[0].text == direct.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    templated = smollm2_tokenizer.encode_chat(CHAT)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert chat.usage.prompt_tokens == 5 and chat.model_extra["prompt_token_ids"] == templated[-5:]
    for bad in (0, -2, 10**6):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens", e.value.body


def test_model_retrieve_version_server_info_and_prefix_cache_flush(server, client):
    """OpenAI's models.retrieve (also under /v3, OVMS's), vLLM's /version and /reset_prefix_cache,
    SGLang's /get_server_info and /flush_cache; preemptions count as a Prometheus counter."""
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(server.url + "/v3/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + f"/v3/models/{MODEL}").json()["max_model_len"] == 512
    assert httpx.get(server.url + "/version").json() == {"version": jaxserve.__version__}
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["max_model_len"] == 512 and info["page_size"] >= 1 and info["version"] == jaxserve.__version__

    def cached(prompt: str) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    prompt = "Flush test. " + "one two three four five six seven eight " * 8
    cached(prompt)
    assert cached(prompt) > 0  # the prefix cache holds the prompt's full pages
    flushed = httpx.post(server.url + "/flush_cache")
    assert flushed.status_code == 200 and not flushed.text.startswith("Cache flushed: 0 "), flushed.text
    assert cached(prompt) == 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    assert cached(prompt) == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert "# TYPE jaxserve:num_preemptions_total counter" in metrics


def test_allowed_token_ids_restrict_every_sampled_token(client, smollm2_tokenizer):
    """vLLM's allowed_token_ids: sampled and greedy outputs use only the listed tokens (here with
    no end token among them, so every output runs to max_tokens); combined with a constraint, the
    intersection; refused outside the vocabulary and with beam search, naming it."""
    allowed = sorted({smollm2_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")})
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=6, n=3, seed=4,
                                  temperature=1.0, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    for choice in r.choices:
        assert set(choice.token_ids) <= set(allowed) and len(choice.token_ids) == 6, choice
    greedy = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=1, temperature=0,
                                       logprobs=20, extra_body={"allowed_token_ids": allowed,
                                                                "return_token_ids": True}).choices[0]
    # The greedy pick is the most likely allowed token under the raw distribution.
    top = greedy.logprobs.top_logprobs[0]
    ranked = [t for t in top if t in {smollm2_tokenizer.decode([i]) for i in allowed}]
    assert greedy.token_ids[0] in allowed and (not ranked or smollm2_tokenizer.decode(greedy.token_ids) == ranked[0])
    chosen = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                            extra_body={"allowed_token_ids": allowed, "guided_choice": [" no"]})
    # The choice complete, the output ends although no end token is listed.
    assert (chosen.choices[0].message.content, chosen.choices[0].finish_reason) == (" no", "stop")
    for body, param in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                        ({"allowed_token_ids": allowed, "use_beam_search": True, "n": 2}, "allowed_token_ids")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=body)
        assert e.value.body["param"] == param, e.value.body


def test_continue_final_message_prefills_the_reply(client, server, smollm2_tokenizer):
    """vLLM's continue_final_message: the assistant's last message is continued, not answered;
    the same greedy tokens as completing the rendered prefix by hand; /tokenize renders the same."""
    messages = CHAT + [{"role": "assistant", "content": "The answer is"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "return_token_ids": True})
    prefix = smollm2_tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert r.model_extra["prompt_token_ids"] == prefix
    by_hand = client.completions.create(model=MODEL, prompt=prefix, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == by_hand.choices[0].text
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                        "continue_final_message": True}).json()["tokens"]
    assert tokens == prefix
    with pytest.raises(openai.BadRequestError) as e:  # add_generation_prompt defaults to true, as in vLLM
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_documents_reach_a_rag_template(client, server, smollm2_tokenizer):
    """vLLM's `documents` go to the chat template; the prompt is HF's rendering of them (the
    tokenizer's own test compares it with apply_chat_template); /tokenize renders the same."""
    from chat_templates import RAG_TEMPLATE

    documents = [{"title": "Tower", "text": "The tower is in Paris."}]
    body = {"chat_template": RAG_TEMPLATE, "documents": documents}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                       extra_body=body | {"return_token_ids": True})
    expected = smollm2_tokenizer.encode_chat(CHAT, chat_template=RAG_TEMPLATE, documents=documents)
    assert r.model_extra["prompt_token_ids"] == expected
    assert "Tower: The tower is in Paris." in smollm2_tokenizer.decode(expected)
    tokens = httpx.post(server.url + "/tokenize", json={"messages": CHAT} | body).json()["tokens"]
    assert tokens == expected
    for extra, message in [({"documents": [{"title": 3}]}, "documents"),
                           ({"documents": documents, "prompt_token_ids": [1, 2]}, "bypasses"),
                           ({"documents": documents, "disable_chat_template": True}, "bypasses")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == "documents" and message in e.value.body["message"], e.value.body
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hi", "documents": documents})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_return_tokens_as_token_ids(client):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens as "token_id:N", whole and streamed."""
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                          "return_token_ids": True}).choices[0]
    assert r.logprobs.tokens == [f"token_id:{t}" for t in r.token_ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in r.logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                         logprobs=0, stream=True, extra_body={"return_tokens_as_token_ids": True})
    assert [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])
            ] == r.logprobs.tokens
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=1, extra_body={"return_tokens_as_token_ids": True,
                                                                      "return_token_ids": True}).choices[0]
    assert [c.token for c in chat.logprobs.content] == [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert chat.logprobs.content[0].bytes == list(chat.logprobs.content[0].token.encode())


def test_cache_salt_keeps_tenants_prefix_caches_apart(client):
    """vLLM's cache_salt: a prompt cached without a salt (or under another) is no hit; the same salt
    hits, as does no salt for the unsalted copy."""
    prompt = "Salt test. " + "alpha beta gamma delta epsilon zeta eta theta " * 8

    def cached(**extra) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


def test_request_ids_and_chat_echo(client, server):
    """vLLM's request_id (and the X-Request-Id header, which wins) name the response; chat `echo`
    puts a continued assistant message before its continuation, whole and streamed."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "abc123"})
    assert r.id == "cmpl-abc123"
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"request_id": "q1"},
                                       extra_headers={"X-Request-Id": "from-header"})
    assert r.id == "chatcmpl-from-header"
    messages = CHAT + [{"role": "assistant", "content": "The answer is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=extra)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={**extra, "echo": False})
    assert whole.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body=extra, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    # A last message from the user is not echoed (only the assistant's is continued).
    user_last = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                               extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith(CHAT[0]["content"])
