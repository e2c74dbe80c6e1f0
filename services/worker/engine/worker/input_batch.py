"""The model runner's memory of each request between steps, and the per-step sampling metadata
built from it. The runner appends the tokens it samples here, so the scheduler only has to
send what it changed.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.metadata import Penalties, SamplingMetadata


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def make_generator(
    params: SamplingParams, device: torch.device, done: int = 0, vocab_size: int = 0
) -> torch.Generator | None:
    """A seeded request's generator. ``done`` tokens were already sampled elsewhere (the
    prefill leg of a disaggregated request): skip the draws they used — one exponential draw
    over the vocabulary per random step (sampler.py) — so the continuation is exactly what one
    engine would have sampled."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device).manual_seed(params.seed & (2**63 - 1))
    if done and not params.greedy:
        scratch = torch.empty(vocab_size, device=device)
        for _ in range(done):
            scratch.exponential_(generator=gen)
    return gen


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    params = [s.params for s in states]
    greedy = [p.greedy for p in params]

    def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    all_greedy = all(greedy)
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    return SamplingMetadata(
        all_greedy=all_greedy,
        greedy=None if all_greedy else column(greedy, torch.bool),
        temperature=None if all_greedy else column(temps),
        top_k=column(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
        top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        min_p=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        penalties=_penalties(states, vocab_size, device),
        banned=_banned(states),
        max_num_logprobs=max(logprobs) if logprobs else None,
    )


def _penalties(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> Penalties | None:
    params = [s.params for s in states]
    if not any(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
    ):
        return None

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(1, *(len(r) for r in rows))
        return torch.tensor(
            [r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64, device=device
        )

    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
        prompt_ids=padded([s.token_ids[: s.num_prompt_tokens] for s in states]),
        output_ids=padded([s.token_ids[s.num_prompt_tokens :] for s in states]),
    )


def _banned(states: list[CachedRequestState]) -> list[tuple[int, list[int]]]:
    """Rows still short of min_tokens may not sample a token that would stop them."""
    banned = []
    for row, s in enumerate(states):
        if s.num_output_tokens < s.params.min_tokens:
            stops = list(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stops += list(s.eos_token_ids)
            if stops:
                banned.append((row, stops))
    return banned
