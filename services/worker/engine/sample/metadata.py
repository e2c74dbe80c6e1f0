"""``SamplingMetadata``: the per-step, per-row tensors the sampler needs. Built by the model
runner for exactly the rows it samples this step; optional parts are None when no row uses them,
so the common case (greedy, no penalties) costs one argmax.
"""

from dataclasses import dataclass

import torch

from services.worker.engine.sample.masks import AllowedTokens, BadWordBans, LogitBias


@dataclass
class Penalties:
    presence: torch.Tensor  # float32 [rows]
    frequency: torch.Tensor  # float32 [rows]
    repetition: torch.Tensor  # float32 [rows]
    prompt_ids: torch.Tensor  # int64 [rows, max_prompt], padded with vocab_size
    output_ids: torch.Tensor  # int64 [rows, max_output], padded with vocab_size


@dataclass
class SamplingMetadata:
    all_greedy: bool  # then inv_temperature and keys are None: one argmax, nothing else
    inv_temperature: torch.Tensor | None  # float32 [rows]: 1 / temperature; 0 on greedy rows
    top_k: torch.Tensor | None  # int64 [rows]; vocab size where disabled
    top_p: torch.Tensor | None  # float32 [rows]; 1.0 where disabled
    min_p: torch.Tensor | None  # float32 [rows]; 0.0 where disabled
    keys: torch.Tensor | None  # int64 [rows]: each row's noise key (gumbel.row_keys)
    penalties: Penalties | None
    banned: torch.Tensor | None  # int64, row * vocab + token: masked this step (min_tokens)
    max_num_logprobs: int | None  # largest top-N requested among the rows; None: no logprobs
    allowed: AllowedTokens | None = None  # rows limited to their allowed_token_ids
    bad_words: BadWordBans | None = None  # bad words' last tokens masked this step
    logit_bias: LogitBias | None = None  # rows' logit_bias
