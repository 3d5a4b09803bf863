"""Tokenizer: the model's HF fast tokenizer, sandboxed chat templates, incremental detokenizing.

Two rules shape this module:
- Text inside chat messages is never parsed into special tokens. Only the chat template may put
  them in; a user who types "<|im_end|>" in a message gets the characters, not the control token.
  A raw prompt (completions, /generate, Triton, offline strings) is different: its caller wrote
  the whole prompt, markup included, so special-token strings in it are the tokens, as HF, vLLM
  and SGLang parse them, unless the operator asks for them to stay text (`prompt_special_tokens`).
- Streaming never shows half a character: text is released only once its bytes are complete, and
  the concatenated stream equals the full decode of the same tokens.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPLACEMENT_CHAR = "\ufffd"
# Private-use code points mark user text inside a rendered template (see encode_chat).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK_RE = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or raised while rendering."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %} ... {% endgeneration %}` (it marks assistant text for training masks;
    vision-language templates such as LLaVA's use it): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    # Same options HF uses for chat templates, so templates render identically; the sandbox stops
    # a template (which comes from a checkpoint or a request) from reaching Python internals.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


# How raw prompts treat special-token strings (--prompt-special-tokens).
PROMPT_SPECIAL_TOKENS = ("parse", "text")


class Tokenizer:
    """A model's tokenizer: encode, decode, chat templates. Wraps a HF PreTrainedTokenizerFast.

    prompt_special_tokens: "parse" (special-token strings in a raw prompt are the tokens, as in HF,
    vLLM and SGLang) or "text" (they stay characters, as inside chat messages)."""

    def __init__(self, hf: Any, chat_template: str | None = None, prompt_special_tokens: str = "parse"):
        if prompt_special_tokens not in PROMPT_SPECIAL_TOKENS:
            raise ValueError(f"prompt_special_tokens must be one of {', '.join(PROMPT_SPECIAL_TOKENS)}, "
                             f"got {prompt_special_tokens!r}")
        self.hf = hf
        self.chat_template = chat_template or getattr(hf, "chat_template", None)
        self.prompt_special_tokens = prompt_special_tokens
        self.special_ids = frozenset(hf.all_special_ids) | frozenset(
            i for i, t in hf.added_tokens_decoder.items() if t.special
        )
        self._special_strings = sorted(
            (t.content for t in hf.added_tokens_decoder.values() if t.special), key=len, reverse=True
        )
        self._templates: dict[str, jinja2.Template] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of user text inside a larger prompt; special-token strings in it stay plain text."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt, written whole by its caller: special-token strings in it are
        the special tokens (HF's own `encode`), unless prompt_special_tokens is "text"."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens,
                              split_special_tokens=self.prompt_special_tokens == "text")

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """Token ids and token types of a text pair, as a cross-encoder reads it (HF's
        `tokenizer(first, second)`: [CLS] a [SEP] b [SEP] with types 0 then 1 for BERT). With
        max_length, the longer text is cut first until the pair fits (HF's longest_first)."""
        enc = self.hf(first, second, return_token_type_ids=True, truncation=max_length is not None,
                      max_length=max_length)
        ids = list(enc["input_ids"])
        return ids, list(enc.get("token_type_ids") or [0] * len(ids))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the chat template writes it. continue_final_message: the last
        message left open (no end-of-turn after its text), so the model continues it: a reply
        "prefilled" by the client, as HF's apply_chat_template and vLLM do it. documents: the
        template's `documents` (retrieved passages a RAG template such as Command-R's or
        Granite's lists), as HF passes them; a chat_template_kwargs "documents" wins, as in vLLM."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message continues the last message, and add_generation_prompt "
                                    "starts a new one: set add_generation_prompt to false")
        rendered = self._render(messages, add_generation_prompt, chat_template, chat_template_kwargs, tools, documents)
        return _open_final_message(rendered, messages) if continue_final_message else rendered

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, chat_template: str | None,
                chat_template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
                documents: list[dict[str, Any]] | None = None) -> str:
        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError("this model has no chat template; pass chat_template or use completions")
        compiled = self._templates.get(template)
        if compiled is None:
            try:
                compiled = _ENV.from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"invalid chat template: {e}") from e
            if len(self._templates) < 64:
                self._templates[template] = compiled
        variables = {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        variables["documents"] = documents
        variables.update(chat_template_kwargs or {})
        try:
            return compiled.render(
                **variables, messages=messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
        except Exception as e:  # any error inside a user-supplied template is the user's input error
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:  # kwargs: render_chat's
        """Render and tokenize a conversation. Special tokens come only from the template."""
        documents = kwargs.get("documents") or []
        if not any(self._holds_special(m) for m in messages) and not any(
                s in v for d in documents for v in d.values() if isinstance(v, str) for s in self._special_strings):
            # The common case: identical to HF's apply_chat_template(tokenize=True).
            return self.hf.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)
        # Some user text spells a special token. Render with placeholders in its place, then
        # tokenize template text with special tokens and user text without.
        texts: list[str] = []
        marked = [self._mark(m, texts) for m in messages]
        if documents:
            kwargs = {**kwargs, "documents": [{k: self._mark_text(v, texts) if isinstance(v, str) else v
                                               for k, v in d.items()} for d in documents]}
        rendered = self.render_chat(marked, **kwargs)
        ids: list[int] = []
        pos = 0
        for match in _MARK_RE.finditer(rendered):
            ids += self.hf.encode(rendered[pos : match.start()], add_special_tokens=False)
            ids += self.encode(texts[int(match.group(1))], add_special_tokens=False)
            pos = match.end()
        return ids + self.hf.encode(rendered[pos:], add_special_tokens=False)

    def _holds_special(self, message: dict[str, Any]) -> bool:
        return any(s in text for text in _texts(message) for s in self._special_strings)

    @staticmethod
    def _mark_text(text: str, texts: list[str]) -> str:
        texts.append(text)
        return f"{_MARK_OPEN}{len(texts) - 1}{_MARK_CLOSE}"

    def _mark(self, message: dict[str, Any], texts: list[str]) -> dict[str, Any]:
        def mark(text: str) -> str:
            return self._mark_text(text, texts)

        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": mark(content)}
        if isinstance(content, list):
            parts = [{**p, "text": mark(p["text"])} if isinstance(p.get("text"), str) else p for p in content]
            return {**message, "content": parts}
        return message

    # ---- decoding -------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        """Decode like HF's slow tokenizers do: text runs decoded together, special tokens kept
        (or skipped) as their own pieces, joined by a space when spaces_between_special_tokens."""
        ids = list(ids)
        specials = [i for i in ids if i in self.special_ids]
        if not specials or skip_special_tokens:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                if run:
                    pieces.append(self.hf.decode(run, clean_up_tokenization_spaces=False))
                    run = []
                pieces.append(self.hf.convert_ids_to_tokens(i))
            else:
                run.append(i)
        if run:
            pieces.append(self.hf.decode(run, clean_up_tokenization_spaces=False))
        return (" " if spaces_between_special_tokens else "").join(pieces)


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def load_tokenizer(
    directory: Path, gguf_file: str | None = None, chat_template: str | None = None, cache_dir: Path | None = None,
    prompt_special_tokens: str = "parse",
) -> Tokenizer:
    """The tokenizer of a HF directory, or the one embedded in a GGUF file's metadata.

    chat_template overrides the checkpoint's template (a template string or a path to a file).
    Building a tokenizer from GGUF metadata takes ~25 s for a 49k vocabulary, so with cache_dir
    the converted tokenizer is saved once (keyed by the file's size and mtime) and reloaded."""
    from transformers import AutoTokenizer

    if gguf_file is None:
        if not any((Path(directory) / name).is_file() for name in _TOKENIZER_FILES):
            # transformers' own error here blames sentencepiece, which is not what is missing.
            raise ValueError(f"{directory} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); add the "
                             "checkpoint's tokenizer files, or run on token ids with "
                             "jaxserve.LLM(..., skip_tokenizer_init=True)")
        hf = AutoTokenizer.from_pretrained(directory)
        embedded = None if getattr(hf, "chat_template", None) else _processor_template(Path(directory))
    else:
        path = Path(directory) / gguf_file
        cached = _gguf_tokenizer_cache(path, cache_dir)
        if cached is not None and (cached / _GGUF_META_FILE).exists():
            hf = AutoTokenizer.from_pretrained(cached)
            meta = json.loads((cached / _GGUF_META_FILE).read_text())
        else:
            hf, meta = _hf_tokenizer_from_gguf(path)
            if cached is not None:
                hf.save_pretrained(cached)
                (cached / _GGUF_META_FILE).write_text(json.dumps(meta))
        # transformers' GGUF conversion can mislabel special tokens (it names <|im_start|> as
        # SmolLM2's EOS); the file's own metadata is authoritative.
        for role in ("bos", "eos", "unk", "pad"):
            if meta.get(role) is not None and meta[role] < len(hf):
                setattr(hf, f"{role}_token", hf.convert_ids_to_tokens(meta[role]))
        embedded = meta.get("chat_template")
    if not hf.is_fast:
        raise ValueError(f"{directory}: only fast (tokenizers-backed) tokenizers are supported")
    if chat_template and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    elif chat_template and not any(mark in chat_template for mark in ("{{", "{%", "{#")):
        # No Jinja in it: a path that does not exist, not a template that would render itself as
        # every prompt (vLLM's rule).
        raise ValueError(f"chat template {chat_template!r} looks like a file path, but there is no such file")
    return Tokenizer(hf, chat_template or embedded or getattr(hf, "chat_template", None), prompt_special_tokens)


def _processor_template(directory: Path) -> str | None:
    """A vision-language checkpoint's chat template, which its processor keeps beside the
    tokenizer (chat_template.jinja, or chat_template.json's "chat_template")."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "chat_template.json").is_file():
        template = json.loads((directory / "chat_template.json").read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


_GGUF_META_FILE = "gguf_tokenizer_meta.json"
# Any one of these makes a HF directory's tokenizer loadable (fast, or converted from a slow one).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def _gguf_tokenizer_cache(path: Path, cache_dir: Path | None) -> Path | None:
    if cache_dir is None:
        return None
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / "tokenizers" / key


# GGUF general.architecture -> the transformers converter that builds its fast tokenizer.
_GGUF_TOKENIZER_MODELS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                          "gemma3": "gemma3_text", "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def _hf_tokenizer_from_gguf(path: Path) -> tuple[Any, dict[str, Any]]:
    """A fast tokenizer built from a GGUF file's metadata, and its special-token ids + template.

    transformers' own `from_pretrained(gguf_file=...)` imports its GGUF weight loader, which needs
    PyTorch -- a multi-GB dependency that serving never uses. Only its torch-free converters are
    used here, fed from gguf-py's reader."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from jaxserve.weights.gguf_file import field, open_gguf

    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch not in _GGUF_TOKENIZER_MODELS:
        raise ValueError(f"{path}: no tokenizer converter for GGUF architecture {arch!r}")
    if arch == "phi3" and field(reader, "tokenizer.ggml.model") != "llama":
        # Phi-4's byte-level BPE (tiktoken's pre-tokenizer): transformers' phi3 converter builds
        # Phi-3's SentencePiece vocabulary only.
        raise ValueError(f"{path}: no tokenizer converter for a phi3 GGUF with a "
                         f"{field(reader, 'tokenizer.ggml.model')!r} vocabulary (Phi-4's); serve the Hugging Face "
                         "checkpoint instead")
    wanted = {f"tokenizer.{key}" for renames in GGUF_TOKENIZER_MAPPING.values() for key in renames}
    metadata = {key: field(reader, key) for key in wanted if key in reader.fields}
    backend_dict = {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                    if f"tokenizer.{key}" in metadata}
    backend, extra = convert_gguf_tokenizer(_GGUF_TOKENIZER_MODELS[arch], backend_dict)
    meta: dict[str, Any] = {"chat_template": metadata.get("tokenizer.chat_template")}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        meta[role] = None if value is None else int(value)
    # The converter's own special-token guesses are replaced below from the file's ids.
    extra = {k: v for k, v in extra.items() if not k.endswith("_token")}
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **extra)
    hf.chat_template = meta["chat_template"]  # also saved with the converted tokenizer
    return hf, meta


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas for streaming.

    Each step decodes a short window of recent tokens twice (with and without the new ones) and
    emits the difference, so context-dependent decoding (leading spaces, merged byte tokens)
    matches a full decode. Text ending in U+FFFD is held back until the character's remaining
    bytes arrive. `finish()` releases whatever is still held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True, prompt_tail: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        # A few prompt tokens give the first output token its left context (e.g. whether a
        # sentencepiece "▁" turns into a space); they are never emitted.
        self.ids: list[int] = list(prompt_tail or [])
        self.first_output = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip, self.spaces)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly stable text (possibly empty)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if after.endswith(REPLACEMENT_CHAR) or not after.startswith(before):
            return ""  # wait for the rest of the character (or for a stable prefix)
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release held text: what the full decode of the output has beyond what was emitted."""
        full = self.output_text()
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def output_text(self) -> str:
        context = self._decode(self.ids[: self.first_output])
        whole = self._decode(self.ids)
        return whole[len(context) :] if whole.startswith(context) else self._decode(self.ids[self.first_output :])


class NoTextDetokenizer:
    """IncrementalDetokenizer's stand-in when there is no tokenizer (skip_tokenizer_init): outputs
    are token ids only, and their text stays empty."""

    text = ""

    def add(self, token_ids: Iterable[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""

    def output_text(self) -> str:
        return ""


def _open_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` cut right after the last message's text (HF's continue_final_message rule: its
    last occurrence, with the message's own trailing spaces when the template kept them)."""
    if not messages:
        raise ChatTemplateError("continue_final_message: there is no message to continue")
    content = messages[-1].get("content")
    if isinstance(content, (list, tuple)):
        texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message: the last message has no text to continue")
    at = rendered.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the last message's "
                                "text as it is, so there is no place to continue it from")
    # The message's trailing spaces stay where the template kept them; else they were trimmed.
    whole = rendered[at:at + len(content.lstrip())] == content
    kept = len(content.lstrip()) if whole else len(content.strip())
    return rendered[:at + kept]
