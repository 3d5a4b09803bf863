"""What the server may know of the engine, without reaching into it (no jax).

`EngineInfo` is fixed at start-up; `Stats` is a snapshot the engine thread publishes after every
step (one attribute assignment, so a reader on the event loop always sees a whole, consistent
snapshot, at most one step old).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    architecture: str  # the checkpoint's (e.g. LlamaForCausalLM)
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_model_len: int
    max_n: int  # most samples (n / best_of) per request
    max_num_seqs: int
    page_size: int
    num_pages: int
    decode_steps: int  # most decode iterations one device step runs
    # Speculative decoding: "ngram" (prompt lookup), "draft" (a draft model) or None (off); the
    # draft tokens a verify step checks per row (per-request num_assistant_tokens may ask fewer),
    # and the longest n-gram matched by default (per-request max_ngram_size).
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    max_ngram_size: int = 0
    # A request that sets neither num_assistant_tokens nor assistant_confidence_threshold gets these
    # (the deployment's defaults: generation_config.json, as OVMS reads it).
    default_assistant_tokens: int | None = None
    default_confidence_threshold: float | None = None
    # Embedding inputs (jaxserve.engine.embeds): the hidden size client embeddings must have (0: the
    # server takes none: --enable-prompt-embeds is off), and whether a vision encoder takes images.
    embed_dim: int = 0
    accepts_images: bool = False
    # LoRA adapters (jaxserve.engine.lora_slots): how many can be loaded at once, of what rank at
    # most (0: the model has no adapter slots).
    max_loras: int = 0
    max_lora_rank: int = 0


@dataclasses.dataclass(frozen=True)
class Stats:
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting for admission
    num_used_pages: int = 0
    num_usable_pages: int = 1
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served by the prefix cache / tokens looked up
    num_preemptions: int = 0  # sequences preempted (recomputed) so far
    num_steps: int = 0  # device steps run so far
    num_draft_tokens: int = 0  # speculative tokens proposed so far (all requests)
    num_accepted_draft_tokens: int = 0  # of which the verify steps accepted
    # The dispatch thread's step calls (jaxserve.engine.core._Dispatcher): how many, the seconds
    # inside them, and the seconds from one's return to the start of the next already waiting.
    step_calls: int = 0
    step_call_seconds: float = 0.0
    step_handover_seconds: float = 0.0
    request_ids: frozenset[str] = frozenset()  # requests in the engine
    # LoRA adapters the running and the waiting sequences decode with (vLLM's lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_pages / max(1, self.num_usable_pages)
