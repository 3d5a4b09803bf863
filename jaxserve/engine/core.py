"""The engine loop: requests in, output deltas out (no jax).

One `step()` is schedule -> execute -> update_from_output. The scheduler (host) emits the step's
diff (`SchedulerOutput`); the input builder turns it into fixed-shape commands and the runner (the
only owner of device arrays, passed in) runs them; `update_from_output` takes each row's 0..K
sampled tokens into its sequence (jaxserve.engine.postprocess owns every way a sequence ends) and
advances the scheduler. The text side (detokenizing, stop strings, deltas) of step N runs while
the device computes step N+1.

The runner's `execute` runs on a thread of its own (`_Dispatcher`). A call into a compiled step
returns at once when the device runs it asynchronously (a prefill, and any step on CPUs and TPUs),
but a decode step's `lax.while_loop` on a GPU returns only when the loop has ended: XLA:GPU reads
the loop's condition back to the host after every iteration. Called on the engine thread, that
put step N's text work after step N+1's loop instead of beside it: every delta, the first token
too, reached its client one device loop late (an H100 at batch 1: TTFT 90 ms, 38 ms on a thread).

Between two decode steps the host reads one's tokens, plans the next and builds its inputs; with
the device waiting for those, that is idle device time every step (an H100 at batch 256: ~15 ms
per 191 ms step). When the running step is a plain decode batch (no arrivals, no grammar, beams or
drafts), the next one is dispatched before its tokens are read (`Scheduler.schedule_ahead`), and
the host's work runs beside the device's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jaxserve.engine.beam import BeamSearch, max_beam_width
from jaxserve.engine.embeds import EmbedSpan, ImageItem, cache_ids, check_spans
from jaxserve.engine.info import EngineInfo, Stats
from jaxserve.engine.lora_slots import LoadedLora, LoraRefused, LoraSlots
from jaxserve.engine.ngram import MAX_NGRAM_SIZE
from jaxserve.engine.output import RequestOutput, SequenceText, TokenLogprob
from jaxserve.engine.postprocess import Accepted, Postprocessor, Request
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence, SequenceStatus, _float_range, _int_range
from jaxserve.errors import InvalidRequestError
from jaxserve.structured.allowed_tokens import AllowedTokensGrammar
from jaxserve.engine.rows import MAX_BANNED_IDS
from jaxserve.engine.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from jaxserve.engine.step_inputs import PromptTargets, StepCommands, StepInputBuilder
from jaxserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxserve.weights.lora_adapter import LoraAdapter

log = logging.getLogger("jaxserve.engine")


class ImageEncoder(Protocol):
    """A vision model's encoder (jaxserve.engine.vision_encoder): an image's embeddings, one row per
    placeholder token ([item.num_tokens, hidden], NumPy)."""

    image_token_id: int  # the placeholder token an image's positions hold

    def encode(self, item: ImageItem) -> Any: ...

    def rope_positions(self, prompt_ids: list[int], images: list[ImageItem]) -> tuple[Any, int]:
        """An M-RoPE model's prompt positions [3, len] and the delta later tokens take."""
        ...


class Runner(Protocol):
    """The device side (jaxserve.engine.runner.ModelRunner): runs a step's commands."""

    def execute(self, step: StepCommands) -> Any: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose outputs have not been read, and the prompt logprobs it computes."""

    out: SchedulerOutput
    handle: concurrent.futures.Future  # the runner's handle, once `execute` has returned
    prompt_targets: list[PromptTargets | None]


class _Dispatcher:
    """Runs the runner's `execute` on one thread, in the order asked: steps, and the runner's
    device state (cache, batch), are only ever touched from there. With `threaded` False the call
    runs here and now (an engine that does not overlap steps gains nothing from a thread).

    It times its calls, for /metrics and for finding where a step's time goes: `call_seconds`
    inside `execute` (on a GPU a decode loop's call returns when the loop has run, so there it is
    the device's time; other calls return once queued), and `handover_seconds` from a call's
    return to the start of the next one when that one was already waiting: the host's time
    between two back-to-back steps, in which the device may sit idle."""

    def __init__(self, runner: Runner, threaded: bool):
        self.runner = runner
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-dispatch")
                      if threaded else None)
        self.calls = 0
        self.call_seconds = 0.0
        self.handover_seconds = 0.0
        # Each counter has one writer (the engine thread submits, the dispatch thread finishes), so
        # "was the next call already asked for" needs no lock.
        self._submitted = 0
        self._handover_from: float | None = None

    def execute(self, step: StepCommands) -> concurrent.futures.Future:
        self._submitted += 1
        if self._pool is not None:
            return self._pool.submit(self._run, step)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self._run(step))
        return done

    def _run(self, step: StepCommands) -> Any:
        start = time.perf_counter()
        if self._handover_from is not None:
            self.handover_seconds += start - self._handover_from
        try:
            return self.runner.execute(step)
        finally:
            end = time.perf_counter()
            self.calls += 1
            self.call_seconds += end - start
            self._handover_from = end if self._pool is not None and self._submitted > self.calls else None

    def close(self) -> None:
        """Wait for every call asked for to end, then stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Engine:
    def __init__(self, scheduler: Scheduler, builder: StepInputBuilder, runner: Runner, tokenizer: Tokenizer | None,
                 info: EngineInfo, overlap: bool = True, on_idle: Callable[[], None] | None = None):
        """overlap: start step N+1 before turning step N's tokens into text (see `step`); False
        runs each step to the end before the next starts (same tokens and text). on_idle runs
        whenever the engine has just become idle (the integrity check). tokenizer None: outputs
        are token ids with empty text (LLM(skip_tokenizer_init=True))."""
        self.scheduler = scheduler
        self.builder = builder
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self.overlap = overlap
        self.on_idle = on_idle
        self.eos_ids = set(info.eos_ids)
        self.post = Postprocessor(self.eos_ids, scheduler.finish)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_steps_ahead = 0  # decode steps dispatched before the step they follow was read
        self.num_draft_tokens = 0  # speculative decoding, over all requests
        self.num_accepted_draft_tokens = 0
        self.stats = Stats()
        self.compile_seconds: dict[Any, float] = {}  # per compiled command shape (jaxserve.engine.build)
        self._dispatcher = _Dispatcher(runner, threaded=overlap)
        self._in_flight: _InFlight | None = None
        self._beam_results: list[RequestOutput] = []  # beam searches that ended, not returned yet
        self.encoder: ImageEncoder | None = None  # a vision model's (jaxserve.engine.vision_encoder)
        self.lora: LoraSlots | None = None  # the model's LoRA adapter slots (jaxserve.engine.build)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                    images: Iterable[ImageItem] = (), embeds: Iterable[EmbedSpan] = ()) -> None:
        """Validate and queue. Raises InvalidRequestError (bad parameter) or RequestTooLongError.
        images: the prompt's images, encoded here by the vision encoder; embeds: client
        embeddings at given prompt positions (jaxserve.engine.embeds)."""
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        validate_prompt(prompt_ids, self.info.vocab_size)
        images, embeds = list(images), list(embeds)
        self._check_inputs(prompt_ids, images, embeds)
        params.validate(self.info.vocab_size, self.info.max_n)
        if params.lora is not None and (self.lora is None or self.lora.get(params.lora) is None):
            loaded = (", ".join(self.lora.names) or "none") if self.lora is not None else \
                "none: the model was started without LoRA adapter slots (--lora-modules, --enable-lora)"
            raise InvalidRequestError("lora", f"no LoRA adapter named {params.lora!r} is loaded ({loaded})")
        params = speculation_defaults(params, self.info)
        check_speculation(params, self.info)
        if params.stop and self.tokenizer is None:
            # Stop strings are matched on the output text, and without a tokenizer there is none:
            # refused rather than never matching.
            raise InvalidRequestError("stop", "stop strings need a tokenizer, and this engine has none "
                                      "(skip_tokenizer_init=True); use stop_token_ids")
        banned = len(params.bad_words_ids or []) + len(params.stop_token_ids) + len(self.eos_ids)
        if banned > MAX_BANNED_IDS:
            raise InvalidRequestError("bad_words", f"at most {MAX_BANNED_IDS} banned tokens per step, got {banned}")
        if params.max_tokens is None and params.default_max_tokens is not None:
            room = self.scheduler.check_fits(len(prompt_ids), None) - len(prompt_ids)  # refuses a prompt with none
            params = dataclasses.replace(params, max_tokens=min(room, max(params.default_max_tokens,
                                                                          params.min_tokens)))
        max_total = self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        group = self._beam_search(len(prompt_ids), max_total, params) if params.use_beam_search else None
        # Only a request that will run gets its images encoded (on this thread, which owns the device).
        spans = self._embed_spans(prompt_ids, images, embeds)
        rope, delta = self.encoder.rope_positions(prompt_ids, images) if self.builder.mrope and images else (None, 0)
        base_seed = params.seed if params.seed is not None else secrets.randbits(32)
        grammar = params.grammar
        if params.allowed_token_ids is not None:  # a mask around the request's own constraint, if any
            grammar = AllowedTokensGrammar(grammar, params.allowed_token_ids, self.info.vocab_size, self.eos_ids)
        seqs, texts = [], []
        for i in range(1 if group is not None else params.num_samples):
            seq = Sequence(request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
                           params=params, max_total_tokens=max_total, priority=priority, sample_index=i,
                           seed=(base_seed + i) % 2**32,
                           matcher=grammar.matcher() if grammar is not None else None, beam=group,
                           embeds=spans, prompt_keys=cache_ids(prompt_ids, spans) if spans else None,
                           rope_positions=rope, rope_delta=delta,
                           lora_key=self.lora.get(params.lora).key if params.lora is not None else None)
            if group is not None:
                self.scheduler.start_beams(group, seq)
            seqs.append(seq)
            texts.append(SequenceText(seq, self.tokenizer))
        req = Request(request_id, list(prompt_ids), params, seqs, texts, time.monotonic())
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_ids)
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)
        self._publish()

    def _check_inputs(self, prompt_ids: list[int], images: list[ImageItem], embeds: list[EmbedSpan]) -> None:
        """Images only for a vision model, embeddings only when enabled, and on a vision model every
        image placeholder token inside an image's span: a placeholder without its image would
        be read as the placeholder's own embedding (every route and `LLM` pass here)."""
        if images and self.encoder is None:
            raise InvalidRequestError("image",
                                      f"{self.info.architecture} takes no images (served as a text-only model)")
        if embeds and not self.info.embed_dim:
            raise InvalidRequestError("input_embeds", "this server takes no embeddings as input; start it with "
                                      "--enable-prompt-embeds")
        if self.encoder is None:
            return
        token = self.encoder.image_token_id
        covered = {p for item in images for p in range(item.offset, item.offset + item.num_tokens)}
        covered |= {p for span in embeds for p in range(span.offset, span.end)}
        stray = next((p for p, t in enumerate(prompt_ids) if t == token and p not in covered), None)
        if stray is not None:
            raise InvalidRequestError("prompt", f"token {stray} is the image placeholder ({token}) but no image goes "
                                      "there: send the image with the prompt (image_url / image_data / "
                                      "multi_modal_data), one per placeholder")

    def _embed_spans(self, prompt_ids: list[int], images: list[ImageItem],
                     embeds: list[EmbedSpan]) -> tuple[EmbedSpan, ...]:
        """The prompt's embedding spans in position order: its images encoded (or taken from the
        encoder's cache) and the client's embeddings, checked against the prompt."""
        spans = list(embeds)
        for item in images:
            encoded = self.encoder.encode(item)
            if encoded.shape[0] != item.num_tokens:  # the processor's count and the model's packing disagree
                raise RuntimeError(f"the vision encoder gave {encoded.shape[0]} embeddings for an image of "
                                   f"{item.num_tokens} placeholder tokens")
            spans.append(EmbedSpan(item.offset, encoded, item.key))
        spans.sort(key=lambda span: span.offset)
        try:
            check_spans(spans, len(prompt_ids), self.builder.embed_dim)
        except ValueError as e:
            raise InvalidRequestError("input_embeds" if embeds else "image", str(e)) from None
        return tuple(spans)

    def _beam_search(self, num_prompt_tokens: int, max_total: int, params: SamplingParams) -> BeamSearch:
        """A beam request's search state, or InvalidRequestError / RequestTooLongError when its beams
        cannot run here."""
        end_ids = params.end_ids(self.eos_ids)
        width, widest = params.beam_width, max_beam_width(len(end_ids))
        name = "best_of" if params.best_of is not None else "n"  # the field that set the width
        if width > widest:
            raise InvalidRequestError(name, f"beam search looks at each beam's best 20 tokens, which allows at "
                                      f"most {widest} beams with {len(end_ids)} end ids; got {width}")
        self.scheduler.check_beam_fits(num_prompt_tokens, max_total, width, name)
        return BeamSearch(width, params.n, max_total - num_prompt_tokens, end_ids, params.length_penalty,
                          params.early_stopping, params.min_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its pages and slots are free before the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)  # finishes every sample with FinishReason.ABORT
        want_logprobs = req.params.logprobs is not None
        outputs = [text.delta(seq, i, want_logprobs) for i, (seq, text) in enumerate(zip(req.seqs, req.texts))]
        self._publish()
        return RequestOutput(request_id, req.prompt_ids, [o for o in outputs if o], True, req.seqs[0].num_cached_tokens,
                             num_draft_tokens=sum(s.num_draft_tokens for s in req.seqs),
                             num_accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in req.seqs))

    def abort_sample(self, request_id: str, index: int) -> RequestOutput | None:
        """Stop sample `index` of a request of n samples (SGLang aborts each by its own rid); the
        others run on. Its pages are free before the next step; the output carries its last delta
        (finish_reason "abort") and is the request's last once no sample runs. None when there is
        no such running sample, or the request is a beam search (whose beams are one search) or
        samples more than it returns (best_of > n: which ones it returns is known only at the end)."""
        req = self.requests.get(request_id)
        if req is None or req.params.use_beam_search or req.params.num_samples != req.params.n \
                or not 0 <= index < len(req.seqs) or req.seqs[index].is_finished:
            return None
        seq = req.seqs[index]
        self.scheduler.finish(seq, FinishReason.ABORT)
        delta = req.texts[index].delta(seq, index, req.params.logprobs is not None)
        finished = all(s.is_finished for s in req.seqs)
        if finished:
            del self.requests[request_id]
        self._publish()
        return RequestOutput(request_id, req.prompt_ids, [delta] if delta else [], finished,
                             req.seqs[0].num_cached_tokens,
                             num_draft_tokens=sum(s.num_draft_tokens for s in req.seqs),
                             num_accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in req.seqs))

    def abort_all(self) -> list[RequestOutput]:
        return [out for request_id in list(self.requests) if (out := self.abort(request_id)) is not None]

    # ---- LoRA adapters -----------------------------------------------------------------------------
    def read_lora(self, name: str, path: Path | str) -> "LoraAdapter":
        """Read and check the PEFT adapter in `path` against the model (files only: any thread may
        call it, so the engine thread need not wait on the disk). Raises LoraRefused or
        WeightsError (both ValueErrors)."""
        from jaxserve.weights.lora_adapter import LoraModuleSpec, load_adapter

        slots = self._lora_slots()
        return load_adapter(LoraModuleSpec(name, Path(path)), slots.num_layers, slots.shapes)

    def add_lora(self, adapter: "LoraAdapter", path: Path | str, replace: bool = False,
                 pinned: bool = False) -> LoadedLora:
        """Load a read adapter (`read_lora`): requests naming it decode with it from the next step
        on. It goes into a free adapter slot now if there is one, else into one when a request
        of it is admitted (the scheduler's `adapters`). replace: an adapter already loaded under
        its name is unloaded first, once the new one is known to fit (vLLM's load_inplace).
        pinned: it takes a slot now and keeps it (SGLang's)."""
        slots = self._lora_slots()
        name, targets = adapter.name, tuple(adapter.targets)
        busy = self.scheduler.running_adapters()
        if replace and slots.get(name) is not None:
            slots.check_adapter(name, adapter.rank, targets)
            if pinned:
                slots.check_pin(name, busy)
            self.unload_lora(name)
        lora = slots.add(name, Path(path), adapter.rank, targets, adapter.factors, pinned, busy)
        slot = slots.acquire(name, busy, evict=False)
        try:
            self._write_loras()
        except BaseException:
            slots.remove(name)
            raise
        log.info("LoRA adapter %s loaded from %s (%s): rank %d on %s", name, path,
                 f"slot {slot}" if slot is not None else "no free slot: it takes one when a request of it starts",
                 adapter.rank, ", ".join(targets))
        return lora

    def _write_loras(self) -> None:
        """Write the adapters given slots since the last write (LoraSlots.take_writes) into them.

        On this thread while the dispatch thread may be running a step: safe, because a slot is
        only given to an adapter when no running sequence reads its old one (the rows of a step
        already dispatched for a sequence that has ended since are dropped), and the new arrays
        replace the old ones (never donated), which a step already dispatched keeps reading."""
        if self.lora is None:
            return
        for slot, lora in self.lora.take_writes():
            self.runner.write_lora_slot(slot, self.lora.rank, lora.factors)
            log.debug("LoRA adapter %s written into slot %d", lora.name, slot)

    def _lora_slots(self) -> LoraSlots:
        if self.lora is None:
            raise LoraRefused("this model has no LoRA adapter slots: start it with --enable-lora (or --lora-modules)")
        return self.lora

    def load_lora(self, name: str, path: Path | str, replace: bool = False, pinned: bool = False) -> LoadedLora:
        """`read_lora` then `add_lora`."""
        if self.lora is not None and not replace:
            self.lora.check_fits(name, 0, ())  # the name and the count, before the files are read
        return self.add_lora(self.read_lora(name, path), path, replace, pinned)

    def unload_lora(self, name: str) -> None:
        """Unload `name`, freeing its adapter slot. Refused while a request of it runs or waits.
        Its cached prefix pages hang from its load's own key (LoadedLora.key): nothing else reads
        them, and they age out of the cache."""
        slots = self._lora_slots()
        users = sum(1 for req in self.requests.values() if req.params.lora == name)
        if users:
            raise LoraRefused(f"LoRA adapter {name!r} is in use by {users} running request(s); unload it once they "
                              "end")
        slots.remove(name)
        log.info("LoRA adapter %s unloaded", name)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache: every cached page no sequence holds goes back to the free list
        (pages in use stay, and running requests are untouched); returns how many were dropped."""
        dropped = self.scheduler.allocator.reset_prefix_cache()
        self._publish()
        return dropped

    def has_unfinished(self) -> bool:
        """Whether step() has work: queued or running sequences, or a dispatched step still
        carrying a live sequence's tokens."""
        if self.scheduler.has_unfinished():
            return True
        flight = self._in_flight
        return flight is not None and any(not s.is_finished for s in _sampling_seqs(flight.out))

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: read the tokens of the step in flight, schedule and dispatch the
        next step, then turn the tokens into text and output deltas while the device runs it.

        Everything the next step's inputs depend on (the token ids, grammar states, penalties,
        EOS / stop-token / length endings) is settled before it is scheduled; only the text work
        (incremental detokenizing, stop strings, logprob objects, deltas) overlaps it. A stop
        string found there ends its sequence one step late: the tokens the next step computes for
        it are dropped unread, and its pages are freed before any later step is planned.

        A plain decode batch goes further: the step after the one in flight is planned and
        dispatched before that one's tokens are read (`_dispatch_ahead`), its rows' tokens taken
        on the device. A row that turns out to have ended in the step it followed runs nothing
        there (EOS, a stop id: the device sees its last token end it) or is dropped the same way
        (a stop string, an abort)."""
        ahead = self._dispatch_ahead() if self.overlap else None
        accepted = self._complete()
        if ahead is not None:
            self._in_flight = ahead
        else:
            self._dispatch()
        if not self.overlap:
            accepted += self._complete()
        outputs = self.post.emit(accepted, self.requests) + self._beam_results
        self._beam_results = []
        self._publish()
        if self.on_idle is not None and not self.has_unfinished():
            self.on_idle()
        return outputs

    def _dispatch(self) -> None:
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        self._write_loras()  # adapters the admitted sequences decode with, given a slot just now
        if not out.prefills and not out.decodes:
            return
        self.num_steps += 1
        targets = [self._prompt_targets(c) for c in out.prefills]
        commands = self.builder.build(out, targets, grammar_mask=lambda seq, mask: seq.matcher.fill_mask(mask))
        self._in_flight = _InFlight(out, self._dispatcher.execute(commands), targets)

    def _dispatch_ahead(self) -> _InFlight | None:
        """Dispatch the decode step after the one in flight before reading its tokens, when the
        scheduler can plan it now (`Scheduler.schedule_ahead`): the host's work between two steps
        (reading one's tokens, planning and building the next) then runs while the device computes,
        instead of between the steps with the device idle."""
        flight = self._in_flight
        if flight is None:
            return None
        out = self.scheduler.schedule_ahead(flight.out)
        if out is None:
            return None
        self.num_steps += 1
        self.num_steps_ahead += 1
        return _InFlight(out, self._dispatcher.execute(self.builder.build(out)), [])

    def _complete(self) -> list[Accepted]:
        """Wait for the step in flight (if any) and update from its outputs."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        return self.update_from_output(flight)

    def update_from_output(self, flight: _InFlight) -> list[Accepted]:
        """Take each sampling row's tokens into its sequence, then advance the scheduler."""
        out, accepted = flight.out, []
        handle = flight.handle.result()  # (a failed step raises here)
        decoded: dict[Sequence, int] = {}
        beams: list[BeamSearch] = []
        # Before any token is accepted (and may end its sequence, freeing its pages): the
        # prompts' pages are computed, whatever is sampled.
        self.scheduler.advance_prefills(out)
        if out.prefills:
            prefill = handle.prefill_output()
            if any(t is not None for t in flight.prompt_targets):
                self._store_prompt_logprobs(out.prefills, flight.prompt_targets, prefill.prompt)
            for row, chunk in enumerate(out.prefills):
                if chunk.samples and chunk.seq.beam is not None:
                    beams += self._report_beam(chunk.seq, prefill, row)
                elif chunk.samples:
                    accepted += self._accept(chunk.seq, prefill, row, 1)
        if out.decodes:
            decode = handle.decode_output()
            for row, seq in enumerate(out.decodes):
                if seq.beam is not None:
                    beams += self._report_beam(seq, decode, row)
                    decoded[seq] = 1  # its last token's K/V; its next token is the search's to choose
                    continue
                taken = self._accept(seq, decode, row, int(decode.num_sampled[row]))
                decoded[seq] = sum(a.token is not None for a in taken)
                accepted += taken
                draft = out.drafts.get(seq)
                if draft and taken:
                    self._count_drafts(seq, draft, [a.token for a in taken])
        self.scheduler.advance(out, decoded)
        for group in {id(g): g for g in beams}.values():
            if all(s.status is SequenceStatus.RUNNING and s in group.reported for s in group.members):
                self._beam_step(group)
        return accepted

    # ---- beam search ---------------------------------------------------------------------------
    def _report_beam(self, seq: Sequence, output: Any, row: int) -> list[BeamSearch]:
        """Keep a beam's best next tokens until all of its request's beams have theirs."""
        if seq.is_finished:  # aborted while the step ran
            return []
        s = output.sample
        seq.beam.reported[seq] = [(int(i), float(v)) for i, v in zip(s.top_ids[0, row], s.top_logprobs[0, row])]
        return [seq.beam]

    def _beam_step(self, group: BeamSearch) -> None:
        """Every beam has reported: choose the continuations, then fork the beams or end the search."""
        members = group.members
        continuations = group.step([group.reported[s] for s in members], [s.output_ids for s in members])
        if not group.done:
            self.scheduler.fork_beams(group, continuations)
            return
        for seq in members:
            self.scheduler.finish(seq, FinishReason.STOP)
        req = self.requests.pop(members[0].request_id, None)
        if req is not None:
            self._beam_results.append(self._beam_output(req, group))

    def _beam_output(self, req: Request, group: BeamSearch) -> RequestOutput:
        """The n best hypotheses, whole, as the request's one and final output."""
        p, outputs = req.params, []
        for index, hyp in enumerate(group.results()):
            last = hyp.token_ids[-1]
            seq = Sequence(request_id=req.request_id, token_ids=[*req.prompt_ids, *hyp.token_ids],
                           num_prompt_tokens=len(req.prompt_ids), params=p, max_total_tokens=req.seqs[0].max_total_tokens,
                           status=SequenceStatus.FINISHED, cumulative_logprob=hyp.cumulative_logprob,
                           finish_reason=FinishReason.STOP if hyp.ended else FinishReason.LENGTH,
                           stop_reason=last if hyp.ended and last in p.stop_token_ids else None)
            text = SequenceText(seq, self.tokenizer)
            for k, token in enumerate(hyp.token_ids):
                logprob = None if p.logprobs is None else TokenLogprob(token, hyp.logprobs[k], hyp.tops[k][: p.logprobs])
                # The text of an ending token is never shown (as for any sequence).
                text.add(token, logprob, check_stops=False, show_text=not (hyp.ended and k == len(hyp.token_ids) - 1))
            text.finish_text(stopped_by_string=False)
            outputs.append(text.delta(seq, index, p.logprobs is not None))
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(req.request_id, req.prompt_ids, outputs, True, req.seqs[0].num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    def _count_drafts(self, seq: Sequence, draft: list[int], taken: list[int | None]) -> None:
        """Acceptance: a verify step keeps its drafts up to the first token that differs from them."""
        kept = 0
        while kept < min(len(draft), len(taken)) and taken[kept] == draft[kept]:
            kept += 1
        seq.num_draft_tokens += len(draft)
        seq.num_accepted_draft_tokens += kept
        self.num_draft_tokens += len(draft)
        self.num_accepted_draft_tokens += kept

    def _accept(self, seq: Sequence, output: Any, row: int, count: int) -> list[Accepted]:
        if seq.is_finished:  # aborted, or ended by a stop string, while the step ran
            return []
        s = output.sample
        want = seq.params.logprobs
        tops: list[Any] = [None] * count
        if want:
            tops = [[(int(i), float(v)) for i, v in zip(s.top_ids[k, row][:want], s.top_logprobs[k, row][:want])]
                    for k in range(count)]
        return self.post.accept(seq, s.token[:count, row].tolist(), s.logprob[:count, row].tolist(), tops)

    # ---- prompt logprobs ---------------------------------------------------------------------
    def _prompt_targets(self, chunk: PrefillChunk) -> PromptTargets | None:
        """For each computed position p, the prompt token p+1 whose logprob it yields (or -1)."""
        seq = chunk.seq
        req = self.requests.get(seq.request_id)
        if req is None or req.prompt_logprobs is None or seq.sample_index != 0 or req.prompt_logprobs_sent:
            return None
        first = max(seq.params.prompt_logprobs_start, 1)
        n = seq.num_prompt_tokens
        targets = [seq.token_ids[p + 1] if first <= p + 1 < n else -1 for p in range(chunk.start, chunk.end)]
        if all(t < 0 for t in targets):
            return None
        return targets, seq.params.prompt_logprobs or 0

    def _store_prompt_logprobs(self, chunks: list[PrefillChunk], targets: list[PromptTargets | None], prompt: Any) -> None:
        row = 0
        for chunk, target in zip(chunks, targets):
            req = self.requests.get(chunk.seq.request_id) if target is not None else None
            if req is not None:  # (None: no logprobs asked here, or aborted while the step ran)
                ids, n_top = target
                for i, tid in enumerate(ids):
                    if tid >= 0:
                        r = row + i
                        top = [(int(a), float(b)) for a, b in zip(prompt.top_ids[r][:n_top], prompt.top_logprobs[r][:n_top])]
                        req.prompt_logprobs[chunk.start + i + 1] = TokenLogprob(tid, float(prompt.logprob[r]), top,
                                                                                int(prompt.rank[r]))
            row += chunk.num_tokens

    # ---- what the server sees ---------------------------------------------------------------------
    def _publish(self) -> None:
        alloc = self.scheduler.allocator
        self.stats = Stats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_used_pages=alloc.num_used_pages, num_usable_pages=alloc.num_usable_pages,
            prefix_cache_hit_rate=alloc.prefix_cache_hit_rate, num_preemptions=self.num_preemptions,
            num_steps=self.num_steps, request_ids=frozenset(self.requests),
            num_draft_tokens=self.num_draft_tokens, num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            step_calls=self._dispatcher.calls, step_call_seconds=self._dispatcher.call_seconds,
            step_handover_seconds=self._dispatcher.handover_seconds,
            running_loras=_adapters(self.scheduler.running) if self.lora is not None else (),
            waiting_loras=_adapters(self.scheduler.waiting) if self.lora is not None else (),
        )

    def close(self) -> None:
        """After the last step (from the thread that ran the steps): a multi-host job's other
        processes are told to stop."""
        self._dispatcher.close()  # returns once the step in flight, if any, has ended
        self.runner.close()

    def check_idle_integrity(self) -> None:
        """The scheduler's invariants; when nothing runs or waits, free + cached pages == all pages."""
        self.scheduler.check_idle_integrity()


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The LoRA adapters these sequences decode with, sorted."""
    return tuple(sorted({s.params.lora for s in seqs if s.params.lora is not None}))


def _sampling_seqs(out: SchedulerOutput) -> list[Sequence]:
    return [c.seq for c in out.prefills if c.samples] + out.decodes


def speculation_defaults(params: SamplingParams, info: EngineInfo) -> SamplingParams:
    """`params` with the deployment's drafting default when the request chose nothing (OVMS's
    order: the request, then generation_config.json, then --num-speculative-tokens)."""
    if params.num_assistant_tokens is not None or params.assistant_confidence_threshold is not None:
        return params
    if params.use_beam_search or info.speculative_method is None:
        return params
    if info.default_confidence_threshold is not None:
        return dataclasses.replace(params, assistant_confidence_threshold=info.default_confidence_threshold)
    if info.default_assistant_tokens is not None:
        return dataclasses.replace(params, num_assistant_tokens=info.default_assistant_tokens)
    return params


def check_speculation(params: SamplingParams, info: EngineInfo) -> None:
    """Per-request speculative-decoding parameters: only on a server that speculates (and that
    speculates the way they apply to), within what its verify steps were compiled for."""
    threshold = params.assistant_confidence_threshold
    if threshold is not None and params.num_assistant_tokens is not None:  # OVMS's rule
        raise InvalidRequestError("assistant_confidence_threshold", "num_assistant_tokens and "
                                  "assistant_confidence_threshold are mutually exclusive: give one at most")
    off = {"num_assistant_tokens": params.num_assistant_tokens not in (None, 0),  # 0 (off) is honoured anywhere
           "max_ngram_size": params.max_ngram_size is not None, "assistant_confidence_threshold": threshold is not None}
    for name, asked in off.items():
        if asked and info.speculative_method is None:
            raise InvalidRequestError(name, "speculative decoding is off on this server; start it with "
                                      "--speculative-method ngram (prompt lookup) or --speculative-model (a draft model)")
    if params.max_ngram_size is not None and info.speculative_method != "ngram":
        raise InvalidRequestError("max_ngram_size", "applies to prompt-lookup decoding, and this server drafts "
                                  "with a draft model")
    if threshold is not None:
        if info.speculative_method != "draft":
            raise InvalidRequestError("assistant_confidence_threshold", "it needs a draft model "
                                      "(--speculative-model); prompt lookup uses num_assistant_tokens")
        _float_range("assistant_confidence_threshold", threshold, 0.0, 1.0)
    if params.num_assistant_tokens is not None:
        _int_range("num_assistant_tokens", params.num_assistant_tokens, 0, info.num_speculative_tokens or 0)
    if params.max_ngram_size is not None:
        _int_range("max_ngram_size", params.max_ngram_size, 1, MAX_NGRAM_SIZE)


def validate_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    """A prompt the model can read: not empty, every id inside the vocabulary."""
    if not prompt_ids:
        raise InvalidRequestError("prompt", "the prompt is empty")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


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
