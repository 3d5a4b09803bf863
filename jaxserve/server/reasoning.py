"""Reasoning parsers (`--reasoning-parser`): a reasoning model's think block returned apart from
its answer, as `reasoning_content` beside `content` (FastDeploy's and vLLM's field), in whole
messages and in stream deltas, and the tokens it took counted in
`usage.completion_tokens_details.reasoning_tokens`.

Both supported families write the reasoning between `<think>` and `</think>`:

  deepseek_r1  DeepSeek-R1 and its distills always reason first; newer templates open the block in
               the prompt, so the output may start inside it with no `<think>` of its own. Output
               that never closes the block is all reasoning (cut off while thinking).
  qwen3        Qwen3 reasons when the output opens `<think>` (or the prompt ends inside an open
               one, as templates that open it themselves leave it); otherwise (enable_thinking
               false, or a model that skipped it) the output is all answer.

One incremental parser serves both routes: a whole message is the stream fed in one piece, so the
two can never disagree. A stream never shows a piece of a tag: text that could still become
`<think>` or `</think>` is held until the next piece decides it. The answer's leading blank lines
after `</think>` (Qwen3 writes `</think>\\n\\n`) are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def check_parser(name: str | None) -> str | None:
    """`name` if it is a reasoning parser (None: no parsing); ValueError naming the choices."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def opens_in_reasoning(parser: str, prompt_text: str) -> bool:
    """Whether the output starts inside the think block: for deepseek_r1 unless the prompt ends
    in `</think>`; for qwen3 when the prompt itself ends in an open `<think>` (the template opened it)."""
    tail = prompt_text.rstrip()
    if parser == "deepseek_r1":  # unless a hybrid template closed the block itself (thinking off)
        return not tail.endswith(END)
    return tail.endswith(START)


def may_open(parser: str, prompt_text: str) -> bool:
    """Whether an output that does not start inside the block may still open one: qwen3's, unless
    the template closed an empty block (enable_thinking false); deepseek_r1's never."""
    return parser == "qwen3" and not prompt_text.rstrip().endswith(END)


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (could become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits one output's text, piece by piece, into (reasoning, content) deltas."""

    def __init__(self, opened: bool):
        self._state = "start"  # start -> reasoning -> answer_start -> answer; or start -> answer
        self._opened = opened
        self._held = ""
        self.ended = False  # the think block was closed

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    buf, self._state = stripped[len(START):], "reasoning"
                elif START.startswith(stripped):  # blank or a piece of "<think>": wait
                    self._held = buf
                    return reasoning, content
                else:
                    self._state = "reasoning" if self._opened else "answer"
            elif self._state == "reasoning":
                at = buf.find(END)
                if at >= 0:
                    reasoning += buf[:at]
                    buf, self._state, self.ended = buf[at + len(END):], "answer_start", True
                else:
                    keep = held_suffix(buf, END)
                    reasoning += buf[: len(buf) - keep]
                    self._held = buf[len(buf) - keep:]
                    return reasoning, content
            elif self._state == "answer_start":
                stripped = buf.lstrip("\r\n")
                if not stripped:
                    return reasoning, content  # only blank lines so far: dropped
                buf, self._state = stripped, "answer"
            else:
                content += buf
                buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back is what it was (reasoning or answer)."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self._opened):
            return held, ""
        return "", held

    @property
    def reasoned(self) -> bool:
        """Whether the output entered the think block (so far)."""
        return self._state in ("reasoning", "answer_start") or self.ended


def parse(text: str, opened: bool) -> tuple[str | None, str | None]:
    """A whole output: (reasoning_content, content), None where empty (OpenAI's null)."""
    stream = ReasoningStream(opened)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def reasoning_tokens(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], opened: bool) -> int:
    """Output tokens spent reasoning: up to and including the one that completes `</think>`, or all
    of them while the block is open at the end; 0 when the output never reasoned. (Whole tokens:
    a token that ends the tag and starts the answer counts as reasoning.)"""
    return count_reasoning_tokens(token_ids, decode, opened)[0]


def count_reasoning_tokens(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                           opened: bool) -> tuple[int, bool]:
    """(reasoning_tokens of these tokens, whether their text has closed the block): once closed,
    later tokens cannot change the count, so a stream may keep it."""
    if not token_ids:
        return 0, False
    stream = ReasoningStream(opened)
    stream.feed(decode(token_ids))
    if not stream.ended:
        return (len(token_ids) if stream.reasoned or opened else 0), False
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text closes the block
    while lo < hi:
        mid = (lo + hi) // 2
        probe = ReasoningStream(opened)
        probe.feed(decode(token_ids[:mid]))
        if probe.ended:
            hi = mid
        else:
            lo = mid + 1
    return lo, True


class ReasoningCounter:
    """One output's reasoning tokens while its tokens arrive: count_reasoning_tokens of all of them,
    computed once per new token and kept for good once the block has closed."""

    def __init__(self, decode: Callable[[Sequence[int]], str], opened: bool):
        self.decode, self.opened = decode, opened
        self.token_ids: list[int] = []
        self._counted: tuple[int, tuple[int, bool]] = (0, (0, False))  # (tokens seen, their count)

    def add(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)

    def count(self) -> tuple[int, bool]:
        """(reasoning tokens so far, whether the block has closed)."""
        seen, result = self._counted
        if seen != len(self.token_ids) and not result[1]:
            result = count_reasoning_tokens(self.token_ids, self.decode, self.opened)
            self._counted = (len(self.token_ids), result)
        return result

