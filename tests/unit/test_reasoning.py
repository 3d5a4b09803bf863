"""Reasoning parsers on outputs written in each family's documented format: the whole-message parse,
and the same output streamed one character at a time and in random pieces, which must give the
same reasoning and answer and never show a piece of a tag."""

from __future__ import annotations

import random

import pytest

from jaxserve.server.reasoning import (
    ReasoningCounter,
    ReasoningStream,
    check_parser,
    opens_in_reasoning,
    parse,
    reasoning_tokens,
)

# (parser, prompt tail, output, reasoning_content, content)
CASES = [
    # DeepSeek-R1, template opening the block in the prompt: the output starts inside it.
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.",
     "Okay, 2 + 2 is 4.\n", "The answer is 4."),
    # DeepSeek-R1, older template: the model opens the block itself.
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nLet me see.\n</think>\n\n4", "\nLet me see.\n", "4"),
    # Cut off while thinking (max_tokens): all reasoning, no answer.
    ("deepseek_r1", "<｜Assistant｜>", "Hmm, first I need to", "Hmm, first I need to", None),
    # Qwen3 thinking mode: the model opens the block.
    ("qwen3", "<|im_start|>assistant\n", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "Hello! How can I help?"),
    # Qwen3 with enable_thinking false: the template writes an empty block, the output is all answer.
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello! How can I help?", None,
     "Hello! How can I help?"),
    # Qwen3 under a template that opens the block itself.
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Short.\n</think>\n\nHi.", "Short.\n", "Hi."),
    # A hybrid template with thinking off closes the block in the prompt: deepseek_r1 output is answer.
    ("deepseek_r1", "<｜Assistant｜></think>", "Hello.", None, "Hello."),
    # Windows line ends after the block are dropped like "\n".
    ("qwen3", "assistant\n", "<think>x</think>\r\n\r\nHi", "x", "Hi"),
    # Text that looks like a tag's start but is not one stays where it is.
    ("qwen3", "assistant\n", "<thin ice>", None, "<thin ice>"),
    ("deepseek_r1", "", "a </thinker> b</think>c", "a </thinker> b", "c"),
    ("deepseek_r1", "", "<think>x</think>", "x", None),
    # An answer that mentions the tag after the block ends is answer text.
    ("deepseek_r1", "", "r</think>use </think> like this", "r", "use </think> like this"),
]


@pytest.mark.parametrize("parser,prompt,output,reasoning,content", CASES)
def test_whole_and_streamed_parses_agree(parser, prompt, output, reasoning, content):
    opened = opens_in_reasoning(parser, prompt)
    assert parse(output, opened) == (reasoning, content)
    rng = random.Random(hash(output) & 0xFFFF)
    cuts = [[1] * len(output)] + [[rng.randint(1, 6) for _ in range(len(output))] for _ in range(20)]
    for sizes in cuts:
        stream, r, c, at = ReasoningStream(opened), "", "", 0
        for size in sizes:
            if at >= len(output):
                break
            dr, dc = stream.feed(output[at:at + size])
            at += size
            r, c = r + dr, c + dc
            # What was sent is final: never a piece of a tag that later turns out to be one.
            assert (reasoning or "").startswith(r) and (content or "").startswith(c), (sizes, r, c)
        dr, dc = stream.finish()
        assert ((r + dr) or None, (c + dc) or None) == (reasoning, content)


def test_reasoning_tokens_count_up_to_the_closing_tag():
    pieces = ["Ok", "ay", ", ", "4", ".</", "think", ">\n\n", "Four", "."]

    def decode(ids):  # token i is pieces[i]
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    assert reasoning_tokens(ids, decode, opened=True) == 7  # through ">\n\n", which completes the tag
    assert reasoning_tokens(ids[:5], decode, opened=True) == 5  # still thinking: all of them
    assert reasoning_tokens([7, 8], decode, opened=False) == 0
    assert reasoning_tokens([], decode, opened=True) == 0

    # As tokens arrive: the same counts; asked twice, counted once; after the close, never again.
    calls = []
    counter = ReasoningCounter(lambda ids: calls.append(len(ids)) or decode(ids), opened=True)
    seen, decodes = [], []
    for i in ids:
        counter.add([i])
        seen.append(counter.count())
        decodes.append(len(calls))
        assert counter.count() == seen[-1] and len(calls) == decodes[-1]
    assert seen == [(k, False) for k in range(1, 7)] + [(7, True)] * 3
    assert decodes[-1] == decodes[-3]  # the two tokens after the close decoded nothing


def test_unknown_parser_is_refused():
    assert check_parser(None) is None and check_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        check_parser("hermes")
