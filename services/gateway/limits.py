"""The input limits, enforced: how many of each repeated thing one request may carry
(``settings.InputLimits``), checked once at the edge, before a prompt is tokenized or anything
is sent to a worker; each refusal is a 400 naming the field.

What they bound: a request's work that the body-size limit alone would let grow large — every
prompt is prefilled (``max_prompts`` × ``n`` requests reach the workers), every stop string is
scanned on every token, every message is rendered by the chat template, every bad word is
matched on every token and the allowed token ids become a mask at every step; a grammar is
compiled by the engine (its size), and every tool is rendered into the prompt.
"""

import json

from services.gateway import errors
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.settings import InputLimits


def check_limits(limits: InputLimits, body: CompletionRequest | ChatCompletionRequest) -> None:
    """Raise a 400 APIError for the first count over its limit."""
    if isinstance(body, CompletionRequest):
        _at_most("prompt", "prompts", len(body.prompts()), limits.max_prompts)
    else:
        _at_most("messages", "messages", len(body.messages), limits.max_messages)
    _at_most("stop", "stop strings", len(body.stop_strings), limits.max_stop)
    longest = max((len(s) for s in body.stop_strings), default=0)
    _at_most("stop", "characters in a stop string", longest, limits.max_stop_chars)
    ids = len(body.stop_token_ids or ())
    _at_most("stop_token_ids", "stop token ids", ids, limits.max_stop_token_ids)
    words = body.bad_words or []
    _at_most("bad_words", "bad words", len(words), limits.max_bad_words)
    longest = max((len(w) for w in words), default=0)
    _at_most("bad_words", "characters in a bad word", longest, limits.max_bad_word_chars)
    allowed = len(body.allowed_token_ids or ())
    _at_most("allowed_token_ids", "allowed token ids", allowed, limits.max_allowed_token_ids)
    biased = len(body.logit_bias or ())
    _at_most("logit_bias", "logit_bias entries", biased, limits.max_logit_bias)
    if body.grammar is not None:
        size = body.grammar.chars
        _at_most(body.grammar.param, "characters of grammar", size, limits.max_grammar_chars)
    if isinstance(body, ChatCompletionRequest) and body.tools:
        _at_most("tools", "tools", len(body.tools), limits.max_tools)
        size = sum(len(json.dumps(t.function.parameters or {}, separators=(",", ":")))
                   for t in body.tools)  # fmt: skip
        _at_most("tools", "characters of tool parameter schemas", size, limits.max_grammar_chars)


def _at_most(param: str, what: str, count: int, limit: int) -> None:
    if count > limit:
        raise errors.bad_request(f"{count} {what}: at most {limit} are allowed", param)
