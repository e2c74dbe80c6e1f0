"""OpenAI response bodies and stream chunks, built as plain dicts from the orchestrator's
``ChoiceDelta``s. ``Choice`` accumulates one choice for non-streaming responses; the chunk
builders shape one delta for SSE.

Logprobs describe exactly the text they come with: each token's string is the text it added
(``choice.ChoiceState``: a character split across tokens is carried by the token that
completes it, the ones before it show ""), so the strings join to the text and the
completions' ``text_offset`` point into it; chat entries also carry the UTF-8 bytes each
token added (OpenAI's ``bytes``), which join to the content's."""

import codecs
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.choice import ChoiceDelta, TokenLogprob
from services.gateway.tool_parsers import ToolCall, ToolCallDelta
from shared.text.tokenizer import TextTokenizer

_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for (prompt token 1 on)
    tool_calls: list[ToolCall] = field(default_factory=list)  # read from the text (tools.py)

    def add(self, d: ChoiceDelta) -> None:
        self.text += d.text
        self.num_tokens += len(d.token_ids)
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Formatter:
    """Shapes one response; ``chat`` picks the chat or the completions format."""

    def __init__(self, response_id: str, model: str, chat: bool, tokenizer: TextTokenizer):
        self.id, self.model, self.chat, self.tok = response_id, model, chat, tokenizer
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self, choices: list[Choice], usage: Usage, prompt_logprobs: int | None = None
    ) -> dict[str, Any]:
        """``prompt_logprobs``: vLLM's field of that name, with that many top entries: on each
        completion choice, or once beside a chat's choices."""
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._final_choice(c) for c in choices]
        if prompt_logprobs is not None:
            shown = [self._prompt_logprobs(c.prompt_logprobs, prompt_logprobs) for c in choices]
            if self.chat:
                body["prompt_logprobs"] = shown[0] if shown else None
            else:
                for choice, entries in zip(body["choices"], shown, strict=True):
                    choice["prompt_logprobs"] = entries
        body["usage"] = usage.body()
        return body

    def _prompt_logprobs(
        self, lps: list[TokenLogprob] | None, n: int
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} holding the prompt's token and the top ``n``."""
        if lps is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for lp in lps:
            entry = {str(lp.token_id): self._entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, value) in enumerate(lp.top[:n], 1):
                entry.setdefault(str(token_id), self._entry(token_id, value, rank))
            out.append(entry)
        return out

    def _entry(self, token_id: int, logprob: float | None, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.tok.token_text(token_id)}

    def chunk(
        self,
        index: int,
        d: ChoiceDelta,
        first: bool,
        want_logprobs: bool,
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> dict:
        """One chunk of choice ``index``; a chat's may carry tool-call deltas (OpenAI's: the
        first of a call has its index, id, type and name, the next ones argument text)."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        lps = _content(d.logprobs) if self.chat and d.finish_reason else d.logprobs
        logprobs = self._logprobs(lps) if want_logprobs else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if d.text or first:
                delta["content"] = d.text if d.text or not tool_calls else None
            if tool_calls:
                delta["tool_calls"] = _tool_call_deltas(tool_calls)
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": d.text, "logprobs": logprobs}
        choice["finish_reason"] = d.finish_reason
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"], body["usage"] = [], usage.body()
        return body

    def _final_choice(self, c: Choice) -> dict[str, Any]:
        lps = _content(c.logprobs) if self.chat else c.logprobs
        logprobs = self._logprobs(lps) if lps else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.tool_calls:  # OpenAI's: no content beside the calls is null
                message["content"] = c.text if c.text.strip() else None
                message["tool_calls"] = [
                    {"id": t.id, "type": "function",
                     "function": {"name": t.name, "arguments": t.arguments}}
                    for t in c.tool_calls
                ]  # fmt: skip
            return {"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}  # fmt: skip
        return {"index": c.index, "text": c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}  # fmt: skip

    def _logprobs(self, lps: list[TokenLogprob]) -> dict | None:
        """Logprobs of the tokens that make up a piece of text: ``"".join`` of their token
        strings is that text (``choice.ChoiceState`` pairs each token with what it added)."""
        if not lps:
            return None
        rendered = _render(self.tok, lps)
        if self.chat:
            return {"content": [_chat_entry(lp, r) for lp, r in zip(lps, rendered, strict=True)]}
        return {
            "tokens": [lp.text for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                _top_by_text(r.top) if lp.logprob is not None else None
                for lp, r in zip(lps, rendered, strict=True)
            ],  # (none for an echoed prompt's first token)
            "text_offset": [lp.offset for lp in lps],
        }


@dataclass
class _Alternative:
    token: str  # the text it would have added in the sampled token's place
    raw: bytes  # its own UTF-8 bytes
    logprob: float


@dataclass
class _Rendered:
    own: bytes  # the bytes the sampled token added to the text
    top: list[_Alternative]  # most likely first


def _render(tok: TextTokenizer, lps: list[TokenLogprob]) -> list[_Rendered]:
    """Each token's bytes and its alternatives' strings. An alternative is shown as the text it
    would have added in the sampled token's place: after the first bytes of a character it
    would complete it; one that would leave a character unfinished is shown by its bytes,
    OpenAI's ``bytes:\\xe6\\x97``. A character's bytes never cross from one chunk of logprobs to
    the next (the detokenizer hands a character's tokens out together), so ``pending`` starts
    empty each time."""
    out = []
    pending = b""  # bytes of a character that the tokens so far began and did not finish
    for lp in lps:
        own = _own_bytes(tok.token_bytes(lp.token_id), lp, pending)
        top = []
        for token_id, value in lp.top:
            if token_id == lp.token_id:
                top.append(_Alternative(lp.text, own, value))
            else:
                raw = tok.token_bytes(token_id)
                top.append(_Alternative(_as_text(pending + raw, raw), raw, value))
        out.append(_Rendered(own, top))
        pending = pending + own if not lp.text else b""
    return out


def _own_bytes(raw: bytes, lp: TokenLogprob, pending: bytes) -> bytes:
    """The UTF-8 bytes a sampled token added to the text, so that the entries' bytes joined
    are the text's: its own bytes (``raw``), though its text may hold a whole character whose
    first bytes came from the tokens before it (``pending``); none for a token the text skips
    (a special token); without what a stop string cut off."""
    if not lp.text:  # bytes that a later token's text holds (a character it completes), or
        return b"" if _is_utf8(pending + raw) else raw  # a token the text skips
    whole = (lp.text + lp.cut).encode()
    if whole.endswith(raw):
        return raw[: max(0, len(raw) - len(lp.cut.encode()))]
    return lp.text.encode()  # a decoder that changes text (a SentencePiece leading space)


def _as_text(data: bytes, raw: bytes) -> str:
    """``data`` as text, or ``raw`` as OpenAI's ``bytes:\\xNN`` when it ends in the first bytes
    of a character (which add nothing to the text until a later token completes it)."""
    text = _text_if_complete(data)
    if text is None:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _text_if_complete(data: bytes) -> str | None:
    """``data`` decoded (invalid bytes as U+FFFD), or None when it ends in the first bytes of
    a character."""
    decoder = _UTF8_DECODER(errors="replace")
    text = decoder.decode(data)
    return None if decoder.getstate()[0] else text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _tool_call_deltas(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: one entry per call and chunk (the arguments a call's
    pieces carry joined)."""
    out: list[dict[str, Any]] = []
    for t in deltas:
        if out and out[-1]["index"] == t.index and t.id is None:
            out[-1]["function"]["arguments"] += t.arguments
            continue
        entry: dict[str, Any] = {"index": t.index}
        if t.id is not None:
            entry.update(id=t.id, type="function")
            entry["function"] = {"name": t.name, "arguments": t.arguments}
        else:
            entry["function"] = {"arguments": t.arguments}
        out.append(entry)
    return out


def _content(lps: list[TokenLogprob]) -> list[TokenLogprob]:
    """A chat's logprobs describe its content, as OpenAI's do: without the tokens that end the
    reply adding nothing (its end-of-turn token). The legacy completions keep one entry for
    every generated token, as harnesses that slice them by token count expect."""
    end = len(lps)
    while end and not lps[end - 1].text:
        end -= 1
    return lps[:end]


def _top_by_text(top: list[_Alternative]) -> dict[str, float]:
    """The legacy format keys alternatives by text. Distinct tokens can share one: the most
    probable (``top`` comes most likely first) keeps the key, so the sampled greedy token
    still has the largest value."""
    out: dict[str, float] = {}
    for alt in top:
        out.setdefault(alt.token, alt.logprob)
    return out


def _chat_entry(lp: TokenLogprob, r: _Rendered) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": lp.text, "logprob": lp.logprob, "bytes": list(r.own)}
    entry["top_logprobs"] = [
        {"token": alt.token, "logprob": alt.logprob, "bytes": list(alt.raw)} for alt in r.top
    ]
    return entry
