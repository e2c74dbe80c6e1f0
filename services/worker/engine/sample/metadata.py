"""``SamplingMetadata``: the per-step, per-row tensors the sampler needs. Built by the model
runner for exactly the rows it samples this step; optional parts are None when no row uses them,
so the common case (greedy, no penalties) costs one argmax.
"""

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    presence: torch.Tensor  # float32 [rows]
    frequency: torch.Tensor  # float32 [rows]
    repetition: torch.Tensor  # float32 [rows]
    prompt_ids: torch.Tensor  # int64 [rows, max_prompt], padded with vocab_size
    output_ids: torch.Tensor  # int64 [rows, max_output], padded with vocab_size


@dataclass
class SamplingMetadata:
    all_greedy: bool  # then greedy and temperature are None: one argmax, nothing else
    greedy: torch.Tensor | None  # bool [rows]
    temperature: torch.Tensor | None  # float32 [rows]; 1.0 on greedy rows (never divides by 0)
    top_k: torch.Tensor | None  # int64 [rows]; vocab size where disabled
    top_p: torch.Tensor | None  # float32 [rows]; 1.0 where disabled
    min_p: torch.Tensor | None  # float32 [rows]; 0.0 where disabled
    generators: dict[int, torch.Generator]  # row → the request's own generator (seeded rows)
    penalties: Penalties | None
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked this step (min_tokens)
    max_num_logprobs: int | None  # largest top-N requested among the rows; None: no logprobs
