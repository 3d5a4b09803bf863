"""Engine: requests in, output deltas out. Ties the scheduler (host), the runner (device) and
the per-sequence text state together; one `step()` is one engine iteration."""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
from flax import nnx

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.kv_cache import bytes_per_page, num_pages_for
from jaxserve.engine.output import CompletionOutput, RequestOutput, SequenceText, TokenLogprob
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import (
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    Sequence,
)
from jaxserve.engine.runner import Bucket, ModelRunner, build_inputs
from jaxserve.engine.sampler import MAX_BANNED_IDS, RowParams, make_sampling_batch, mask_words
from jaxserve.engine.scheduler import Scheduler
from jaxserve.models.decoder import Decoder
from jaxserve.parallel import ShardingPlan, mesh_of
from jaxserve.parallel.multihost import StepChannel, is_leader, smallest_over_processes, to_host
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: str = "reference"  # reference | pallas_gpu | pallas_tpu | cpu (auto resolved by the caller)
    matmul_backend: str = "xla"  # xla | cpu (auto resolved by the caller: jaxserve.models.products)
    max_n: int = 128  # most samples (n / best_of) per request
    compilation_cache_dir: Path | None = None
    layer_loop: str = "auto"  # auto | scan | unrolled (see resolve_layer_loop)
    # Start step N+1 before turning step N's tokens into text (see Engine.step); False runs each
    # step to the end before the next starts (same tokens and text, for measuring the overlap).
    overlap: bool = True


LAYER_LOOPS = ("auto", "scan", "unrolled")


def resolve_layer_loop(choice: str, platform: str | None = None) -> str:
    """How the steps run the layers. "scan" compiles one layer body, but XLA on CPUs and GPUs
    copies every layer's weights out of the stack on every step (on an H100 the Llama-3-8B decode
    step ran at 3.3x its memory floor because of it); "unrolled" reads one weight buffer per layer
    in place and compiles every layer. On the CPU the copy costs no measurable time and unrolling
    costs 5-10x the compile time, so auto is the scan; it stays the scan on GPUs until unrolling
    has been timed on one (benchmarks/step_profile.py --layer-loop unrolled), and TPUs fuse the
    slice into the matmul anyway. `platform` is accepted for when the choice differs by device."""
    if choice not in LAYER_LOOPS:
        raise ValueError(f"--layer-loop must be one of {', '.join(LAYER_LOOPS)}, got {choice!r}")
    return "scan" if choice == "auto" else choice


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[SequenceText]
    arrival: float
    # prompt_logprobs[i]: logprob of prompt token i given the tokens before it (None before the
    # requested start and for token 0); filled by sample 0's prefill, sent once with its first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose results have not been read: sampled (sequence, output, row) and
    the prefill chunks whose prompt logprobs it computes."""

    sampled: list[tuple[Sequence, Any, int]]
    prompt_logprobs: list[tuple[list, list, Any]]  # (chunks, targets, PromptLogprobs output)


@dataclasses.dataclass
class _Accepted:
    """One sampled token taken into its sequence, waiting for its text (Engine._emit)."""

    seq: Sequence
    token: int | None  # None: the grammar stopped the sequence (its final delta is still due)
    out: Any = None  # the step's host output, for the logprobs
    row: int = 0
    reason: FinishReason | None = None  # EOS, stop token or length, decided when the token was taken
    past_min: bool = False  # min_tokens reached: stop strings may end the sequence


def enable_compilation_cache(directory: Path) -> None:
    """JAX's persistent compilation cache: a warm start-up reads compiled steps from disk."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        if config.compilation_cache_dir is not None:
            enable_compilation_cache(config.compilation_cache_dir)
        self.cfg = decoder.cfg
        self.tokenizer = tokenizer
        self.config = config
        sched = config.scheduler
        if sched.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {sched.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.cfg.max_position_embeddings}"
            )
        page_size = config.cache.page_size
        self.layer_loop = resolve_layer_loop(config.layer_loop)
        if self.layer_loop == "unrolled":
            decoder.unstack_layers()  # the engine owns the weights' layout from here on
        self.vocab_size = self.cfg.vocab_size
        mesh = mesh_of(nnx.state(decoder))
        kv_shards = ShardingPlan(mesh, self.cfg).kv_shards if mesh is not None else 1
        self.buckets = BucketTable(sched)
        self.max_pages_per_seq = math.ceil(sched.max_model_len / page_size)
        device = jax.local_devices()[0]
        reserve = 0
        if config.cache.num_pages is None and device.platform != "cpu":
            reserve = self._step_scratch_bytes(decoder)
        # Every process of a multi-host job must build the same cache: the smallest budget wins.
        num_pages = smallest_over_processes(
            num_pages_for(config.cache, self.cfg, decoder.dtype, device, kv_shards, reserve))
        log.info("KV cache: %d pages = %d tokens (%.1f MiB%s)", num_pages, num_pages * page_size,
                 num_pages * bytes_per_page(self.cfg, page_size, decoder.dtype) / kv_shards / 2**20,
                 f" per device, split {kv_shards} ways" if kv_shards > 1 else "")
        self.allocator = PageAllocator(num_pages, page_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.allocator, page_size)
        self.runner = ModelRunner(decoder, num_pages, page_size, self.max_pages_per_seq,
                                  attention_backend=config.attention_backend, matmul_backend=config.matmul_backend)
        if jax.process_count() > 1:
            # Multi-host: process 0 sends every step to the others (jaxserve.parallel.multihost).
            self.runner.channel = StepChannel(
                self.step_buckets(), lambda b: self.runner.abstract_inputs(b, self._sampling([], b.seqs)))
        self.eos_ids = set(self.cfg.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
        self.requests: dict[str, _Request] = {}
        self.compile_seconds: dict[Bucket, float] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._in_flight: _InFlight | None = None

    # ---- start-up ------------------------------------------------------------------------------
    def _step_scratch_bytes(self, decoder: Decoder) -> int:
        """The most scratch (temp) memory one step needs, read from XLA's memory analysis of the
        largest prefill and decode steps compiled against a tiny cache. The KV cache is sized from
        what is left, so a step can never run out of memory mid-serving (vLLM profiles a forward
        pass for the same reason)."""
        probe = ModelRunner(decoder, self.max_pages_per_seq + 1, self.config.cache.page_size,
                            self.max_pages_per_seq, attention_backend=self.config.attention_backend,
                            matmul_backend=self.config.matmul_backend)
        buckets = self.step_buckets()
        largest = [max((b for b in buckets if b.kind == kind), key=lambda b: b.tokens)
                   for kind in ("prefill", "decode")]
        start = time.perf_counter()
        probe.compile(largest, lambda s: self._sampling([], s))
        scratch = max(c.memory_analysis().temp_size_in_bytes for c in probe._compiled.values())
        log.info("step scratch memory: %.2f GiB (largest steps, measured in %.1fs); set aside before sizing "
                 "the KV cache", scratch / 2**30, time.perf_counter() - start)
        del probe
        return int(scratch * 1.1) + 256 * 2**20  # headroom for allocator fragmentation

    def step_buckets(self) -> list[Bucket]:
        sched = self.config.scheduler
        prefill = [Bucket("prefill", t, min(sched.max_prefill_seqs, t)) for t in self.buckets.prefill_buckets]
        decode = [Bucket("decode", b, b) for b in self.buckets.decode_buckets]
        return prefill + decode

    def compile(self) -> float:
        """Compile every step shape ahead of time; returns the total seconds."""
        start = time.perf_counter()
        self.compile_seconds = self.runner.compile(self.step_buckets(), lambda s: self._sampling([], s))
        if self.runner.channel is not None:
            self.runner.channel.warm_up()
        return time.perf_counter() - start

    def close(self) -> None:
        """Release the other processes of a multi-host job (they exit); nothing to do otherwise.
        Called from the thread that runs the steps, after the last one."""
        if self.runner.channel is not None and is_leader():
            self.runner.channel.stop()
            self.runner.channel = None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Validate and queue. Raises InvalidRequestError (bad parameter) or RequestTooLongError."""
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        params.validate(self.vocab_size, self.config.max_n)
        banned = len(params.bad_words_ids or []) + len(params.stop_token_ids) + len(self.eos_ids)
        if banned > MAX_BANNED_IDS:
            raise InvalidRequestError("bad_words", f"at most {MAX_BANNED_IDS} banned tokens per step, got {banned}")
        max_total = self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        base_seed = params.seed if params.seed is not None else secrets.randbits(32)
        seqs, texts = [], []
        for i in range(params.num_samples):
            seq = Sequence(request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
                           params=params, max_total_tokens=max_total, priority=priority, sample_index=i,
                           seed=(base_seed + i) % 2**32,
                           matcher=params.grammar.matcher() if params.grammar is not None else None)
            seqs.append(seq)
            texts.append(SequenceText(seq, self.tokenizer))
        req = _Request(request_id, list(prompt_ids), params, seqs, texts, time.monotonic())
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_ids)
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its pages are free before the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)  # finishes every sample with FinishReason.ABORT
        want_logprobs = req.params.logprobs is not None
        outputs = [text.delta(seq, i, want_logprobs) for i, (seq, text) in enumerate(zip(req.seqs, req.texts))]
        return RequestOutput(request_id, req.prompt_ids, [o for o in outputs if o], True,
                             req.seqs[0].num_cached_tokens)

    def has_unfinished(self) -> bool:
        """Whether step() has work: queued or running sequences, or a dispatched step still
        carrying a live sequence's token."""
        return self.scheduler.has_unfinished() or (
            self._in_flight is not None and any(not seq.is_finished for seq, _, _ in self._in_flight.sampled))

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: read the tokens of the step in flight, schedule and dispatch the
        next step, then turn the tokens into text and output deltas while the device runs it.

        Everything the next step's inputs depend on (the token ids, grammar states, penalties,
        EOS / stop-token / length endings) is settled before it is scheduled; only the text work
        (incremental detokenizing, stop strings, logprob objects, deltas) overlaps it. A stop
        string found there ends its sequence one step late: the token the next step computes for
        it is dropped unread, and its pages are freed before any later step is planned."""
        accepted = self._complete()
        self._dispatch()
        if not self.config.overlap:
            accepted += self._complete()
        return self._emit(accepted)

    def _dispatch(self) -> None:
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if plan.is_empty:
            return
        self.num_steps += 1
        flight = _InFlight([], [])
        if plan.prefills:
            bucket = self._prefill_bucket(plan.num_prefill_tokens)
            rows = [(c.seq.token_ids[c.start : c.end], c.start, c.seq.pages) for c in plan.prefills]
            targets = [self._prompt_targets(c.seq, c.start, c.end) for c in plan.prefills]
            out, prompt = self._run(bucket, rows, [c.seq for c in plan.prefills], targets)
            flight.sampled += [(c.seq, out, i) for i, c in enumerate(plan.prefills) if c.samples]
            if any(t is not None for t in targets):
                flight.prompt_logprobs.append((plan.prefills, targets, prompt))
        if plan.decodes:
            bucket = self._decode_bucket(len(plan.decodes))
            rows = [([s.token_ids[-1]], s.num_tokens - 1, s.pages) for s in plan.decodes]
            out, _ = self._run(bucket, rows, plan.decodes)
            flight.sampled += [(s, out, i) for i, s in enumerate(plan.decodes)]
        self.scheduler.advance(plan)
        self._in_flight = flight

    def _complete(self) -> list[_Accepted]:
        """Wait for the step in flight (if any) and take its tokens into their sequences."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        for chunks, targets, prompt in flight.prompt_logprobs:
            self._store_prompt_logprobs(chunks, targets, prompt)
        fetched: dict[int, Any] = {}
        accepted: list[_Accepted] = []
        for seq, out, row in flight.sampled:
            if seq.is_finished:  # aborted, or ended by a stop string, while the step ran
                continue
            host = fetched.get(id(out))
            if host is None:
                host = fetched[id(out)] = to_host(out)
            accepted.append(self._accept(seq, host, row))
        return accepted

    def _prefill_bucket(self, tokens: int) -> Bucket:
        size = self.buckets.prefill_bucket(tokens)
        return Bucket("prefill", size, min(self.config.scheduler.max_prefill_seqs, size))

    def _decode_bucket(self, seqs: int) -> Bucket:
        size = self.buckets.decode_bucket(seqs)
        return Bucket("decode", size, size)

    def _run(self, bucket: Bucket, rows: list, seqs: list[Sequence], targets: list | None = None) -> Any:
        inputs = build_inputs(bucket, rows, self.allocator.page_size, self.max_pages_per_seq,
                              self._sampling(seqs, bucket.seqs), targets)
        return self.runner.run(bucket, inputs)

    # ---- prompt logprobs ---------------------------------------------------------------------
    def _prompt_targets(self, seq: Sequence, start: int, end: int) -> tuple[list[int], int] | None:
        """For each computed position p, the prompt token p+1 whose logprob it yields (or -1)."""
        req = self.requests.get(seq.request_id)
        if req is None or req.prompt_logprobs is None or seq.sample_index != 0 or req.prompt_logprobs_sent:
            return None
        first = max(seq.params.prompt_logprobs_start, 1)
        n = seq.num_prompt_tokens
        targets = [seq.token_ids[p + 1] if first <= p + 1 < n else -1 for p in range(start, end)]
        if all(t < 0 for t in targets):
            return None
        return targets, seq.params.prompt_logprobs or 0

    def _store_prompt_logprobs(self, chunks: list, targets: list, prompt: Any) -> None:
        host = to_host(prompt)
        row = 0
        for chunk, target in zip(chunks, targets):
            req = self.requests.get(chunk.seq.request_id) if target is not None else None
            if req is not None:  # (None: no logprobs asked here, or aborted while the step ran)
                ids, n_top = target
                for i, tid in enumerate(ids):
                    if tid >= 0:
                        r = row + i
                        top = [(int(a), float(b)) for a, b in zip(host.top_ids[r][:n_top], host.top_logprobs[r][:n_top])]
                        req.prompt_logprobs[chunk.start + i + 1] = TokenLogprob(tid, float(host.logprob[r]), top)
            row += chunk.num_tokens

    # ---- sampling inputs -----------------------------------------------------------------------
    def _sampling(self, seqs: list[Sequence], size: int) -> Any:
        width = self.config.scheduler.max_model_len
        return make_sampling_batch([self._row(s) for s in seqs], self.vocab_size, size, width, width)

    def _row(self, seq: Sequence) -> RowParams:
        p = seq.params
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        want = p.logprobs if p.logprobs is not None else (0 if p.best_of and p.best_of > p.n else -1)
        return RowParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or {},
            banned_ids=self._banned(seq), seed=seq.seed, step=seq.num_output_tokens,
            num_logprobs=want, processed_logprobs=p.processed_logprobs,
            output_tokens=seq.output_ids if penalised else (),
            prompt_tokens=seq.prompt_ids if p.repetition_penalty != 1.0 else (),
            allowed_mask=self._grammar_mask(seq),
        )

    def _grammar_mask(self, seq: Sequence) -> np.ndarray | None:
        if seq.matcher is None:
            return None
        mask = np.empty(mask_words(self.vocab_size), np.uint32)
        seq.matcher.fill_mask(mask)
        return mask

    def _banned(self, seq: Sequence) -> list[int]:
        p = seq.params
        banned: set[int] = set()
        if seq.num_output_tokens < p.min_tokens:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        out = seq.output_ids
        for words in p.bad_words_ids or []:
            prefix = words[:-1]
            if not prefix or out[len(out) - len(prefix) :] == prefix:
                banned.add(words[-1])
        return sorted(banned)

    # ---- postprocessing ------------------------------------------------------------------------
    def _accept(self, seq: Sequence, out: Any, row: int) -> _Accepted:
        """Take a sampled token into its sequence and settle every ending the next step's plan
        depends on (grammar, EOS, stop token ids, length). Stop strings wait for the text."""
        token = int(out.token[row])
        p = seq.params
        grammar_done = False
        if seq.matcher is not None:
            # A complete match ends here whatever ignore_eos / min_tokens say: the grammar allows
            # nothing else, and the masks never let EOS through before the match is complete.
            grammar_done = token in self.eos_ids and seq.matcher.is_accepting()
            if not grammar_done and not seq.matcher.advance(token):
                # Only a matcher that hit its own limits gets here (its mask was empty).
                error = seq.matcher.error() or f"token {token} is outside the grammar"
                log.error("request %s: structured output stopped: %s", seq.request_id, error)
                seq.stop_reason = f"structured output failed: {error}"
                self.scheduler.finish(seq, FinishReason.ABORT)
                return _Accepted(seq, None)
        seq.token_ids.append(token)
        seq.cumulative_logprob += float(out.logprob[row])
        reason: FinishReason | None = None
        past_min = seq.num_output_tokens > p.min_tokens
        if grammar_done or (token in self.eos_ids and not p.ignore_eos and past_min):
            reason = FinishReason.STOP
        elif token in p.stop_token_ids and past_min:
            reason, seq.stop_reason = FinishReason.STOP, token
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= seq.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return _Accepted(seq, token, out, row, reason, past_min)

    def _emit(self, accepted: list[_Accepted]) -> list[RequestOutput]:
        """The text side of accepted tokens: detokenize, match stop strings, build the deltas."""
        touched: dict[str, _Request] = {}
        for a in accepted:
            seq, p = a.seq, a.seq.params
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            touched[seq.request_id] = req
            text = req.texts[seq.sample_index]
            if a.token is None:  # the grammar stopped it: release the held text
                text.finish_text(stopped_by_string=False)
                continue
            logprob = None
            if p.logprobs is not None:
                top = [(int(i), float(v)) for i, v in zip(a.out.top_ids[a.row][: p.logprobs],
                                                          a.out.top_logprobs[a.row][: p.logprobs])]
                logprob = TokenLogprob(a.token, float(a.out.logprob[a.row]), top)
            # The text of an ending token (EOS, stop token) is never shown; a length ending's is.
            show = a.reason is None or a.reason is FinishReason.LENGTH
            matched = text.add(a.token, logprob, check_stops=a.past_min, show_text=show)
            if matched is not None:
                # A stop string wins over a length ending on the same token, as if it had been
                # seen first; the sequence may have run one more step, whose token is dropped.
                seq.stop_reason = matched
                if seq.is_finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq, FinishReason.STOP)
            if matched is not None or a.reason is not None:
                text.finish_text(stopped_by_string=matched is not None)
        return [o for req in touched.values() if (o := self._request_delta(req)) is not None]

    def _request_delta(self, req: _Request) -> RequestOutput | None:
        hide = req.params.best_of is not None and req.params.best_of > req.params.n  # choose at the end
        finished = all(s.is_finished for s in req.seqs)
        outputs: list[CompletionOutput] = []
        if not hide:
            for i, (seq, text) in enumerate(zip(req.seqs, req.texts)):
                d = text.delta(seq, i, req.params.logprobs is not None)
                if d is not None:
                    outputs.append(d)
        elif finished:
            best = sorted(range(len(req.seqs)), key=lambda i: -req.seqs[i].cumulative_logprob)[: req.params.n]
            for rank, i in enumerate(best):
                req.texts[i].emitted = 0  # nothing was streamed: the chosen samples go out whole
                d = req.texts[i].delta(req.seqs[i], rank, req.params.logprobs is not None)
                d.token_ids = req.seqs[i].output_ids
                outputs.append(d)
        if finished:
            self.requests.pop(req.request_id, None)
        if not outputs and not finished:
            return None
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(req.request_id, req.prompt_ids, outputs, finished, req.seqs[0].num_cached_tokens,
                             prompt_logprobs)

    # ---- checks ------------------------------------------------------------------------------------
    def check_idle_integrity(self) -> None:
        self.scheduler.check_idle_integrity()


def run_to_completion(
    engine: Engine, request_ids: Iterable[str], on_finished: Callable[[str], None] | None = None
) -> dict[str, RequestOutput]:
    """Step until the given requests finish; returns their accumulated outputs (on_finished is
    called with each request id as it finishes, e.g. to move a progress bar)."""
    pending = set(request_ids)
    results: dict[str, RequestOutput] = {}
    while pending:
        deltas = engine.step()
        if not deltas and not engine.has_unfinished():
            raise RuntimeError(f"requests {sorted(pending)} never finished")
        for d in deltas:
            results.setdefault(d.request_id, dataclasses.replace(d, outputs=[])).merge(d)
            if d.finished:
                pending.discard(d.request_id)
                if on_finished is not None:
                    on_finished(d.request_id)
    return results
