"""The gateway's OpenAI response formatting (no services needed)."""

from typing import Any, cast

from services.gateway.choice import TokenLogprob
from services.gateway.responses import Formatter


class _Tok:
    """Token 1 and 2 both print as the replacement character (partial UTF-8 sequences)."""

    def token_text(self, token_id: int) -> str:
        return {1: "\ufffd", 2: "\ufffd", 3: "a"}[token_id]


def test_legacy_top_logprobs_keep_the_most_probable_of_tokens_sharing_a_text() -> None:
    fmt = Formatter("cmpl-1", "m", chat=False, tokenizer=cast(Any, _Tok()))
    lp = TokenLogprob(token_id=1, logprob=-0.5, top=[(1, -0.5), (3, -1.0), (2, -2.0)])
    out = fmt._logprobs(0, [lp], "\ufffd")
    assert out is not None
    assert out["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.0}]
    assert out["token_logprobs"][0] == max(out["top_logprobs"][0].values())
