"""Pydantic models of OpenAI's completions and chat requests, with vLLM's extra sampling fields.

Strict types (no "0.5" for a float). A field no model declares is refused with a 400 naming it,
unless jaxserve.server.accepted_fields lists it as accepted and ignored (`user`, `store`,
FastDeploy's `mm_hashes`, ...); declared fields we know and cannot honour yet are refused by the
route, with the reason.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine.request import MAX_TOP_LOGPROBS
from jaxserve.server import accepted_fields
from jaxserve.server.accepted_fields import KnownFields

MAX_SEED = 922337203685477580  # FastDeploy's `seed` bound


class _Strict(KnownFields):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # OpenAI's stream padding: none is sent, so true is refused


class SamplingFields(_Strict):
    """Fields completions and chat share (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # FastDeploy's documented bound (its chat and completions docs); vLLM's int64 range is wider.
    seed: int | None = Field(default=None, le=MAX_SEED)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored (accepted_fields)
    # vLLM extras
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache pages shared only among requests with the same salt
    # vLLM's: the response's id is "cmpl-"/"chatcmpl-" + this (an X-Request-Id header wins, as in vLLM).
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # vLLM's; None: the server's --return-tokens-as-token-ids
    priority: int = 0
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); nothing is cut
    # unless asked.
    truncate_prompt_tokens: int | None = None
    # Beam search (vLLM's spelling; on /v3 best_of > 1 alone asks for it, as OVMS does).
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # OVMS's speculative decoding: prompt lookup (served with --speculative-method ngram) takes
    # num_assistant_tokens and max_ngram_size; a draft model (--speculative-model) takes
    # num_assistant_tokens or assistant_confidence_threshold (the engine refuses what its method
    # does not use; sampling.refuse_unhonoured the two together).
    num_assistant_tokens: int | None = None
    max_ngram_size: int | None = None
    assistant_confidence_threshold: float | None = None
    # Structured output (jaxserve.structured); checked by openai.guide_spec.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None  # a regex for the whitespace JSON output may hold
    structured_outputs: Any = None
    response_format: Any = None


class CompletionRequest(SamplingFields):
    IGNORED = accepted_fields.OPENAI_COMPLETIONS
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: base64 of torch.save'd [tokens, hidden] tensors (or .npy), one prompt each.
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (reasoning_content, ...) pass through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    IGNORED = accepted_fields.OPENAI_CHAT
    REFUSED = accepted_fields.OPENAI_CHAT_REFUSED
    # FastDeploy also takes the prompt as token ids here (`Union[List[Any], List[int]]`).
    messages: list[ChatMessage] | list[int] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: passages for a RAG chat template (Command-R's, Granite's), given to it as `documents`.
    documents: list[dict[str, str]] | None = None
    # vLLM's: this request's image processor options (Qwen2-VL's min_pixels / max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None  # OpenAI's output kinds: text is the one made here
    # FastDeploy's cap on a reasoning model's think section: `</think>` is forced after this many
    # tokens (jaxserve.structured.reasoning_cap); needs --reasoning-parser.
    reasoning_max_tokens: int | None = None
    # Bypass the template: prompt_token_ids are the prompt as given; disable_chat_template
    # concatenates the messages' text (tokenized as user text: no special tokens from it).
    disable_chat_template: bool = False
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    # vLLM's: the last message's text before the reply when it is the assistant's (a continued
    # message shown whole), and whether a reasoning model's thinking comes back (reasoning_content).
    echo: bool = False
    include_reasoning: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
