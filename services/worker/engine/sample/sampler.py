"""The sampler. Order, as in vLLM: logprobs of the raw model output → allowed_token_ids →
bad_words → logit_bias → min_tokens ban → penalties → greedy argmax | (temperature →
top-k/top-p → min-p → random draw).

Random rows draw by the Gumbel-max race (``ops/gumbel.py``): one pass over the logits in the model's
dtype on a GPU, with noise hashed from the request's seed and token index, so a seeded request's
tokens do not depend on which other requests share the batch. Nothing here waits for the device.
"""

from dataclasses import dataclass

import torch

from services.worker.engine.ops.gumbel import greedy_argmax, gumbel_argmax
from services.worker.engine.sample.masks import apply_allowed, apply_bad_words, apply_logit_bias
from services.worker.engine.sample.metadata import Penalties, SamplingMetadata


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # int64 [rows]
    top_ids: torch.Tensor | None  # int64 [rows, N]: most likely tokens under the raw distribution
    top_logprobs: torch.Tensor | None  # float32 [rows, N]
    sampled_logprobs: torch.Tensor | None  # float32 [rows]
    sampled_ranks: torch.Tensor | None  # int64 [rows], 1 = most likely


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        wanted = meta.max_num_logprobs is not None
        raw_logprobs = logits.float().log_softmax(-1) if wanted else None
        masks = meta.allowed is not None or meta.bad_words is not None or meta.banned is not None
        masks = masks or meta.logit_bias is not None
        if masks or meta.penalties is not None:
            logits = logits.float()
        if meta.allowed is not None:
            apply_allowed(logits, meta.allowed)
        if meta.bad_words is not None:
            apply_bad_words(logits, meta.bad_words)
        if meta.logit_bias is not None:
            apply_logit_bias(logits, meta.logit_bias)
        if meta.banned is not None:  # flat: a (rows, tokens) index would wait for the device
            logits.view(-1).index_fill_(0, meta.banned, float("-inf"))
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        if meta.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            sampled = self._sample_random(logits, meta)
        return token_logprobs(sampled, raw_logprobs, meta.max_num_logprobs)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows (inverse temperature 0) take their argmax in the same pass."""
        inv_t, keys = meta.inv_temperature, meta.keys
        assert inv_t is not None and keys is not None  # built whenever a row samples randomly
        if meta.top_k is not None or meta.top_p is not None or meta.min_p is not None:
            # the truncations work on the scaled logits; greedy rows keep scale 1 (their argmax
            # survives every truncation)
            greedy = inv_t == 0
            logits = logits.float() * torch.where(greedy, 1.0, inv_t).unsqueeze(1)
            if meta.top_k is not None or meta.top_p is not None:
                logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
            if meta.min_p is not None:  # p >= min_p * p_max, in logits: l >= l_max + log(min_p)
                floor = logits.max(-1, keepdim=True).values + meta.min_p.log().unsqueeze(1)
                logits = logits.masked_fill(logits < floor, float("-inf"))
            inv_t = (~greedy).to(torch.float32)
        return gumbel_argmax(logits, inv_t, keys)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition over prompt + output (divide positive logits, multiply negative ones);
    frequency and presence over the output only (OpenAI's definitions)."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, p.prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = p.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - p.frequency.unsqueeze(1) * counts
    return logits - p.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (at least one token stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(sampled: torch.Tensor, raw: torch.Tensor | None, n: int | None) -> SamplerOutput:
    """The logprob and rank of each row's token in ``sampled`` (the sampled one, or a prompt's
    next token), and each row's top ``n``, from ``raw``: the rows' log-softmax."""
    if raw is None or n is None:
        return SamplerOutput(sampled, None, None, None, None)
    chosen = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
    ranks = (raw > chosen.unsqueeze(1)).sum(-1) + 1
    top = raw.topk(n, dim=-1) if n > 0 else None
    return SamplerOutput(
        sampled=sampled,
        top_ids=top.indices if top is not None else None,
        top_logprobs=top.values if top is not None else None,
        sampled_logprobs=chosen,
        sampled_ranks=ranks,
    )
