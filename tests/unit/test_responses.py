"""The gateway's OpenAI response formatting (no services needed): logprobs describe exactly
the text they come with. Token deltas go through ``ChoiceState`` (detokenizer, stop strings)
and ``Formatter`` as the handler drives them, with the tiny model's byte-level BPE tokenizer,
which splits non-ASCII characters across tokens."""

from pathlib import Path
from typing import Any

import pytest

from services.gateway.choice import ChoiceState
from services.gateway.responses import Choice, Formatter, Usage
from shared.protos.baton.v1 import common_pb2, worker_pb2
from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import TextTokenizer

IM_END = 2  # <|im_end|>: a special token the text skips, and an end of turn of the tiny model
TEXTS = ["héllo wörld — 日本語 ✓ emoji 🎉 done", "plain ascii, with punctuation!", "é🎉"]


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model)


def logprobs_of(token_id: int, vocab: int) -> common_pb2.TokenLogprobs:
    """As a worker sends them: the sampled token first, then the rest of the top-3 (here the
    sampled token is the most likely)."""
    ids = [token_id, (token_id + 1) % vocab, (token_id + 7) % vocab]
    return common_pb2.TokenLogprobs(token_ids=ids, logprobs=[-0.25, -1.5, -3.0])


def serve(
    tok: TextTokenizer, ids: list[int], chat: bool, stop: list[str] | None = None, **kw: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The non-streamed body and the streamed chunks of one choice that generated ``ids``,
    one token per engine response, the last with ``finish_reason`` stop (an end token)."""

    def deltas() -> list:
        state = ChoiceState(
            0, IncrementalDetokenizer(tok.tokenizer, tok.encode("Prompt:"), stop or [], **kw), 3
        )
        out = []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            d = worker_pb2.CompletionDelta(
                token_ids=[t], logprobs=[logprobs_of(t, tok.tokenizer.get_vocab_size())],
                finish_reason="stop" if last else "",
            )  # fmt: skip
            out += state.apply(worker_pb2.GenerateResponse(deltas=[d], finished=last))
            if out and out[-1].finish_reason is not None:
                break
        return out

    whole = Choice(0)
    for d in deltas():
        whole.add(d)
    body = Formatter("id", "m", chat, tok).response([whole], Usage())
    fmt = Formatter("id", "m", chat, tok)
    chunks = [fmt.chunk(0, d, i == 0, want_logprobs=True) for i, d in enumerate(deltas())]
    return body, chunks


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choice = chunk["choices"][0]
    return (choice["delta"].get("content") or "") if chat else choice["text"]


def entries(logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [] if logprobs is None else logprobs["content"]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_tokens_join_to_the_text_with_offsets_inside_it(
    tok: TextTokenizer, text: str
) -> None:
    body, chunks = serve(tok, [*tok.encode(text), IM_END], chat=False)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text
    assert "".join(lp["tokens"]) == text
    assert all("\ufffd" not in t for t in lp["tokens"])  # never a byte shown as U+FFFD
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token
    # one entry per generated token: the end token's, which adds nothing, comes last
    assert len(lp["tokens"]) == len(tok.encode(text)) + 1 and lp["tokens"][-1] == ""
    assert lp["text_offset"][-1] == len(text)
    for value, top, token in zip(
        lp["token_logprobs"], lp["top_logprobs"], lp["tokens"], strict=True
    ):
        assert top[token] == value  # the sampled token keyed as the text shows it
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    for c in chunks:  # each chunk's logprobs are those of its own text
        got = c["choices"][0]["logprobs"]
        assert "".join(got["tokens"] if got else []) == chunk_text(c, chat=False)


@pytest.mark.parametrize("text", TEXTS)
def test_chat_logprobs_are_the_content_token_for_token_without_the_end_token(
    tok: TextTokenizer, text: str
) -> None:
    body, chunks = serve(tok, [*tok.encode(text), IM_END], chat=True)
    choice = body["choices"][0]
    content = entries(choice["logprobs"])
    assert choice["message"]["content"] == text
    assert "".join(e["token"] for e in content) == text
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert len(content) == len(tok.encode(text))  # no entry for <|im_end|>
    for e in content:  # the sampled token, most likely here, as its entry shows it
        own = e["top_logprobs"][0]
        assert (own["token"], own["bytes"], own["logprob"]) == (
            e["token"],
            e["bytes"],
            e["logprob"],
        )
        assert len(e["top_logprobs"]) == 3 and all(alt["bytes"] for alt in e["top_logprobs"][1:])
    streamed = [e for c in chunks for e in entries(c["choices"][0]["logprobs"])]
    assert streamed == content
    for c in chunks:
        assert "".join(e["token"] for e in entries(c["choices"][0]["logprobs"])) == chunk_text(
            c, chat=True
        )


def test_an_alternative_that_completes_a_character_shows_it(tok: TextTokenizer) -> None:
    """After the first byte of 'é', the sampled second byte adds 'é'; so would any other
    continuation byte in its place (here 'ö''s second byte makes the byte pair C3 B6)."""
    first, second = tok.encode("é")
    other = tok.encode("ö")[1]
    state = ChoiceState(0, IncrementalDetokenizer(tok.tokenizer, []), 2)
    lps = [
        common_pb2.TokenLogprobs(token_ids=[first], logprobs=[-0.25]),
        common_pb2.TokenLogprobs(token_ids=[second, other], logprobs=[-0.5, -1.0]),
    ]
    d = worker_pb2.CompletionDelta(token_ids=[first, second], logprobs=lps, finish_reason="length")
    [delta] = state.apply(worker_pb2.GenerateResponse(deltas=[d], finished=True))
    chat = Formatter("id", "m", True, tok).chunk(0, delta, True, want_logprobs=True)
    [a, b] = chat["choices"][0]["logprobs"]["content"]
    assert (a["token"], a["bytes"], b["token"], b["bytes"]) == ("", [0xC3], "é", [0xA9])
    assert [t["token"] for t in b["top_logprobs"]] == ["é", "ö"]
    assert a["top_logprobs"][0]["token"] == ""  # the sampled one, as its entry shows it
    legacy = Formatter("id", "m", False, tok).chunk(0, delta, True, want_logprobs=True)
    assert legacy["choices"][0]["logprobs"]["top_logprobs"] == [{"": -0.25}, {"é": -0.5, "ö": -1.0}]


def test_an_alternative_that_leaves_a_character_unfinished_shows_its_bytes(
    tok: TextTokenizer,
) -> None:
    first, second = tok.encode("é")
    other_first = tok.encode("日")[0]  # E6: the first of three bytes
    state = ChoiceState(0, IncrementalDetokenizer(tok.tokenizer, []), 2)
    lps = [
        common_pb2.TokenLogprobs(token_ids=[first, other_first], logprobs=[-0.25, -3]),
        common_pb2.TokenLogprobs(token_ids=[second], logprobs=[-0.5]),
    ]
    d = worker_pb2.CompletionDelta(token_ids=[first, second], logprobs=lps, finish_reason="length")
    [delta] = state.apply(worker_pb2.GenerateResponse(deltas=[d], finished=True))
    legacy = Formatter("id", "m", False, tok).chunk(0, delta, True, want_logprobs=True)
    assert legacy["choices"][0]["logprobs"]["top_logprobs"][0] == {"": -0.25, "bytes:\\xe6": -3}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("stop", "include_stop"),
    # the tiny tokenizer makes "alpha beta ST…" al|p|h|a| be|ta| S|T|…: "a S" and "ha b"
    # (kept) end inside a token
    [("STOP", False), ("STOP", True), ("a S", False), ("ha b", True)],
)
def test_logprobs_end_where_a_stop_string_cuts_the_text(
    tok: TextTokenizer, chat: bool, stop: str, include_stop: bool
) -> None:
    """The tokens past the cut have no entry; a token the cut splits keeps the part of its
    text that stays (and only those bytes)."""
    text = "alpha beta STOPPED gamma délta"
    kept = text[: text.index(stop) + (len(stop) if include_stop else 0)]
    body, chunks = serve(tok, tok.encode(text), chat, [stop], include_stop=include_stop)
    choice = body["choices"][0]
    got = choice["message"]["content"] if chat else choice["text"]
    assert got == kept and choice["finish_reason"] == "stop"
    if chat:
        content = entries(choice["logprobs"])
        tokens = [e["token"] for e in content]
        assert b"".join(bytes(e["bytes"]) for e in content) == kept.encode()
        streamed = [e for c in chunks for e in entries(c["choices"][0]["logprobs"])]
        assert streamed == content
    else:
        tokens = choice["logprobs"]["tokens"]
        assert max(choice["logprobs"]["text_offset"]) < len(kept)
        parts = [c["choices"][0]["logprobs"] for c in chunks]
        streamed_tokens = [t for p in parts if p for t in p["tokens"]]
        assert streamed_tokens == tokens
    assert "".join(tokens) == kept
    assert all(t for t in tokens)  # every kept token adds something (ASCII up to the cut)


def test_a_reply_that_is_only_an_end_token_has_no_logprob_entries(tok: TextTokenizer) -> None:
    body, _ = serve(tok, [IM_END], chat=True)
    choice = body["choices"][0]
    assert choice["message"]["content"] == "" and entries(choice["logprobs"]) == []


def test_a_special_token_inside_the_text_adds_nothing_and_no_bytes(tok: TextTokenizer) -> None:
    """With special tokens skipped, one the model emits mid-reply keeps its entry (it is
    between tokens of the text) with an empty string and no bytes, so both still join to the
    content."""
    ids = [*tok.encode("one"), 1, *tok.encode(" two"), IM_END]  # 1: <|im_start|>
    body, _ = serve(tok, ids, chat=True)
    content = entries(body["choices"][0]["logprobs"])
    assert [e["token"] for e in content] == ["one", "", " two"]
    assert [e["bytes"] for e in content][1] == []
    # and kept, as the text shows them, when the request asks for special tokens
    body, _ = serve(tok, ids, chat=True, skip_special_tokens=False)
    content = entries(body["choices"][0]["logprobs"])
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    assert "<|im_start|>" in body["choices"][0]["message"]["content"]
