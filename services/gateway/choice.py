"""One choice's progress across worker calls: the token deltas of its GenerateResponses become
``ChoiceDelta``s — detokenized incrementally, cut at a stop string, each token's logprobs paired
with the text it added and handed out with that text (a token that adds nothing at the end, an
end-of-turn token, with "" at the end; none for the tokens a stop string cut off) — and an
engine's error becomes the client's (``errors.from_engine``).

    GenerateResponse (token ids) ─▶ ChoiceState.apply ─▶ ChoiceDelta (text, ids, logprobs, finish)
    PrefillResponse (first token) ─▶ ChoiceState.apply_first ─┘

A worker's first response (the prefill leg's, disaggregated) may carry the prompt's logprobs:
the first delta hands them on (``ChoiceDelta.prompt_logprobs``), and the choice keeps them, so
a resumed call does not ask again.
"""

from dataclasses import dataclass, field

from services.gateway import errors
from shared.protos.baton.v1 import common_pb2, worker_pb2
from shared.text.detokenizer import IncrementalDetokenizer


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing before it predicts it)
    top: list[tuple[int, float]]  # the top-N, most likely first
    text: str = ""  # what the token added to the choice's text (detokenizer.TokenText)
    offset: int = 0  # where that text starts in the choice's text
    cut: str = ""  # the end of its text that a stop string cut off
    rank: int = 0  # of token_id among the model's predictions (1: the most likely)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # set on the first delta of a choice
    # with prompt logprobs, on the first delta: one per prompt token after the first, every
    # top entry the worker sent
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class ChoiceState:
    """One choice's progress across worker calls: tokens so far, its detokenizer."""

    index: int
    detok: IncrementalDetokenizer
    num_logprobs: int | None
    generated: list[int] = field(default_factory=list)
    cached: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # once a worker sent them
    # logprobs of tokens whose text is not handed out yet: they leave with it (a stop string's
    # hold-back, a character not complete yet), or not at all (no text at the very end)
    unreleased: list[TokenLogprob] = field(default_factory=list)

    def apply_first(self, handoff: worker_pb2.PrefillResponse) -> ChoiceDelta:
        """The prefill leg's first token (none when only the prompt was asked for), as if the
        decode stream had sent it."""
        lps = [handoff.first_logprobs] if handoff.HasField("first_logprobs") else []
        first = [handoff.first_token_id] if handoff.HasField("first_token_id") else []
        delta = worker_pb2.CompletionDelta(
            index=self.index, token_ids=first, logprobs=lps, finish_reason=handoff.finish_reason,
        )  # fmt: skip
        resp = worker_pb2.GenerateResponse(
            deltas=[delta], num_prompt_tokens=handoff.num_prompt_tokens,
            num_cached_tokens=handoff.num_cached_tokens, finished=bool(handoff.finish_reason),
            prompt_logprobs=handoff.prompt_logprobs,
        )  # fmt: skip
        return self.apply(resp)[0]

    def apply(self, resp: worker_pb2.GenerateResponse) -> list[ChoiceDelta]:
        if resp.error:
            raise errors.from_engine(resp.error_code, resp.error)
        deltas = []
        for d in resp.deltas:
            delta = ChoiceDelta(self.index, "", list(d.token_ids))
            if self.cached is None:
                self.cached = delta.num_cached_tokens = resp.num_cached_tokens
            if resp.prompt_logprobs and self.prompt_logprobs is None:
                every = [_logprob(lp, len(lp.token_ids)) for lp in resp.prompt_logprobs]
                self.prompt_logprobs = every
                delta.prompt_logprobs = self.prompt_logprobs
            self.generated += d.token_ids
            self.unreleased += [_logprob(lp, self.num_logprobs) for lp in d.logprobs]
            hit = self.detok.update(d.token_ids)
            delta.finish_reason = "stop" if hit is not None else (d.finish_reason or None)
            delta.text = self.detok.new_text(delta.finish_reason is not None)
            delta.logprobs = self._released(delta.finish_reason is not None)
            deltas.append(delta)
            if delta.finish_reason is not None:
                break
        return deltas

    def _released(self, finished: bool) -> list[TokenLogprob]:
        """The logprobs of the tokens whose text ``new_text`` just handed out, each with that
        text: the same tokens, split the same way, streamed or not. Without logprobs there
        is nothing to pair (and no per-token work on the token stream)."""
        if self.num_logprobs is None:
            return []
        tokens = self.detok.new_tokens(finished)
        n = min(len(tokens), len(self.unreleased))  # none when no logprobs were asked for
        released = self.unreleased[:n]
        for lp, t in zip(released, tokens, strict=False):
            lp.text, lp.offset, lp.cut = t.text, t.offset, t.cut
        self.unreleased = [] if finished else self.unreleased[n:]
        return released


def _logprob(lp: common_pb2.TokenLogprobs, n: int | None) -> TokenLogprob:
    entries = list(zip(lp.token_ids, lp.logprobs, strict=True))
    top = sorted(entries, key=lambda e: -e[1])[: n or 0]
    return TokenLogprob(entries[0][0], entries[0][1], top, rank=lp.sampled_rank)
