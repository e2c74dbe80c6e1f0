"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab.

The embedding's ranks each look up the ids that fall in their slice and all-reduce the rows. The
LM head's ranks each multiply their slice; the logits are gathered on rank 0 only, where the
sampler runs (the other ranks get an empty [rows, 0] tensor: they sample nothing).
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.distributed import all_reduce, gather_last_dim, tp_rank, tp_size
from services.worker.engine.models.weights import Loaded, copy_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.rows = max(0, min(self.shard, vocab_size - self.start))  # the last may be short
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        param.data.zero_()  # padding rows of the last shard: logits of 0, sliced off
        copy_weight(param.data[: self.rows], loaded.narrow(0, self.start, self.rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__(vocab_size, hidden)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_last_dim(F.linear(hidden, self.weight))
        if logits is None:  # not rank 0
            return hidden.new_empty(hidden.shape[0], 0)
        return logits[..., : self.vocab_size]
