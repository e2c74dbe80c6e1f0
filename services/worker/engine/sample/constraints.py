"""Token constraints a request sets, vLLM's semantics: ``allowed_token_ids`` (only these may be
sampled) and ``bad_words`` (never generate these words). One part per stage:

- admission (the input processor): ``tokenize_bad_words`` turns each word into the token
  sequences to ban, ``check_vocabulary`` refuses ids the model does not have;
- the step's inputs (``worker/input_batch.py``): ``row_bad_word_bans`` says, from a row's
  output so far, which tokens it may not sample now;
- the sampler: ``masks.py`` masks the logits.

Torch-free: the worker service's front end (which admits requests) imports no torch.
"""

from collections.abc import Callable
from dataclasses import dataclass

from services.worker.engine.params import SamplingParams


def tokenize_bad_words(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token sequence as it starts the text, and, where a leading space makes it
    another word of as many tokens, as it follows a space (vLLM's rule: "Hello" and " Hello"
    are distinct tokens in most vocabularies). ``encode`` adds no special tokens."""
    sequences = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word[:40]!r} has no tokens")
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the constraints (and stop_token_ids, which min_tokens masks) index the logits
    with: each must be a column of them. Raises ValueError naming the field."""
    fields = {
        "allowed_token_ids": params.allowed_token_ids or [],
        "bad_words": [t for seq in params.bad_words_token_ids for t in seq],
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": list(params.logit_bias or ()),
    }
    for name, ids in fields.items():
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass
class RowBans:
    """The tokens one row may not sample this step, by its bad words."""

    now: list[int]  # masked whatever else happens
    # (token, expected): masked only if the token the step in flight samples for this row (async
    # scheduling: not on the host yet) is ``expected``
    if_pending: list[tuple[int, int]]


def row_bad_word_bans(words: list[list[int]], outputs: list[int], pending: bool) -> RowBans:
    """A word of L tokens bans its last token when the row's last L - 1 generated tokens are
    the word's first L - 1 (the prompt does not count, as in vLLM). ``pending``: one more
    token was sampled after ``outputs`` and is still on the device:

        generated:  … outputs[-(L-2)] … outputs[-1] | pending
        word:         w[0]            … w[L-3]      | w[L-2]     → ban w[L-1]
                      └ checked on the host ──────┘   └ compared on the device
    """
    bans = RowBans([], [])
    history = len(outputs) + pending
    for word in words:
        prefix, last = word[:-1], word[-1]
        if len(prefix) > history:
            continue
        known = prefix[:-1] if pending and prefix else prefix  # the part the host can check
        if outputs[len(outputs) - len(known) :] != known:
            continue
        if pending and prefix:
            bans.if_pending.append((last, prefix[-1]))
        else:
            bans.now.append(last)
    return bans
