"""A step's diff as the device takes it: the commands that update the device batch and run the
step, built from a SchedulerOutput (NumPy only, no jax).

Every command has a fixed-shape payload (its key names the compiled program and its size), so the
runner compiles them all at start-up and the multi-host channel sends them as they are. What a
step sends is bounded by its bucket and by what changed (new rows, new pages, grammar masks),
never by max_model_len: page tables, penalty counts and sampling parameters stay on the device.

Commands, in the order they run:
  ("copy", C)          KV pages to copy (forked beams' partial last pages), in chunks of C pairs
  ("rows", A)          rows given a slot this step (A rows, padded to a power of two)
  ("tokens", C)        token ids their penalties need (a resumed row's output, a prompt for the
                       repetition penalty), in chunks of C
  ("pages", C)         page-table entries that do not fit the step's own (a long cached prefix)
  ("masks", G)         this step's grammar masks of constrained rows
  ("bans", G)          this step's bans of rows whose bad words depend on their last tokens
  ("prefill", T, S)    the prefill step: T tokens of up to S chunks
  ("decode", S)        the decode step: S rows, 1..decode_steps iterations
  ("verify", T, S)     instead of the decode step when some row has draft tokens (speculative
                       decoding): each of S rows' last token and drafts, T = S * (drafts + 1)

With a draft model (jaxserve.engine.drafting) a verify step also carries its draft loop: a
("decode", S) command for the draft model's runner, whose sampled tokens become the verify
step's drafts; its rows' page-table entries then travel as "pages" commands, which both runners
take.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import numpy as np

from jaxserve.engine.buckets import BucketTable, powers_of_two
from jaxserve.engine.embeds import fill_chunk
from jaxserve.engine.request import Sequence
from jaxserve.engine.rows import MAX_BANNED_IDS, ROW_ARRAYS, RowParams, current_bans, mask_words, pack_rows
from jaxserve.engine.scheduler import PrefillChunk, SchedulerOutput

Key = tuple
Payload = dict[str, np.ndarray]
TOKEN_CHUNK = 1024  # token ids per "tokens" command
PAGE_CHUNK = 1024  # page-table entries per "pages" command
COPY_CHUNK = 16  # (source, destination) page pairs per "copy" command

# Prompt logprobs a prefill chunk reports: for each of its tokens the next prompt token (or -1),
# and how many top alternatives.
PromptTargets = tuple[list[int], int]


@dataclasses.dataclass(frozen=True)
class Command:
    key: Key
    payload: Payload

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.payload.values())


@dataclasses.dataclass
class DraftLoop:
    """A draft model's decode loop for a verify step: row i of `command` drafts `drafts[seq]`'s
    placeholders for rows[i] = (seq, where its drafts start in the verify step's tokens)."""

    command: Command
    rows: list[tuple[Sequence, int]]
    drafts: dict[Sequence, list[int]]  # the plan's: the drafting runner writes the real tokens in


@dataclasses.dataclass
class StepCommands:
    """What one SchedulerOutput becomes: the commands, and where each sampling row's outputs are."""

    commands: list[Command]
    prefill: Key | None = None  # the prefill step's key (its outputs are rows of its chunks, in order)
    decode: Key | None = None
    draft_loop: DraftLoop | None = None  # runs before the verify step (draft-model speculation)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.commands)


class StepInputBuilder:
    def __init__(
        self,
        *,
        num_slots: int,
        vocab_size: int,
        page_size: int,
        max_pages_per_seq: int,
        buckets: BucketTable,
        max_prefill_seqs: int,
        decode_steps: int,
        row_params: Callable[[Sequence], RowParams],
        num_speculative_tokens: int = 0,
        draft_model: bool = False,
        embed_dim: int = 0,
        embed_dtype: np.dtype = np.dtype(np.float32),
        mrope: bool = False,
    ):
        self.num_slots = num_slots  # including the padding slot num_slots - 1
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.buckets = buckets
        self.max_prefill_seqs = max_prefill_seqs
        self.decode_steps = decode_steps
        self.row_params = row_params
        self.num_speculative_tokens = num_speculative_tokens  # verify steps are compiled when > 0
        self.draft_model = draft_model  # drafts come from a draft model's decode loop
        # > 0: prefill steps carry an embedding per token (images, input_embeds: jaxserve.engine.embeds)
        self.embed_dim = embed_dim
        self.embed_dtype = np.dtype(embed_dtype)
        # M-RoPE (Qwen2.5-VL): ragged steps carry each token's 3-axis rotary positions, decode steps
        # each row's offset from its index.
        self.mrope = mrope
        self.row_sizes = powers_of_two(1, num_slots - 1)
        self._synced = [0] * num_slots  # page-table entries the device has, per slot

    # ---- shapes ---------------------------------------------------------------------------------
    def prefill_key(self, num_tokens: int) -> Key:
        tokens = self.buckets.prefill_bucket(num_tokens)
        return ("prefill", tokens, min(self.max_prefill_seqs, tokens))

    def decode_key(self, num_seqs: int) -> Key:
        return ("decode", self.buckets.decode_bucket(num_seqs))

    def verify_key(self, num_seqs: int) -> Key:
        seqs = self.buckets.decode_bucket(num_seqs)
        return ("verify", seqs * (self.num_speculative_tokens + 1), seqs)

    def _step_pages(self, key: Key) -> int:
        """Page-table entries a step carries itself: enough for any chunk that continues a
        sequence, or for every decode iteration."""
        if key[0] in ("prefill", "verify"):
            _, tokens, seqs = key
            return math.ceil(tokens / self.page_size) + seqs
        return key[1] * (math.ceil(self.decode_steps / self.page_size) + 1)

    def keys(self) -> list[Key]:
        """Every command shape the builder can emit (what the runner compiles)."""
        steps = [self.prefill_key(t) for t in self.buckets.prefill_buckets]
        steps += [self.decode_key(b) for b in self.buckets.decode_buckets]
        if self.num_speculative_tokens > 0:
            steps += [self.verify_key(b) for b in self.buckets.decode_buckets]
        updates = [("rows", a) for a in self.row_sizes] + [("masks", g) for g in self.row_sizes]
        updates += [("bans", g) for g in self.row_sizes]
        return updates + [("tokens", TOKEN_CHUNK), ("pages", PAGE_CHUNK), ("copy", COPY_CHUNK)] + steps

    def abstract(self, key: Key) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of every array of `key`'s payload."""
        i32 = np.dtype(np.int32)
        kind = key[0]
        if kind == "rows":
            a = key[1]
            return {"slots": ((a,), i32)} | {n: ((a, *shape), np.dtype(dt)) for n, (dt, shape) in ROW_ARRAYS.items()}
        if kind == "tokens":
            return {"slots": ((key[1],), i32), "ids": ((key[1],), i32), "prompt": ((key[1],), np.dtype(bool))}
        if kind == "pages":
            return {"slots": ((key[1],), i32), "index": ((key[1],), i32), "pages": ((key[1],), i32)}
        if kind == "copy":
            return {"src": ((key[1],), i32), "dst": ((key[1],), i32)}
        if kind == "masks":
            return {"slots": ((key[1],), i32), "masks": ((key[1], mask_words(self.vocab_size)), np.dtype(np.uint32))}
        if kind == "bans":
            return {"slots": ((key[1],), i32), "ids": ((key[1], MAX_BANNED_IDS), i32)}
        u = self._step_pages(key)
        pages = {"page_slots": ((u,), i32), "page_index": ((u,), i32), "page_ids": ((u,), i32)}
        if kind == "prefill":
            _, t, s = key
            # A server that takes embeddings sends a [T, hidden] buffer with every prefill step
            # (the host-to-device copy costs less than compiling each step twice, with and without).
            embeds = {"embeds": ((t, self.embed_dim), self.embed_dtype), "embedded": ((t,), np.dtype(bool))}
            return pages | (embeds if self.embed_dim else {}) | self._rope_spec(key) | {
                "tokens": ((t,), i32), "positions": ((t,), i32), "cu_q_lens": ((s + 1,), i32),
                "kv_lens": ((s,), i32), "num_seqs": ((), i32), "row_slots": ((s,), i32),
                "sample_rows": ((s,), i32), "steps": ((s,), i32), "samples": ((s,), np.dtype(bool)),
                "prompt_targets": ((t,), i32), "prompt_top_n": ((t,), i32),
            }
        if kind == "verify":
            _, t, s = key
            return pages | self._rope_spec(key) | {
                "tokens": ((t,), i32), "positions": ((t,), i32), "cu_q_lens": ((s + 1,), i32),
                "kv_lens": ((s,), i32), "num_seqs": ((), i32), "row_slots": ((s,), i32), "steps": ((s,), i32),
            }
        s = key[1]
        return pages | self._rope_spec(key) | {
            "tokens": ((s,), i32), "positions": ((s,), i32), "num_seqs": ((), i32), "row_slots": ((s,), i32),
            "steps": ((s,), i32), "remaining": ((s,), i32), "num_steps": ((), i32),
            "min_logprob": ((s,), np.dtype(np.float32)),
        }

    def _rope_spec(self, key: Key) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        if not self.mrope:
            return {}
        if key[0] == "decode":
            return {"rope_delta": ((key[1],), np.dtype(np.int32))}
        return {"rope_positions": ((key[1], 3), np.dtype(np.int32))}

    def empty(self, key: Key) -> Payload:
        """A payload of `key` with nothing in it (padding entries, dropped on the device)."""
        out = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.abstract(key).items()}
        for name in ("slots", "page_slots"):
            if name in out:
                out[name].fill(self.num_slots)  # out of range: padding entries are dropped
        if "min_logprob" in out:
            out["min_logprob"].fill(-np.inf)  # no confidence threshold
        return out

    # ---- one step -------------------------------------------------------------------------------
    def build(self, out: SchedulerOutput, prompt_targets: list[PromptTargets | None] | None = None,
              grammar_mask: Callable[[Sequence, np.ndarray], None] | None = None) -> StepCommands:
        """The commands of `out`. prompt_targets[i]: chunk i's prompt logprobs (or None);
        grammar_mask(seq, mask) fills a constrained row's mask for its next token."""
        commands: list[Command] = self._copies(out.copies)
        for slot, kept in out.cut:
            self._synced[slot] = min(self._synced[slot], kept)
        for seq in out.added:
            self._synced[seq.slot] = 0
        commands += self._rows(out.added)
        commands += self._penalty_tokens(out.added)
        sampling = [c.seq for c in out.prefills if c.samples] + out.decodes
        commands += self._masks([s for s in sampling if s.matcher is not None], grammar_mask)
        commands += self._bans([s for s in sampling if s.has_dynamic_bans])
        steps = StepCommands(commands)
        if out.prefills:
            key = self.prefill_key(out.num_prefill_tokens)
            payload = self._prefill(key, out.prefills, prompt_targets)
            commands += self._pages([c.seq for c in out.prefills], payload, key)
            commands.append(Command(key, payload))
            steps.prefill = key
        if out.decodes and out.drafts:
            key = self.verify_key(len(out.decodes))
            payload = self._verify(key, out.decodes, out.drafts)
            commands += self._pages(out.decodes, payload, key, own=not self.draft_model)
            if self.draft_model:
                steps.draft_loop = self._draft_loop(out.decodes, out.drafts, payload)
            commands.append(Command(key, payload))
            steps.decode = key
        elif out.decodes:
            key = self.decode_key(len(out.decodes))
            payload = self._decode(key, out.decodes, out.num_steps, out.ahead)
            commands += self._pages(out.decodes, payload, key)
            commands.append(Command(key, payload))
            steps.decode = key
        return steps

    def _blocks(self, kind: str, items: list) -> Iterable[tuple[Key, list]]:
        """`items` in blocks of at most the largest row size, each padded to a row size."""
        largest = self.row_sizes[-1]
        for start in range(0, len(items), largest):
            block = items[start:start + largest]
            size = next(a for a in self.row_sizes if a >= len(block))
            yield (kind, size), block

    def _copies(self, pairs: list[tuple[int, int]]) -> list[Command]:
        """Page copies, first: they read pages the step (or a later one) may write. Padding pairs
        copy the null page onto itself."""
        commands = []
        for start in range(0, len(pairs), COPY_CHUNK):
            payload = self.empty(("copy", COPY_CHUNK))
            block = pairs[start:start + COPY_CHUNK]
            payload["src"][: len(block)] = [a for a, _ in block]
            payload["dst"][: len(block)] = [b for _, b in block]
            commands.append(Command(("copy", COPY_CHUNK), payload))
        return commands

    def _rows(self, seqs: list[Sequence]) -> list[Command]:
        commands = []
        for key, block in self._blocks("rows", seqs):
            payload = pack_rows([self.row_params(s) for s in block], key[1], self.vocab_size)
            slots = np.full(key[1], self.num_slots, np.int32)
            slots[: len(block)] = [s.slot for s in block]
            commands.append(Command(key, {"slots": slots, **payload}))
        return commands

    def _penalty_tokens(self, seqs: list[Sequence]) -> list[Command]:
        """A new row's penalty state: its output so far (a resumed row) and, for the repetition
        penalty, its prompt. Sent once, when the row gets its slot."""
        slots: list[int] = []
        ids: list[int] = []
        prompt: list[bool] = []
        for seq in seqs:
            p = seq.params
            if p.has_penalties and seq.num_output_tokens:
                out = seq.output_ids
                slots += [seq.slot] * len(out)
                ids += out
                prompt += [False] * len(out)
            if p.repetition_penalty != 1.0:
                slots += [seq.slot] * seq.num_prompt_tokens
                ids += seq.prompt_ids
                prompt += [True] * seq.num_prompt_tokens
        commands = []
        for start in range(0, len(ids), TOKEN_CHUNK):
            payload = self.empty(("tokens", TOKEN_CHUNK))
            n = len(ids[start:start + TOKEN_CHUNK])
            payload["slots"][:n] = slots[start:start + n]
            payload["ids"][:n] = ids[start:start + n]
            payload["prompt"][:n] = prompt[start:start + n]
            commands.append(Command(("tokens", TOKEN_CHUNK), payload))
        return commands

    def _masks(self, seqs: list[Sequence], grammar_mask: Callable[[Sequence, np.ndarray], None] | None) -> list[Command]:
        commands = []
        for key, block in self._blocks("masks", seqs):
            payload = self.empty(key)
            for i, seq in enumerate(block):
                payload["slots"][i] = seq.slot
                if grammar_mask is None:
                    raise ValueError(f"sequence {seq.seq_id} is constrained but no grammar mask was given")
                grammar_mask(seq, payload["masks"][i])
            commands.append(Command(key, payload))
        return commands

    def _bans(self, seqs: list[Sequence]) -> list[Command]:
        commands = []
        for key, block in self._blocks("bans", seqs):
            payload = self.empty(key)
            payload["ids"].fill(-1)
            for i, seq in enumerate(block):
                bans = current_bans(seq)
                payload["slots"][i] = seq.slot
                payload["ids"][i, : len(bans)] = bans
            commands.append(Command(key, payload))
        return commands

    def _pages(self, seqs: list[Sequence], step: Payload, key: Key, own: bool = True) -> list[Command]:
        """New page-table entries of `seqs`: into the step's own payload while they fit (unless
        not `own`), the rest in "pages" commands that run before it."""
        entries: list[tuple[int, int, int]] = []
        for seq in seqs:
            synced = self._synced[seq.slot]
            if len(seq.pages) > synced:
                entries += [(seq.slot, i, seq.pages[i]) for i in range(synced, len(seq.pages))]
                self._synced[seq.slot] = len(seq.pages)
        room = len(step["page_slots"]) if own else 0
        extra, own = entries[: max(0, len(entries) - room)], entries[max(0, len(entries) - room):]
        for i, (slot, index, page) in enumerate(own):
            step["page_slots"][i], step["page_index"][i], step["page_ids"][i] = slot, index, page
        commands = []
        for start in range(0, len(extra), PAGE_CHUNK):
            payload = self.empty(("pages", PAGE_CHUNK))
            for i, (slot, index, page) in enumerate(extra[start:start + PAGE_CHUNK]):
                payload["slots"][i], payload["index"][i], payload["pages"][i] = slot, index, page
            commands.append(Command(("pages", PAGE_CHUNK), payload))
        return commands

    def _prefill(self, key: Key, chunks: list[PrefillChunk], prompt_targets: list[PromptTargets | None] | None) -> Payload:
        p = self._ragged(key, [(c.seq, c.start, c.seq.token_ids[c.start:c.end]) for c in chunks])
        p["prompt_targets"].fill(-1)
        for i, chunk in enumerate(chunks):
            offset, n = p["cu_q_lens"][i], chunk.num_tokens
            if prompt_targets and prompt_targets[i] is not None:
                targets, top_n = prompt_targets[i]
                p["prompt_targets"][offset:offset + n] = targets
                p["prompt_top_n"][offset:offset + n] = top_n
            p["sample_rows"][i] = offset + n - 1
            p["samples"][i] = chunk.samples
            if chunk.seq.embeds:
                if not self.embed_dim:
                    raise ValueError(f"sequence {chunk.seq.seq_id} has embeddings; this engine takes none")
                fill_chunk(chunk.seq.embeds, chunk.start, chunk.end, p["embeds"][offset:offset + n],
                           p["embedded"][offset:offset + n])
        return p

    def _verify(self, key: Key, seqs: list[Sequence], drafts: dict[Sequence, list[int]]) -> Payload:
        """Each row's last token and its drafts (possibly none), ragged like prefill chunks."""
        return self._ragged(key, [(seq, seq.num_tokens - 1, [seq.token_ids[-1], *drafts.get(seq, ())]) for seq in seqs])

    def _draft_loop(self, seqs: list[Sequence], drafts: dict[Sequence, list[int]], verify: Payload) -> DraftLoop:
        """The draft model's decode loop for a verify step: each row from its last token, for as
        many iterations as it has placeholders (a row without drafts runs one, which only writes
        its last token's K/V, as the verify step will too)."""
        key = self.decode_key(len(seqs))
        want = [len(drafts.get(s, ())) for s in seqs]
        payload = self._decode(key, seqs, max(want))
        payload["remaining"][: len(seqs)] = [max(1, w) for w in want]
        # OVMS's assistant_confidence_threshold: a row stops drafting after a token less likely than it.
        for i, seq in enumerate(seqs):
            threshold = seq.params.assistant_confidence_threshold
            if threshold:
                payload["min_logprob"][i] = math.log(threshold)
        rows = [(s, int(verify["cu_q_lens"][i]) + 1) for i, s in enumerate(seqs)]
        return DraftLoop(Command(key, payload), rows, drafts)

    def _ragged(self, key: Key, rows: list[tuple[Sequence, int, list[int]]]) -> Payload:
        """A ragged step's payload (prefill, verify): each row's (sequence, first position,
        tokens) concatenated, with the cumulative lengths, KV lengths, slots and sampling steps."""
        p = self.empty(key)
        p["row_slots"].fill(self.num_slots - 1)  # padding rows read the padding slot
        offset = 0
        for i, (seq, start, tokens) in enumerate(rows):
            n = len(tokens)
            p["tokens"][offset:offset + n] = tokens
            p["positions"][offset:offset + n] = np.arange(start, start + n)
            if self.mrope:
                p["rope_positions"][offset:offset + n] = rope_positions(seq, np.arange(start, start + n))
            p["cu_q_lens"][i + 1] = offset + n
            p["kv_lens"][i] = start + n
            p["row_slots"][i] = seq.slot
            p["steps"][i] = seq.num_output_tokens
            offset += n
        p["cu_q_lens"][len(rows) + 1:] = offset
        p["num_seqs"] = np.int32(len(rows))
        return p

    def _decode(self, key: Key, seqs: list[Sequence], num_steps: int, ahead: int = 0) -> Payload:
        """ahead: the tokens each row samples in the step still running (a step planned ahead:
        its rows' tokens, -1 here, are read on the device)."""
        p = self.empty(key)
        n = len(seqs)
        p["row_slots"].fill(self.num_slots - 1)
        p["tokens"][:n] = [s.token_ids[-1] for s in seqs] if not ahead else -1
        p["positions"][:n] = [s.num_tokens - 1 + ahead for s in seqs]
        p["row_slots"][:n] = [s.slot for s in seqs]
        p["steps"][:n] = [s.num_output_tokens + ahead for s in seqs]
        p["remaining"][:n] = [1 if s.beam is not None else s.max_total_tokens - s.num_tokens - ahead for s in seqs]
        p["num_seqs"] = np.int32(n)
        p["num_steps"] = np.int32(num_steps)
        p["min_logprob"].fill(-np.inf)
        if self.mrope:
            p["rope_delta"][:n] = [s.rope_delta for s in seqs]
        return p


def rope_positions(seq: Sequence, positions: np.ndarray) -> np.ndarray:
    """An M-RoPE model's [n, 3] rotary positions of `seq`'s tokens at `positions`: the prompt's own
    (images take their grid's), every later token its index + the sequence's delta."""
    out = np.repeat((positions + seq.rope_delta)[:, None], 3, axis=1)
    if seq.rope_positions is not None:
        inside = positions < seq.rope_positions.shape[1]
        out[inside] = seq.rope_positions[:, positions[inside]].T
    return out
