"""Tensor parallelism inside one worker (``parallel_state.py``: the group and its collectives).

The helpers below read the group of this process; in a process that joined none (tp=1) the world
is one rank and every collective is the identity.
"""

import torch

from services.worker.engine.distributed.parallel_state import get_tp_group


def tp_rank() -> int:
    return get_tp_group().rank


def tp_size() -> int:
    return get_tp_group().world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place."""
    return get_tp_group().all_reduce(x)


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Each rank's shard of the last dimension, concatenated on rank 0 (None elsewhere)."""
    return get_tp_group().gather(x, dim=-1)
