"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        part = loaded[self.start : self.start + self.shard]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

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
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
