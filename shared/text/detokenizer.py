"""Incremental detokenization (``tokenizers``' DecodeStream) and stop strings.

Text is emitted as soon as it is valid UTF-8. While a request streams, the last
``len(longest stop string) - 1`` characters are held back (back to the start of the token they
are in), since they may be the start of a stop string that the next token completes; they are
released when the request finishes.

It also says what each token added to the text (``new_tokens``), so that logprobs agree with
the text they describe: the tokens handed out with a piece of text are exactly those whose
text makes it up. A character split across tokens belongs to the token that completes it (the
ones before it add ""), and text is handed out at token boundaries only:

    tokens      ' w'   b'\\xc3'   b'\\xb6'   'r'   <|im_end|>
    adds        ' w'   ''        'ö'       'r'   ''            (special tokens skipped)
    offset      0      2         2         3     4  ── at the end, adding nothing: handed out
                                                       with the end (every token has an entry)

Tokens whose text a stop string cut off entirely are not handed out.
"""

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass(frozen=True)
class TokenText:
    """What one generated token added to the text."""

    offset: int  # where its text starts in ``IncrementalDetokenizer.text``
    text: str  # "" for the first bytes of a character a later token completes, or a skipped token
    cut: str = ""  # the end of its text that a stop string cut off (then ``text`` ends there)


class IncrementalDetokenizer:
    """Torch-free: the engine's output processor and the gateway both use it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_ids[-8:]), skip_special_tokens=skip_special_tokens
        )
        self.stop = list(stop)
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters of ``text`` already handed out
        self._ends: list[int] = []  # per token fed: len(text) after it, before any stop cut
        self._tokens_sent = 0  # tokens that ``new_tokens`` handed out (or dropped)
        self._cut_off = ""  # the text a stop string cut off the end
        self._stopped = False  # a stop string ended the text

    def update(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string they completed, if any (text is then cut, and
        the tokens after the one that completed it are not read)."""
        for token in token_ids:
            piece = self._stream.step(self._tokenizer, token)
            start = max(0, len(self.text) - self.holdback)  # where a stop string may begin
            self.text += piece or ""
            self._ends.append(len(self.text))
            if piece and (hit := self._find_stop(start)) is not None:
                return hit
        return None

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        end = at + len(stop) if self.include_stop else at
        self.text, self._cut_off = self.text[:end], self.text[end:]
        self._stopped = True
        return stop

    def new_text(self, finished: bool) -> str:
        """Text not handed out yet (minus the hold-back while unfinished, rounded down to the
        end of a token); marks it handed out."""
        if finished:
            end = len(self.text)
        else:
            limit = len(self.text) - self.holdback
            end = max(self._sent, self._token_end_at_or_before(limit))
        delta, self._sent = self.text[self._sent : end], end
        return delta

    def _token_end_at_or_before(self, limit: int) -> int:
        if self._ends and self._ends[-1] <= limit:
            return self._ends[-1]  # no hold-back, or none needed: everything
        i = bisect.bisect_right(self._ends, limit)
        return self._ends[i - 1] if i else 0

    def new_tokens(self, finished: bool) -> list[TokenText]:
        """The tokens whose text the text handed out so far holds, that were not returned
        before, in order; call it after ``new_text``. A token that adds nothing waits for the
        next one that adds something (the rest of its character). Once finished, the tokens
        that add nothing at the very end (an end-of-text token, the bytes of an unfinished
        character) come with "" at the text's end, so every token generated has an entry (as
        OpenAI's and vLLM's logprobs have: harnesses count on it); those whose text a stop
        string cut off are dropped."""
        out = []
        i = self._tokens_sent
        while i < len(self._ends):
            start = self._ends[i - 1] if i else 0
            end = min(self._ends[i], len(self.text))
            if start >= self._sent or end > self._sent:
                break
            cut = self._cut_off[: self._ends[i] - end]  # "" unless a stop string cut it
            out.append(TokenText(start, self.text[start:end], cut))
            i += 1
        if finished and not self._stopped:
            out += [TokenText(len(self.text), "") for _ in range(i, len(self._ends))]
        self._tokens_sent = len(self._ends) if finished else i
        return out

    @property
    def released_text(self) -> str:
        """Everything handed out so far (cumulative outputs show this)."""
        return self.text[: self._sent]


def token_texts(
    tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True
) -> list[TokenText]:
    """What each token adds to the text of ``token_ids`` decoded from the start (an echoed
    prompt), one entry for every token, "" for one that adds nothing (the first bytes of a
    character, a skipped special token): the entries' texts join to the whole text."""
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    out, offset = [], 0
    for token in token_ids:
        piece = stream.step(tokenizer, token) or ""
        out.append(TokenText(offset, piece))
        offset += len(piece)
    return out
