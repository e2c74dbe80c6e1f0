"""Incremental detokenization equals a full decode; stop strings are held back while streaming."""

from pathlib import Path

import pytest

from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import TextTokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "héllo wörld — 日本語 ✓ emoji 🎉 done",
    "  spaces\n\ttabs",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: TextTokenizer, text: str) -> None:
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.tokenizer, prompt)
    pieces = []
    for token in ids:
        assert detok.update([token]) is None
        pieces.append(detok.new_text(finished=False))
    pieces.append(detok.new_text(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_string_split_across_tokens_is_never_leaked(
    tokenizer: TextTokenizer,
) -> None:
    text = "alpha beta STOP gamma"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.tokenizer, [], stop=["STOP"])
    streamed, hit = "", None
    for token in ids:
        hit = detok.update([token])
        streamed += detok.new_text(finished=hit is not None)
        if hit:
            break
    assert hit == "STOP"
    assert streamed == "alpha beta "
    assert "S" not in streamed  # the first letters of the stop string were held back


def test_include_stop_string(tokenizer: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer.tokenizer, [], stop=["beta"], include_stop=True)
    assert detok.update(tokenizer.encode("alpha beta gamma")) == "beta"
    assert detok.new_text(finished=True) == "alpha beta"
