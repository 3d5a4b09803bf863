"""Streaming detokenization: deltas concatenate to exactly the full decode, never show U+FFFD."""

from __future__ import annotations

import random

import pytest

from jaxserve.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

pytestmark = pytest.mark.slow  # needs the SmolLM2 tokenizer (converted from GGUF once per run)

PIECES = [
    "hello", " world", "The", " quick", ",", ".", "\n", "  ", "\t", "42", " 3.14",
    "café", " naïve", " Ångström", "über", "日本語", "中文字符", "한국어", "Привет", "مرحبا",
    "🙂", "👍🏽", "🇫🇷", "∑∫√", "€", "—", "ß", "œ", "ﬁ", "𝔘𝔫𝔦", " ", "'s", "<", "|", ">",
]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))


def _stream(tokenizer, ids, **opts) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **opts)
    deltas = [detok.add([t]) for t in ids]
    return deltas + [detok.finish()]


def test_stream_concatenates_to_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(1234)
    split_chars = 0
    for _ in range(200):
        ids = tok.encode(_random_text(rng), add_special_tokens=False)
        # Lone byte tokens prove multi-byte characters really were split across tokens.
        split_chars += sum(REPLACEMENT_CHAR in tok.decode([t]) for t in ids)
        deltas = _stream(tok, ids)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids)
    assert split_chars > 100


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_in_stream(smollm2_tokenizer, skip, spaces):
    tok = smollm2_tokenizer
    rng = random.Random(7)
    specials = sorted(tok.special_ids)
    for _ in range(50):
        # Special tokens between complete texts (inside a character they would make the text
        # itself invalid UTF-8, and then U+FFFD is the right decode).
        ids = []
        for _ in range(rng.randint(1, 3)):
            ids += tok.encode(_random_text(rng), add_special_tokens=False) + [rng.choice(specials)]
        ids += tok.encode(_random_text(rng), add_special_tokens=False)
        deltas = _stream(tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert not any(REPLACEMENT_CHAR in d for d in deltas), (ids, deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)


def test_special_token_rendering(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi", add_special_tokens=False) + [2] + tok.encode("there", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "Hithere"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "Hi<|im_end|>there"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) == "Hi <|im_end|> there"


def test_text_is_released_only_when_complete(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes are split across byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🙂"
