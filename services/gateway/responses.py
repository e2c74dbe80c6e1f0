"""OpenAI response bodies and stream chunks, built as plain dicts from the orchestrator's
``ChoiceDelta``s. ``Choice`` accumulates one choice for non-streaming responses; the chunk
builders shape one delta for SSE."""

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.choice import ChoiceDelta, TokenLogprob
from shared.text.tokenizer import TextTokenizer


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, d: ChoiceDelta) -> None:
        self.text += d.text
        self.num_tokens += len(d.token_ids)
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason or self.finish_reason


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
        self._offsets: dict[int, int] = {}  # completions: text offset per choice

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._final_choice(c) for c in choices]
        body["usage"] = usage.body()
        return body

    def chunk(self, index: int, d: ChoiceDelta, first: bool, want_logprobs: bool) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        logprobs = self._logprobs(index, d.logprobs, d.text) if want_logprobs else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if d.text or first:
                delta["content"] = d.text
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
        logprobs = self._logprobs(c.index, c.logprobs, c.text) if c.logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": c.text}
            return {"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}  # fmt: skip
        return {"index": c.index, "text": c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}  # fmt: skip

    def _logprobs(self, index: int, lps: list[TokenLogprob], text: str) -> dict | None:
        if not lps:
            return None
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in lps]}
        offset = self._offsets.get(index, 0)
        tokens = [self.tok.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [self._top_by_text(lp) for lp in lps],
            "text_offset": offsets,
        }

    def _top_by_text(self, lp: TokenLogprob) -> dict[str, float]:
        """The legacy format keys alternatives by text. Distinct tokens can share one (two
        partial UTF-8 sequences both print as '�'): the most probable (``lp.top`` comes most
        likely first) keeps the key, so the sampled greedy token still has the largest value."""
        top: dict[str, float] = {}
        for token_id, value in lp.top:
            top.setdefault(self.tok.token_text(token_id), value)
        return top

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(token_id: int, value: float) -> dict[str, Any]:
            text = self.tok.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(self.tok.token_bytes(token_id))}

        entry = one(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in lp.top]
        return entry
