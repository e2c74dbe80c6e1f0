"""The model runner's memory of each request between steps, and the per-step sampling metadata
built from it. The runner appends the tokens it samples here, so the scheduler only has to
send what it changed.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.ops.gumbel import row_keys
from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.constraints import row_bad_word_bans
from services.worker.engine.sample.masks import AllowedTokens, BadWordBans, LogitBias
from services.worker.engine.sample.metadata import Penalties, SamplingMetadata


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[list[int]]  # per KV cache group (kv_cache/groups.py)
    num_computed_tokens: int
    # sampled by a step still in flight, not yet in token_ids (async scheduling; at most one
    # when a step's inputs are built: the engine resolves a step before it submits the next but one)
    num_pending: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens + self.num_pending

    @property
    def needs_output_ids(self) -> bool:
        """Its sampling reads the ids of its earlier outputs (penalties)."""
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def host_tensor(
    values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values as a CPU tensor to copy to ``device`` with ``non_blocking=True``: pinned when
    the device is a GPU. A copy from pageable memory waits for the device's stream — for the step
    still running on it — and would undo async scheduling."""
    if isinstance(values, np.ndarray):
        t = torch.from_numpy(values)
    else:
        t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(
    values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` on ``device``, without blocking the host (see ``host_tensor``)."""
    return host_tensor(values, dtype, device).to(device, non_blocking=True)


@dataclass
class InFlightTokens:
    """The tokens the step in flight samples, still on the device (async scheduling)."""

    sampled: torch.Tensor  # int64 [rows]
    row_of: dict[str, int]  # request id → its row in ``sampled``

    def tokens_of(self, req_ids: list[str]) -> torch.Tensor:
        """The tokens these requests are sampling, in this order, on the device."""
        rows = [self.row_of[rid] for rid in req_ids]
        return self.sampled[to_device(rows, torch.int64, self.sampled.device)]


def build_sampling_metadata(
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    in_flight: InFlightTokens | None = None,
    unseeded_base: int = 0,
) -> SamplingMetadata:
    """``unseeded_base``: a fresh random number per step, the seed of rows without one."""
    params = [s.params for s in states]
    greedy = [p.greedy for p in params]

    def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(values, dtype, device)

    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    all_greedy = all(greedy)
    keys = None
    if not all_greedy:
        seeds = np.array(
            [p.seed if p.seed is not None else unseeded_base + i for i, p in enumerate(params)],
            dtype=np.int64,
        )
        counters = np.array([s.num_output_tokens for s in states], dtype=np.int64)
        keys = to_device(row_keys(seeds, counters), torch.int64, device)
    inv_t = [0.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params, strict=True)]
    return SamplingMetadata(
        all_greedy=all_greedy,
        inv_temperature=None if all_greedy else column(inv_t),
        top_k=column(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
        top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        min_p=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        keys=keys,
        penalties=_penalties(states, vocab_size, device, in_flight),
        banned=_banned(states, vocab_size, device),
        max_num_logprobs=max(logprobs) if logprobs else None,
        allowed=_allowed(states, vocab_size, device),
        bad_words=_bad_words(states, vocab_size, device, in_flight),
        logit_bias=_logit_bias(states, vocab_size, device),
    )


def _penalties(
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    in_flight: InFlightTokens | None,
) -> Penalties | None:
    if not any(s.needs_output_ids for s in states):
        return None

    def padded(rows: list[list[int]], extra: list[int]) -> np.ndarray:
        """Padded with vocab_size (a column the penalties drop); ``extra[i]`` more slots."""
        width = max(1, *(len(r) + e for r, e in zip(rows, extra, strict=True)))
        table = np.full((len(rows), width), vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        return table

    outputs = [s.token_ids[s.num_prompt_tokens :] for s in states]
    pending = [s.num_pending for s in states]
    output_ids = to_device(padded(outputs, pending), torch.int64, device)
    late = [i for i, n in enumerate(pending) if n]
    if late:  # outputs sampled by the step in flight: copied in on the device
        assert in_flight is not None and max(pending) == 1
        width = output_ids.shape[1]
        flat = to_device([i * width + len(outputs[i]) for i in late], torch.int64, device)
        tokens = in_flight.tokens_of([states[i].req_id for i in late])
        # flat index_copy_: indexing with a (rows, cols) pair waits for the device
        output_ids.view(-1).index_copy_(0, flat, tokens)
    params = [s.params for s in states]
    f32 = torch.float32
    return Penalties(
        presence=to_device([p.presence_penalty for p in params], f32, device),
        frequency=to_device([p.frequency_penalty for p in params], f32, device),
        repetition=to_device([p.repetition_penalty for p in params], f32, device),
        prompt_ids=to_device(
            padded([s.token_ids[: s.num_prompt_tokens] for s in states], [0] * len(states)),
            torch.int64,
            device,
        ),
        output_ids=output_ids,
    )


def _banned(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Flat indices (row × vocab + token) into the logits to mask: rows still short of
    min_tokens may not sample a token that would stop them."""
    flat: list[int] = []
    for row, s in enumerate(states):
        if s.num_output_tokens < s.params.min_tokens:
            stops = list(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stops += list(s.eos_token_ids)
            flat += [row * vocab_size + t for t in stops]
    return to_device(flat, torch.int64, device) if flat else None


def _allowed(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> AllowedTokens | None:
    """The rows with allowed_token_ids, and those tokens as flat indices (row × vocab + token)."""
    rows = [r for r, s in enumerate(states) if s.params.allowed_token_ids is not None]
    if not rows:
        return None
    flat = np.concatenate([
        np.asarray(states[r].params.allowed_token_ids, dtype=np.int64) + r * vocab_size
        for r in rows
    ])  # fmt: skip
    return AllowedTokens(to_device(rows, torch.int64, device), to_device(flat, torch.int64, device))


def _logit_bias(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> LogitBias | None:
    """Every row's logit_bias as flat indices (row × vocab + token) and their values."""
    flat: list[int] = []
    values: list[float] = []
    for row, s in enumerate(states):
        for tok, bias in (s.params.logit_bias or {}).items():
            flat.append(row * vocab_size + tok)
            values.append(bias)
    if not flat:
        return None
    return LogitBias(to_device(flat, torch.int64, device), to_device(values, torch.float32, device))


def _bad_words(
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    in_flight: InFlightTokens | None,
) -> BadWordBans | None:
    """Each row's bad-word bans (sample/constraints.row_bad_word_bans) as flat indices; those
    that hang on the token the step in flight samples are compared with it on the device."""
    now: list[int] = []
    pending: list[tuple[int, int, int]] = []  # (row, token to mask, if this token is in flight)
    for row, s in enumerate(states):
        words = s.params.bad_words_token_ids
        if not words:
            continue
        assert s.num_pending <= 1  # as for the penalties: at most one step in flight
        bans = row_bad_word_bans(words, s.token_ids[s.num_prompt_tokens :], s.num_pending > 0)
        now += [row * vocab_size + t for t in bans.now]
        pending += [(row, t, expected) for t, expected in bans.if_pending]
    if not now and not pending:
        return None
    now_flat = to_device(now, torch.int64, device) if now else None
    if not pending:
        return BadWordBans(now_flat, None, None, None)
    assert in_flight is not None
    return BadWordBans(
        now=now_flat,
        pending_flat=to_device([r * vocab_size + t for r, t, _ in pending], torch.int64, device),
        expected=to_device([e for _, _, e in pending], torch.int64, device),
        pending_tokens=in_flight.tokens_of([states[r].req_id for r, _, _ in pending]),
    )
