"""Incremental detokenization equals a full decode; stop strings are held back while streaming."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.params import SamplingParams

TEXTS = [
    "plain ascii text, with punctuation!",
    "héllo wörld — 日本語 ✓ emoji 🎉 done",
    "  spaces\n\ttabs",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(
    tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    prompt = tokenizer("Prompt:")["input_ids"]
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = []
    for token in ids:
        assert detok.update([token]) is None
        pieces.append(detok.new_text(finished=False))
    pieces.append(detok.new_text(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_string_split_across_tokens_is_never_leaked(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    text = "alpha beta STOP gamma"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    streamed, hit = "", None
    for token in ids:
        hit = detok.update([token])
        streamed += detok.new_text(finished=hit is not None)
        if hit:
            break
    assert hit == "STOP"
    assert streamed == "alpha beta "
    assert "S" not in streamed  # the first letters of the stop string were held back


def test_include_stop_string(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["beta"], include_stop_str_in_output=True)
    )
    assert detok.update(tokenizer("alpha beta gamma")["input_ids"]) == "beta"
    assert detok.new_text(finished=True) == "alpha beta"
