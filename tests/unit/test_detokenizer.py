"""Incremental detokenization equals a full decode; stop strings are held back while streaming."""

from pathlib import Path

import pytest

from shared.text.detokenizer import IncrementalDetokenizer, TokenText
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


@pytest.mark.parametrize("text", TEXTS)
def test_each_token_says_what_it_added(tokenizer: TextTokenizer, text: str) -> None:
    """The texts of the tokens handed out with each piece are that piece; a character split
    across tokens belongs to the token that completes it; the end token adds nothing and
    comes last, with "" at the text's end."""
    ids = [*tokenizer.encode(text), 2]  # 2: <|im_end|>, skipped
    detok = IncrementalDetokenizer(tokenizer.tokenizer, tokenizer.encode("Prompt:"))
    tokens = []
    for i, token in enumerate(ids):
        detok.update([token])
        done = i == len(ids) - 1
        piece = detok.new_text(done)
        new = detok.new_tokens(done)
        assert "".join(t.text for t in new) == piece
        tokens += new
    assert len(tokens) == len(ids)
    assert tokens[-1] == TokenText(len(text), "")
    assert "".join(t.text for t in tokens) == text
    assert all(text[t.offset : t.offset + len(t.text)] == t.text for t in tokens)
    raw = [tokenizer.token_bytes(i) for i in ids[:-1]]
    for t, b in zip(tokens[:-1], raw, strict=True):
        assert t.text == "" or t.text.encode().endswith(b)  # its bytes end its text


def test_hold_back_ends_at_a_token_boundary(tokenizer: TextTokenizer) -> None:
    """With a stop string, text is held back by whole tokens, so each piece handed out is
    exactly the text of the tokens handed out with it."""
    text = "alpha beta gamma délta epsilon"
    detok = IncrementalDetokenizer(tokenizer.tokenizer, [], stop=["never appears"])
    streamed = ""
    for token in tokenizer.encode(text):
        detok.update([token])
        piece = detok.new_text(finished=False)
        assert "".join(t.text for t in detok.new_tokens(finished=False)) == piece
        streamed += piece
    assert len(streamed) <= len(text) - len("never appears") + 1  # the hold-back
    last = detok.new_text(finished=True)
    assert "".join(t.text for t in detok.new_tokens(finished=True)) == last
    assert streamed + last == text


def test_a_token_split_by_a_stop_string_keeps_its_part(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma")
    detok = IncrementalDetokenizer(tokenizer.tokenizer, [], stop=["a g"])
    assert detok.update(ids) == "a g"
    assert detok.new_text(finished=True) == "alpha bet"
    tokens = detok.new_tokens(finished=True)
    assert "".join(t.text for t in tokens) == "alpha bet"
    last = tokens[-1]
    assert last.text + last.cut == tokenizer.decode([ids[len(tokens) - 1]])  # its whole text
