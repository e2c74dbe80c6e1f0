"""The token constraints' masks on the logits (``constraints.py`` says what they mean), and
``logit_bias``'s additions: applied by the sampler in place, after the raw logprobs and before
the min_tokens ban, the penalties and any draw (greedy, truncated or Gumbel). A batch where no
row sets a constraint builds none of this (its metadata fields are None) and pays nothing.
"""

from dataclasses import dataclass

import torch


@dataclass
class AllowedTokens:
    """Rows restricted to their allowed_token_ids."""

    rows: torch.Tensor  # int64 [restricted rows]
    flat: torch.Tensor  # int64: row * vocab + token, every token those rows may sample


@dataclass
class BadWordBans:
    now: torch.Tensor | None  # int64: row * vocab + token, masked
    # masked where ``pending_tokens == expected`` (RowBans.if_pending, one entry each)
    pending_flat: torch.Tensor | None  # int64 [k]: row * vocab + token
    expected: torch.Tensor | None  # int64 [k]
    pending_tokens: torch.Tensor | None  # int64 [k]: what the step in flight sampled, on device


@dataclass
class LogitBias:
    """Biases added to some rows' logits (OpenAI's ``logit_bias``)."""

    flat: torch.Tensor  # int64: row * vocab + token
    values: torch.Tensor  # float32, one per index


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """Add each bias to its logit, in place (flat: a (rows, tokens) index would wait for the
    device; a token masked already stays -inf)."""
    logits.view(-1).index_add_(0, bias.flat, bias.values)


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Mask, in place, every token a restricted row may not sample. (Flat indices: a
    (rows, tokens) index would wait for the device.)"""
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep.index_fill_(0, allowed.rows, False)
    keep.view(-1).index_fill_(0, allowed.flat, True)
    logits.masked_fill_(~keep, float("-inf"))


def apply_bad_words(logits: torch.Tensor, bans: BadWordBans) -> None:
    """Mask, in place, the bad words' last tokens; the conditional ones by adding -inf where
    the token in flight matched and 0 elsewhere (index_add_: the same token may be listed by
    several words, and the sum is -inf as soon as one of them matched)."""
    flat = logits.view(-1)
    if bans.now is not None:
        flat.index_fill_(0, bans.now, float("-inf"))
    if bans.pending_flat is not None:
        assert bans.pending_tokens is not None and bans.expected is not None
        hit = bans.pending_tokens == bans.expected
        add = torch.zeros(hit.shape, dtype=logits.dtype, device=logits.device)
        flat.index_add_(0, bans.pending_flat, add.masked_fill_(hit, float("-inf")))
