"""Incremental detokenization (``tokenizers``' DecodeStream) and stop strings.

Text is emitted as soon as it is valid UTF-8. While a request streams, the last
``len(longest stop string) - 1`` characters are held back, since they may be the start of a
stop string that the next token completes; they are released when the request finishes.
"""

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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

    def update(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string they completed, if any (text is then cut)."""
        for token in token_ids:
            piece = self._stream.step(self._tokenizer, token)
            if not piece:
                continue
            start = max(0, len(self.text) - self.holdback)
            self.text += piece
            hit = self._find_stop(start)
            if hit is not None:
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
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def new_text(self, finished: bool) -> str:
        """Text not handed out yet (minus the hold-back while unfinished); marks it handed out."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.holdback)
        delta, self._sent = self.text[self._sent : end], end
        return delta

    @property
    def released_text(self) -> str:
        """Everything handed out so far (cumulative outputs show this)."""
        return self.text[: self._sent]
