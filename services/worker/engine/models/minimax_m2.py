"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): the Llama-family decoder with a mixture of experts in
every layer (sigmoid scores, a per-expert correction bias that steers the choice, the top-k
weights renormalized; no shared expert) and attention whose q and k are normed over the whole
projection (all heads at once, not per head) before a rotary over part of each head
(``rotary_dim``), after Hugging Face's ``modeling_minimax_m2.py``.

Its checkpoints keep Mixtral's names (``block_sparse_moe``, experts ``w1``/``w2``/``w3``) and the
correction bias beside the gate (``block_sparse_moe.e_score_correction_bias``); their
multi-token-prediction modules are ``model.layers.<n>`` past the decoder's, skipped.
"""

import torch
from torch import nn

from services.worker.engine.distributed import all_reduce, tp_rank, tp_size
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from services.worker.engine.models.weights import CheckpointTarget, Loaded, copy_weight


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a projection's whole output, every head at once ([T, heads, head_dim] in
    and out; the statistic in float32, the weight applied in the input's dtype). Each rank
    holds its heads, so the statistic is a sum over the ranks (``squares`` on each, summed,
    then ``scale``); where ranks share a head (``replicas`` of them hold each KV head when
    there are more ranks than KV heads) its share counts once."""

    def __init__(self, num_heads: int, total_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.total = total_heads * head_dim
        self.replicas = max(1, tp_size() // total_heads)
        self.first = (tp_rank() // self.replicas) * num_heads * head_dim  # this rank's columns
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        copy_weight(param, loaded.narrow(0, self.first, param.shape[0]))

    def squares(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of each token's sum of squares, [T, 1] float32."""
        return x.float().flatten(1).pow(2).sum(-1, keepdim=True) / self.replicas

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """``x`` normed by the sum of squares over every rank."""
        xf = x.float().flatten(1) * torch.rsqrt(squares / self.total + self.eps)
        return (self.weight * xf.to(x.dtype)).view_as(x)


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__(arch, ctx)
        d, eps = arch.head_dim, arch.rms_norm_eps
        self.q_norm: ProjectionRMSNorm = ProjectionRMSNorm(self.num_heads, arch.num_heads, d, eps)
        self.k_norm: ProjectionRMSNorm = ProjectionRMSNorm(
            self.num_kv_heads, arch.num_kv_heads, d, eps
        )

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """q's and k's statistics summed over the ranks in one all-reduce."""
        squares = all_reduce(torch.cat([self.q_norm.squares(q), self.k_norm.squares(k)], -1))
        return self.q_norm.scale(q, squares[:, :1]), self.k_norm.scale(k, squares[:, 1:]), None


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention = MiniMaxM2Attention


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    decoder_layer = MiniMaxM2DecoderLayer

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """The correction bias (beside the gate in the checkpoints, ours in the router), then
        Mixtral's names (``LlamaForCausalLM.checkpoint_target``)."""
        for theirs in (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"):
            if name.endswith(theirs):
                return CheckpointTarget(
                    name.replace(theirs, ".mlp.gate.e_score_correction_bias"), None
                )
        return super().checkpoint_target(name)

    def unused_checkpoint_tensor(self, name: str) -> bool:
        return self.draft_layer(name)
