"""Continuous batching on the host: admission by page budget, chunked prefill, preemption by recompute.

One engine iteration runs the output's PREFILL step (ragged chunks, at most max_prefill_seqs
sequences and max_num_batched_tokens tokens) and then its DECODE step (`num_steps` tokens for each
decoding sequence, run on the device without the host in between). A running sequence is in exactly
one phase:

  prefill  never sampled yet, or recomputing after preemption: the next chunk computes the K/V of
           token_ids[num_computed_tokens:end]; the chunk with end == num_tokens also samples a token
  decode   sampled before and num_computed_tokens == num_tokens - 1: each of the step's iterations
           writes the K/V of the last (sampled) token and samples the next one

Every running sequence holds a slot: its row of the device's persistent batch (sampling
parameters, penalty counts, grammar mask, page table), given at admission and taken back when it
finishes or is preempted. `SchedulerOutput` is the step's diff for the device: which sequences got
a slot, which slots were freed, and what each row computes.

Engine contract, once per iteration, all on the engine thread (the scheduler is not thread-safe):

  out = scheduler.schedule()
  run out.prefills, then out.decodes, on the device
  seq.token_ids += tokens         # what each sampling row produced: one per prefill chunk with
                                  # chunk.samples, 1..out.num_steps per decode (fewer when it ended)
  scheduler.advance(out, counts)  # num_computed_tokens += computed tokens; full pages -> prefix cache
  scheduler.finish(seq, reason)   # for each stop: EOS, stop id/string, num_tokens == max_total_tokens

While a decode step runs, the engine may plan the next one before appending its tokens
(`schedule_ahead`: rows assumed to run all of the running step's iterations); it is then advanced
like any other, after the step it followed.

The engine never sets num_computed_tokens, pages, slots or status itself. `abort(request_id)` may
be called between iterations; a sequence finished or aborted while its step ran is skipped by
`advance`.

Beam search (jaxserve.engine.beam): a beam request holds `width` slots from its first admission
to its end (its running beams' and spares for beams not forked yet), so that its beams never wait
for one another's rows. Its beams run in lockstep: a beam that has sampled (all its tokens
computed, none appended) waits, unscheduled, until every beam of its request has, and the engine
calls `fork_beams` with the continuations the search chose. A forked beam shares its parent's full
pages (reference counts) and gets a copy of the partial last one (`SchedulerOutput.copies`, run on
the device before the step). Preempting a beam preempts all of its request's beams.

LoRA adapters (`adapters`, jaxserve.engine.lora_slots): a sequence decoding with an adapter is
admitted only with its adapter in one of the model's adapter slots, taken at admission (evicting an
adapter no running sequence reads). One that cannot have one waits, and so do the adapter sequences
queued after it, so that the slots drain for it in arrival order instead of serving the adapters
already in them forever; base-model sequences behind it are still admitted.

LongRoPE (`rope_switch`, a Phi-3 model's original_max_position): HF's Phi3 rotates a sequence by
its short factors while it is at most that long, and once it is longer recomputes its whole cache
with the long ones. Here alike: a sequence admitted longer than the switch is computed long
(`Sequence.long_rope`), and a short one that grows past it is preempted and recomputed long
(never inside a multi-step decode loop or a verify step: its iterations and drafts stop short of
the switch). Long and short pages never share the prefix cache.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from jaxserve.config import SchedulerConfig
from jaxserve.engine.beam import BeamSearch, Continuation
from jaxserve.engine.ngram import MAX_NGRAM_SIZE, NgramDrafter
from jaxserve.engine.pages import NULL_PAGE, PageAllocator, salted_root
from jaxserve.engine.request import FinishReason, Sequence, SequenceStatus
from jaxserve.errors import InvalidRequestError, RequestTooLongError

if TYPE_CHECKING:
    from jaxserve.engine.lora_slots import LoraSlots


@dataclasses.dataclass
class PrefillChunk:
    """Compute the K/V of seq.token_ids[start:end]; the chunk that reaches the last token samples."""

    seq: Sequence
    start: int
    end: int
    samples: bool = dataclasses.field(init=False)  # fixed at plan time: the engine appends tokens later

    def __post_init__(self) -> None:
        self.samples = self.end == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class SchedulerOutput:
    """One step, as a diff of the device's persistent batch."""

    prefills: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decodes: list[Sequence] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)  # now WAITING, pages and slot freed
    added: list[Sequence] = dataclasses.field(default_factory=list)  # got a slot this step (new or resumed)
    removed: list[int] = dataclasses.field(default_factory=list)  # slots freed since the last output
    # (slot, pages kept) of page lists cut back since the last output (a verify step's unused
    # pages): the device's page-table entries from there on are stale and must be resent.
    cut: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    num_steps: int = 1  # decode iterations run on the device; pages are reserved for all of them
    # Speculative decoding: draft tokens of decoding rows (jaxserve.engine.ngram); when any row has
    # some, the decodes run as one verify step (num_steps 1) and pages are reserved for the drafts.
    drafts: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)
    # (source, destination) KV pages to copy before the step: the partial last pages of forked beams.
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # A step planned ahead (`Scheduler.schedule_ahead`): the tokens each decode row is assumed to
    # sample in the step still running, not in its token_ids yet; its next token is on the device.
    ahead: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefills)

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


def is_decoding(seq: Sequence) -> bool:
    return seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != the allocator's {allocator.page_size}")
        if config.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {config.decode_steps}")
        if config.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be 'ngram', 'draft' or None, got {config.speculative_method!r}")
        if config.speculative_method is not None and (
                config.num_speculative_tokens < 1 or not 1 <= config.max_ngram_size <= MAX_NGRAM_SIZE
                or config.min_ngram_size < 1):
            raise ValueError(f"speculative decoding needs num_speculative_tokens >= 1, max_ngram_size in [1, "
                             f"{MAX_NGRAM_SIZE}] and min_ngram_size >= 1, got {config.num_speculative_tokens}, "
                             f"{config.max_ngram_size} and {config.min_ngram_size}")
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        # Sample 0 of an n > 1 request whose prompt is not computed yet; its siblings wait for it
        # so that they find the prompt's full pages in the prefix cache instead of computing them.
        self._leaders: dict[str, Sequence] = {}
        # Rows of the device batch: at most max_num_seqs sequences run, each in its own slot.
        self._free_slots: list[int] = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self._freed: list[int] = []  # slots freed since the last output
        self._cut: list[tuple[int, int]] = []  # page lists cut back since the last output
        self._added: list[Sequence] = []  # beams forked into new sequences since the last output
        self._copies: list[tuple[int, int]] = []  # pages forked beams need copied
        self.adapters: LoraSlots | None = None  # the model's LoRA adapter slots (set by the engine's builder)
        # A LongRoPE model's original_max_position (set by the engine's builder; None: any other):
        # a sequence longer than it rotates by the long factors.
        self.rope_switch: int | None = None

    def running_adapters(self) -> set[str]:
        """The LoRA adapters running sequences decode with: their slots cannot be given away."""
        return {s.params.lora for s in self.running} - {None}

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- admission control --------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's max total tokens (prompt + output), or RequestTooLongError naming the numbers.

        max_tokens=None means "up to the context limit", which is also capped by the KV cache.
        """
        n, limit = num_prompt_tokens, self.config.max_model_len
        usable, size = self.allocator.num_usable_pages, self.page_size
        capacity = usable * size
        if n < 1:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if max_tokens is None:
            total = min(limit, capacity)
            if n >= limit:
                raise RequestTooLongError(
                    "prompt", f"prompt has {n} tokens: the context limit of {limit} tokens leaves no room for output"
                )
            if n >= capacity:
                raise RequestTooLongError(
                    "prompt", f"prompt has {n} tokens: the KV cache holds only {usable} pages ({capacity} tokens)"
                )
            return total
        total = n + max_tokens
        numbers = f"prompt has {n} tokens and max_tokens is {max_tokens}"
        if total > limit:
            raise RequestTooLongError(
                "prompt" if n >= limit else "max_tokens",
                f"{numbers}: {total} exceeds the context limit of {limit} tokens",
            )
        if total > capacity:
            raise RequestTooLongError(
                "prompt" if n >= capacity else "max_tokens",
                f"{numbers}: {total} tokens need {self.allocator.pages_for(total)} KV pages of {size} tokens, "
                f"but the cache holds only {usable} pages ({capacity} tokens)",
            )
        return total

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Add sample 0 of an n > 1 request before its siblings."""
        if seq.status is not SequenceStatus.WAITING or seq.pages or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh waiting sequence")
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        shares_a_page = seq.num_prompt_tokens - 1 >= self.page_size
        if seq.sample_index == 0 and seq.params.num_samples > 1 and shares_a_page and seq.beam is None:
            if self.allocator.enable_prefix_caching:
                self._leaders[seq.request_id] = seq

    # -- one iteration ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Running sequences first, oldest first: under page pressure the newest ones give way.
        for seq in sorted(self.running, key=Sequence.sort_key):
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an older one in this loop
                continue
            start = seq.num_computed_tokens
            if seq.beam is not None and start >= seq.num_tokens:
                continue  # it has sampled: it waits for its request's other beams and the search's choice
            if start >= seq.num_tokens:
                raise RuntimeError(
                    f"sequence {seq.seq_id} has all {seq.num_tokens} tokens computed and none to sample from: "
                    "append the sampled token after advance()"
                )
            if self._short_positions_left(seq) <= 0:
                # Grown past original_max_position: recomputed with the long factors, as HF's Phi3
                # recomputes its whole cache then. Its request's beams go with it.
                self._preempt_planned(seq, plan)
                continue
            if is_decoding(seq):
                if self._reserve(seq, start + 1, plan):
                    plan.decodes.append(seq)
            elif budget > 0 and len(plan.prefills) < self.config.max_prefill_seqs:
                end = min(seq.num_tokens, start + budget)
                if self._reserve(seq, end, plan):
                    plan.prefills.append(PrefillChunk(seq, start, end))
                    budget -= end - start
        # Pages are short right now: admitting would only preempt the newcomer again next step.
        if not plan.preempted:
            self._admit(plan, budget)
        # Several decode iterations only when nothing else needs the host between them. Waiting
        # sequences that _admit could not take (no free row, no pages) do not: a row that ends
        # inside the loop frees its row and pages when the loop returns, so they wait a loop's
        # iterations longer (two loops for a stop string, found a step late under overlap), where
        # single steps cost a host round trip a token. (At 256 concurrent requests on an H100 every
        # step after the first preemption ran one iteration while the preempted waited for pages.)
        if plan.decodes and self.config.speculative_method is not None:
            plan.drafts = self._drafts(plan.decodes)
        if plan.decodes and not plan.prefills and not plan.preempted and not plan.drafts:
            plan.num_steps = self._decode_steps(plan.decodes)
        return self._diff(plan)

    def schedule_ahead(self, last: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after `last`, planned while `last` still runs and before its tokens are
        appended: each of its rows assumed to run all of last.num_steps iterations (the step's
        `ahead`), its next token read on the device. None unless that is the step `schedule()`
        would plan then: `last` decoded every running sequence and nothing else, every row runs
        unattended (no grammar, dynamic bans, beams or drafts), nothing waits to be admitted, and
        the pages for the new step can be had without preempting anyone.

        A row that ends inside `last` was planned on for nothing. Ended by EOS or a stop id, it
        runs no iteration: the device sees its last token end it. Ended by a stop string or an
        abort, its tokens are dropped unread, as a stop string's row a step late always was, and
        its K/V goes past its end, into pages reserved for it here that no one else holds until
        the step has run. A row that reaches its length inside `last` is left out."""
        if (last.prefills or last.drafts or last.preempted or not last.decodes or self.waiting
                or self.config.speculative_method is not None):
            return None
        running = set(self.running)
        live = [s for s in last.decodes if s in running]
        if len(live) != len(running) or not all(s.runs_unattended for s in live):
            return None
        ahead = last.num_steps
        rows = [s for s in live if s.num_tokens + ahead < s.max_total_tokens]
        num_steps = self._reserve_iterations(rows, ahead, least=1) if rows else 0
        if not num_steps:
            return None
        return self._diff(SchedulerOutput(decodes=rows, num_steps=num_steps, ahead=ahead))

    def _diff(self, plan: SchedulerOutput) -> SchedulerOutput:
        """`plan` with what changed on the host since the last output (freed slots, cut page
        lists, forked beams and their page copies)."""
        plan.removed, self._freed = self._freed, []
        plan.cut, self._cut = self._cut, []
        # Forked beams first: a later admission of the same slot cannot come before its fork.
        plan.added = [s for s in self._added if s.slot is not None] + plan.added
        plan.copies, self._added, self._copies = self._copies, [], []
        return plan

    def _decode_steps(self, decodes: list[Sequence]) -> int:
        """Decode iterations for a batch with nothing else to do: up to decode_steps, as long as
        every row can run them unattended (no grammar, no bans that depend on its last tokens) and
        its pages for all of them can be reserved now without preempting anyone. A row that ends
        (EOS, stop id, length) stops inside the loop; the rest of its reservation is freed with it."""
        # Beams take one token a step (the host chooses their next), inside the loop too: the
        # builder ends their rows after one iteration.
        loopers = [s for s in decodes if s.beam is None]
        if not loopers or not all(s.runs_unattended for s in loopers):
            return 1
        # (One iteration's pages are reserved already, by `_reserve`, preempting if need be.)
        return self._reserve_iterations(loopers, 0, least=2) or 1

    def _reserve_iterations(self, rows: list[Sequence], ahead: int, least: int) -> int:
        """The most decode iterations, up to decode_steps and at least `least`, that `rows` (each
        `ahead` tokens past its token_ids) can run with their pages reserved now without
        preempting anyone; reserves them. 0 if not even `least` fit. Under a nearly full cache
        the pages for all of them may not be free while those for fewer are: the most that fit,
        rather than one at once."""
        steps = min(self.config.decode_steps, max(s.max_total_tokens - s.num_tokens - ahead for s in rows))
        # A short-factor row feeds positions below the LongRoPE switch only (its next iteration
        # feeds num_tokens - 1 + ahead); past it, the row is recomputed first.
        steps = int(min([steps] + [self._short_positions_left(s) - ahead for s in rows]))
        for k in range(steps, least - 1, -1):
            want = {s: self.allocator.pages_for(min(s.num_tokens + ahead + k - 1, s.max_total_tokens)) - len(s.pages)
                    for s in rows}
            if self.allocator.can_allocate(sum(want.values())):
                for seq, num_new in want.items():
                    if num_new > 0:
                        seq.pages.extend(self.allocator.allocate(num_new))
                return k
        return 0

    def _drafts(self, decodes: list[Sequence]) -> dict[Sequence, list[int]]:
        """Each speculating row's draft tokens, cut to what its length allows and to the pages that
        can be had without preempting anyone or evicting a cached prefix (drafts are a bet, never
        worth a preemption or a recompute).

        A row speculates unless its request turned it off (num_assistant_tokens 0) or its next
        tokens depend on host or penalty state the verify step does not advance token by token
        inside one step: a grammar, bans that follow its last tokens, or penalties."""
        drafts: dict[Sequence, list[int]] = {}
        for seq in decodes:
            p = seq.params
            want = self.config.num_speculative_tokens if p.num_assistant_tokens is None else p.num_assistant_tokens
            # Verifying d drafts can add d + 1 tokens.
            want = min(want, seq.max_total_tokens - seq.num_tokens - 1)
            # The verify step feeds d + 1 positions: a short-factor row's stay below the switch.
            want = int(min(want, self._short_positions_left(seq) - 1))
            if want <= 0 or p.has_penalties or not seq.runs_unattended:
                continue
            if self.config.speculative_method == "draft":
                # Placeholders: the draft model writes its tokens on the device, after this plan.
                draft = [-1] * want
            else:
                if seq.drafter is None:
                    longest = p.max_ngram_size or self.config.max_ngram_size
                    seq.drafter = NgramDrafter(longest, min(self.config.min_ngram_size, longest))
                seq.drafter.sync(seq.token_ids)
                draft = seq.drafter.propose(want)
            if not draft:
                continue
            # Positions up to num_tokens - 1 + len(draft) are written.
            need = self.allocator.pages_for(seq.num_tokens + len(draft)) - len(seq.pages)
            if need > self.allocator.num_unused_pages:
                room = len(seq.pages) * self.page_size - seq.num_tokens
                draft = draft[:max(0, room)]
                need = 0
            if need > 0:
                seq.pages.extend(self.allocator.allocate(need))
            if draft:
                drafts[seq] = draft
        return drafts

    def _admit(self, plan: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in sort order, stopping at the first that does not fit (FCFS).
        One whose LoRA adapter can get no adapter slot is passed over, and so are the adapter
        sequences after it (see the module's docstring)."""
        i = 0
        adapter_blocked = False
        busy: set[str] | None = None  # running_adapters(), once an adapter sequence asks
        while i < len(self.waiting):
            if budget <= 0 or len(plan.prefills) >= self.config.max_prefill_seqs:
                return
            seq = self.waiting[i]
            adapter = seq.params.lora
            # Held: not a fairness question, it is waiting for its own sample 0.
            if self._is_held(seq) or (adapter is not None and adapter_blocked):
                i += 1
                continue
            if self._slots_needed(seq) > len(self._free_slots):
                return
            tokens = self._matchable_tokens(seq)
            if self.rope_switch is not None:
                seq.long_rope = seq.num_tokens > self.rope_switch  # as HF's forward over all of it
            root = salted_root(seq.params.cache_salt, seq.lora_key, seq.long_rope)
            cached, num_cached = self.allocator.peek_prefix(tokens, root)
            end = min(seq.num_tokens, num_cached + budget)
            num_new = self.allocator.pages_for(end) - len(cached)
            if not self.allocator.can_allocate(num_new, cached):
                return
            if adapter is not None and self.adapters is not None:
                busy = self.running_adapters() if busy is None else busy
                if self.adapters.acquire(adapter, busy) is None:  # the last check: it takes the slot
                    adapter_blocked = True
                    i += 1
                    continue
                busy.add(adapter)
            del self.waiting[i]
            first_admission = seq.num_preemptions == 0
            cached, num_cached = self.allocator.match_prefix(tokens, count_stats=first_admission, root=root)
            seq.pages = cached + self.allocator.allocate(num_new)
            seq.num_computed_tokens = num_cached
            if first_admission:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            seq.slot = self._take_slot(seq)
            self.running.append(seq)
            plan.added.append(seq)
            plan.prefills.append(PrefillChunk(seq, num_cached, end))
            budget -= end - num_cached

    def _matchable_tokens(self, seq: Sequence) -> list[int]:
        """The tokens the prefix cache may serve. Prompt logprobs (reported by sample 0 on its first
        pass) need the logits of every position from prompt_logprobs_start - 1 on, so those
        positions must be computed, not served from the cache."""
        params = seq.params
        if params.prompt_logprobs is not None and seq.sample_index == 0 and seq.num_preemptions == 0:
            return seq.cache_ids[: max(params.prompt_logprobs_start, 1)]
        return seq.cache_ids

    def _slots_needed(self, seq: Sequence) -> int:
        """Free slots admitting `seq` takes: a beam request reserves all of its beams' at once."""
        if seq.beam is None:
            return 1
        return 0 if seq.beam.spare_slots else seq.beam.width

    def _take_slot(self, seq: Sequence) -> int:
        group = seq.beam
        if group is not None and not group.spare_slots:
            group.spare_slots = [heapq.heappop(self._free_slots) for _ in range(group.width)]
        return group.spare_slots.pop() if group is not None else heapq.heappop(self._free_slots)

    def _is_held(self, seq: Sequence) -> bool:
        if seq.beam is not None:
            # A resumed beam waits while another of its request's beams recomputes, then finds
            # their common prefix in the prefix cache instead of computing (and holding) its own.
            return any(s.status is SequenceStatus.RUNNING and s.num_computed_tokens < s.num_tokens
                       for s in seq.beam.members)
        leader = self._leaders.get(seq.request_id)
        return leader is not None and leader is not seq

    def _reserve(self, seq: Sequence, num_tokens: int, plan: SchedulerOutput) -> bool:
        """Give `seq` pages for `num_tokens` tokens, preempting the newest running sequences until
        they fit. False if `seq` itself was the newest and got preempted."""
        num_new = self.allocator.pages_for(num_tokens) - len(seq.pages)
        while num_new > 0 and not self.allocator.can_allocate(num_new):
            victims = self._preempt_planned(max(self.running, key=Sequence.sort_key), plan)
            if seq in victims:
                return False
        if num_new > 0:
            seq.pages.extend(self.allocator.allocate(num_new))
        return True

    def _short_positions_left(self, seq: Sequence) -> float:
        """How many positions, from its next one (num_tokens - 1) on, a sequence may still feed
        with LongRoPE's short factors before it must be recomputed long (inf: any other)."""
        if self.rope_switch is None or seq.long_rope:
            return float("inf")
        return self.rope_switch - (seq.num_tokens - 1)

    def _preempt_planned(self, seq: Sequence, plan: SchedulerOutput) -> list[Sequence]:
        """`_preempt(seq)` while `plan` is being built: the victims are recorded as preempted, and
        a beam group's members planned before it this step run no more."""
        victims = self._preempt(seq)
        plan.preempted += victims
        if victims[0].beam is not None:
            plan.decodes = [s for s in plan.decodes if s not in victims]
            plan.prefills = [c for c in plan.prefills if c.seq not in victims]
            plan.added = [s for s in plan.added if s not in victims]
        return victims

    def _preempt(self, seq: Sequence) -> list[Sequence]:
        """Free everything and requeue: the output so far stays in token_ids and is recomputed
        (cheaply, if its pages are still in the prefix cache). Keeping its arrival puts it ahead of
        everything that arrived after it in its priority. A beam goes with all of its request's
        running beams (they run in lockstep), and their reserved slots are freed. Returns the
        preempted sequences."""
        group = seq.beam
        if group is None:
            self._preempt_one(seq)
            return [seq]
        victims = [s for s in group.members if s.status is SequenceStatus.RUNNING]
        for s in victims:
            self._preempt_one(s)
        self._free_spares(group)
        group.reported.clear()  # recomputed on resumption
        return victims

    def _free_spares(self, group: BeamSearch) -> None:
        for slot in group.spare_slots:
            heapq.heappush(self._free_slots, slot)
        group.spare_slots = []

    def _preempt_one(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        self._release_slot(seq)
        seq.pages = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot is not None:
            heapq.heappush(self._free_slots, seq.slot)
            self._freed.append(seq.slot)
            seq.slot = None

    def advance(self, plan: SchedulerOutput, decoded: Mapping[Sequence, int] | None = None) -> None:
        """Record that the device ran `plan`: advance num_computed_tokens and publish newly full
        pages to the prefix cache. `decoded[seq]` is how many tokens each decode row sampled (its
        iterations that ran; default 1 each), already appended to its token_ids. Call exactly once
        per plan, after appending its tokens and before finishing its sequences."""
        self.advance_prefills(plan)
        for seq in plan.decodes:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += 1 if decoded is None else decoded[seq]
                self._computed(seq)
                if seq in plan.drafts:
                    self._give_back_pages(seq)

    def advance_prefills(self, plan: SchedulerOutput) -> None:
        """The prefill part of `advance`, which may come first: a prefill's computed tokens are
        the prompt's, known before its sampled token is. The engine calls it before accepting a
        step's tokens, so that a sequence that ends on its first token (max_tokens 1, an EOS)
        still leaves its prompt's pages in the prefix cache. Repeating it changes nothing."""
        for chunk in plan.prefills:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = chunk.end
                self._computed(seq)

    # -- beam search ---------------------------------------------------------------------------------

    def check_beam_fits(self, num_prompt_tokens: int, max_total_tokens: int, width: int, name: str = "best_of") -> None:
        """Refuse a beam search that could never run: its beams all run at once, sharing the
        prompt's full pages and each holding its own pages after them."""
        if width > self.config.max_num_seqs:
            raise InvalidRequestError(name, f"beam search with {width} beams needs {width} rows, and this "
                                      f"server runs at most {self.config.max_num_seqs} sequences at once "
                                      "(--max-num-seqs)")
        # Resumed after a preemption, beams share the prompt through the prefix cache only.
        shared = num_prompt_tokens // self.page_size if self.allocator.enable_prefix_caching else 0
        need = shared + width * (self.allocator.pages_for(max_total_tokens) - shared)
        if need > self.allocator.num_usable_pages:
            raise RequestTooLongError(
                "max_tokens", f"{width} beams of up to {max_total_tokens} tokens need {need} KV pages of "
                f"{self.page_size} tokens, but the cache holds only {self.allocator.num_usable_pages}")

    def start_beams(self, group: BeamSearch, seq: Sequence) -> None:
        """Make `seq` (queued with `add`) the first beam of `group`."""
        seq.beam = group
        group.members = [seq]

    def fork_beams(self, group: BeamSearch, continuations: SequenceABC[Continuation]) -> None:
        """Make the group's running beams the search's continuations of its last step: each is
        its parent's sequence followed by its token. A parent's first continuation goes on in
        the parent's own sequence; the others take over sequences whose beams ended, or new
        ones in the group's reserved slots, with the parent's full pages shared and its partial
        last page copied. With no pages for the copies, the group is preempted and recomputed."""
        parents = group.members
        if any(s.status is not SequenceStatus.RUNNING or s.num_computed_tokens != s.num_tokens for s in parents):
            raise RuntimeError("beams fork only when all of them have sampled")
        first: dict[int, int] = {}
        for j, c in enumerate(continuations):
            first.setdefault(c.parent, j)
        ended = [p for i, p in enumerate(parents) if i not in first]
        num_tokens = parents[0].num_tokens
        full, partial = divmod(num_tokens, self.page_size)
        num_copies = len(continuations) - len(first) if partial else 0
        # The ended beams' pages are released first (none is a copy's source: those are parents'),
        # so the copies may take them.
        held = collections.Counter(p for seq in ended for p in seq.pages)
        released = sum(1 for p, n in held.items() if self.allocator.ref_count(p) == n)
        if num_copies > self.allocator.num_free_pages + released:
            self._preempt(parents[0])
            self._assign_beams(group, continuations, first, ended, lambda j, parent: [])
            return
        for seq in ended:
            self.allocator.free(seq.pages)

        def pages_of(j: int, parent: Sequence) -> list[int]:
            if first[continuations[j].parent] == j:
                return parent.pages
            self.allocator.share(parent.pages[:full])
            if not partial:
                return parent.pages[:full]
            (copy,) = self.allocator.allocate(1)
            self._copies.append((parent.pages[full], copy))
            return [*parent.pages[:full], copy]

        self._assign_beams(group, continuations, first, ended, pages_of)

    def _assign_beams(self, group: BeamSearch, continuations: SequenceABC[Continuation], first: dict[int, int],
                      ended: list[Sequence], pages_of) -> None:
        """Build every continuation's tokens and pages from its unchanged parent and hand the
        sequences out (the ended beams' pages are released already)."""
        parents = group.members
        built = []
        for j, c in enumerate(continuations):
            parent = parents[c.parent]
            built.append(([*parent.token_ids, c.token], pages_of(j, parent)))
        running = parents[0].status is SequenceStatus.RUNNING
        members = []
        for j, c in enumerate(continuations):
            tokens, pages = built[j]
            if first[c.parent] == j:
                seq = parents[c.parent]
            elif ended:
                seq = ended.pop()
                if running:
                    keep = next((k for k, (a, b) in enumerate(zip(seq.pages, pages)) if a != b),
                                min(len(seq.pages), len(pages)))
                    self._cut.append((seq.slot, keep))  # the device's page-table entries from `keep` on are stale
            else:
                seq = self._new_beam(group, parents[c.parent], running, max(1, j))
            seq.token_ids = tokens
            if running:
                seq.pages = pages
                seq.num_computed_tokens = len(tokens) - 1
            members.append(seq)
        # Fewer continuations than beams (too few candidates that do not end): the leftover beams
        # end, and their slots stay reserved for the group.
        for seq in ended:
            if running:
                self.running.remove(seq)
                group.spare_slots.append(seq.slot)
                seq.slot = None
            else:
                self.waiting.remove(seq)
            seq.pages, seq.status = [], SequenceStatus.FINISHED
        group.members = members
        group.reported.clear()

    def _new_beam(self, group: BeamSearch, parent: Sequence, running: bool, index: int) -> Sequence:
        # Same arrival and priority: the request's beams stay together in the scheduling order.
        seq = Sequence(request_id=parent.request_id, token_ids=[], num_prompt_tokens=parent.num_prompt_tokens,
                       params=parent.params, max_total_tokens=parent.max_total_tokens, priority=parent.priority,
                       arrival=parent.arrival, sample_index=index, seed=parent.seed, beam=group,
                       embeds=parent.embeds, prompt_keys=parent.prompt_keys, rope_positions=parent.rope_positions,
                       rope_delta=parent.rope_delta, lora_key=parent.lora_key)
        if running:
            seq.status = SequenceStatus.RUNNING
            seq.slot = group.spare_slots.pop()
            self.running.append(seq)
            self._added.append(seq)
        else:
            bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        return seq

    def _give_back_pages(self, seq: Sequence) -> None:
        """Free the pages reserved for rejected draft tokens (beyond the pages the sequence's
        tokens and its next step need); they hold nothing anyone will read."""
        keep = self.allocator.pages_for(seq.num_tokens)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
            self._cut.append((seq.slot, keep))

    def _computed(self, seq: Sequence) -> None:
        self.allocator.register_full_pages(seq)
        if seq.num_computed_tokens >= seq.num_prompt_tokens and self._leaders.get(seq.request_id) is seq:
            del self._leaders[seq.request_id]  # its prompt pages are cached: release the siblings

    # -- endings ------------------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its pages (full computed pages stay in the prefix cache).
        Finishing a finished sequence does nothing, so an abort racing a stop is harmless."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        self._release_slot(seq)
        seq.pages = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self._leaders.get(seq.request_id) is seq:
            del self._leaders[seq.request_id]
        if seq.beam is not None and all(s.is_finished for s in seq.beam.members):
            self._free_spares(seq.beam)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with FinishReason.ABORT; returns them."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)
        return seqs

    # -- invariants ---------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every page reference is held by exactly one running sequence's
        page list and waiting sequences hold nothing. Valid between iterations."""
        self.allocator.check_invariants()
        problems = []
        held: collections.Counter[int] = collections.Counter()
        slots = [seq.slot for seq in self.running]
        groups = {id(s.beam): s.beam for s in (*self.running, *self.waiting) if s.beam is not None}
        slots += [slot for g in groups.values() for slot in g.spare_slots]  # reserved for beams
        if None in slots or len(set(slots)) != len(slots) or set(slots) & set(self._free_slots):
            problems.append(f"running and reserved slots {slots} are not distinct or overlap the free ones "
                            f"{self._free_slots}")
        for g in groups.values():
            live = [s for s in g.members if s.status is SequenceStatus.RUNNING]
            if len(live) + len(g.spare_slots) != (g.width if live else 0):
                problems.append(f"a beam search of width {g.width} holds {len(live)} running beams and "
                                f"{len(g.spare_slots)} reserved slots")
            if any(s.status is SequenceStatus.FINISHED for s in g.members):
                problems.append("a running beam search has a finished beam")
        if len(slots) + len(self._free_slots) != self.config.max_num_seqs:
            problems.append(f"{len(slots)} running or reserved + {len(self._free_slots)} free slots != "
                            f"{self.config.max_num_seqs}")
        for seq in self.running:
            held.update(seq.pages)
            if seq.status is not SequenceStatus.RUNNING:
                problems.append(f"sequence {seq.seq_id} is in the running queue as {seq.status.value}")
            if len(seq.pages) < self.allocator.pages_for(seq.num_computed_tokens):
                problems.append(f"sequence {seq.seq_id} has computed tokens without pages")
        for seq in self.waiting:
            if seq.pages or seq.num_computed_tokens or seq.slot is not None or seq.status is not SequenceStatus.WAITING:
                problems.append(f"waiting sequence {seq.seq_id} holds pages, a slot or computed tokens")
        if self.adapters is not None:
            resident = set(self.adapters.resident)
            stray = self.running_adapters() - resident
            if stray:
                problems.append(f"running sequences decode with LoRA adapters {sorted(stray)} that hold no slot")
        if held[NULL_PAGE]:
            problems.append("a sequence holds the null page 0")
        for page in range(1, self.allocator.num_pages):
            if self.allocator.ref_count(page) != held[page]:
                problems.append(
                    f"page {page} has ref_count {self.allocator.ref_count(page)} but {held[page]} holders"
                )
        if problems:
            raise RuntimeError("scheduler integrity: " + "; ".join(problems[:16]))

    def check_idle_integrity(self) -> None:
        """`check_integrity`, plus, when nothing runs or waits, free + cached pages == all pages."""
        self.check_integrity()
        if not self.has_unfinished():
            self.allocator.check_idle()
