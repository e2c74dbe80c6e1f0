"""The tensor-parallel group of one worker: its ranks, and the collectives a layer needs.

One engine worker with ``tensor_parallel_size = N`` runs N rank processes (or Ray actors), one
per device; each calls ``init_tensor_parallel`` once, before it builds its model, and every layer
reads the group from here. A process that never calls it is a world of one rank, where every
collective is the identity: that is how ``UniprocExecutor`` runs, with no process group at all.

    backend   NCCL on GPU, gloo on CPU
    store     where the ranks meet: a ``FileStore`` in the executor's private (0700) socket
              directory for ranks of one host, a ``TCPStore`` that the driver serves for Ray
    timeout   every collective is bounded (``COLLECTIVE_TIMEOUT``): a rank whose peer died
              fails instead of waiting for it forever
"""

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class StoreSpec:
    """Where the ranks of one group meet: ``file:<path>`` or ``tcp:<host>:<port>``."""

    url: str

    def open(self, rank: int, world_size: int) -> dist.Store:
        kind, _, where = self.url.partition(":")
        if kind == "file":
            return dist.FileStore(where, world_size)
        if kind == "tcp":
            host, _, port = where.rpartition(":")
            return dist.TCPStore(
                host, int(port), world_size, is_master=False,
                timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False,
            )  # fmt: skip
        raise ValueError(f"unknown store {self.url!r} (file:<path> or tcp:<host>:<port>)")


class GroupCoordinator:
    """One tensor-parallel group: rank, size and the collectives, each the identity at size 1.

    Every rank must call the same collectives in the same order (the executor sends every rank
    the same step); ``all_reduce`` works in place, the others return new tensors."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None):
        self.rank, self.world_size, self.group = rank, world_size, group

    @property
    def is_driver(self) -> bool:
        """Rank 0: it samples, and it answers the executor."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x``, concatenated along ``dim`` in rank order, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along ``dim`` on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` into ``x`` of every rank (in place)."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


_WORLD_OF_ONE = GroupCoordinator(0, 1)
_tp: GroupCoordinator = _WORLD_OF_ONE


def get_tp_group() -> GroupCoordinator:
    return _tp


@contextlib.contextmanager
def use_tp_group(group: GroupCoordinator) -> Iterator[GroupCoordinator]:
    """Inside the block this process's group is ``group``; after it, the one it had before.
    A ``GroupCoordinator(rank, size)`` without a process group is one rank's view (its
    collectives are not to be called): to build or load that rank's share of a model in a
    process of its own, joined to no group."""
    global _tp
    before, _tp = _tp, group
    try:
        yield group
    finally:
        _tp = before


def init_tensor_parallel(rank: int, world_size: int, store: StoreSpec, backend: str) -> None:
    """Join this process to its worker's tensor-parallel group (once, before the model is built)."""
    global _tp
    if world_size == 1:
        _tp = _WORLD_OF_ONE
        return
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    dist.init_process_group(
        backend, store=store.open(rank, world_size), rank=rank, world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    _tp = GroupCoordinator(rank, world_size, dist.group.WORLD)
    logger.info("tensor-parallel rank %d of %d joined (%s)", rank, world_size, backend)


def destroy_tensor_parallel() -> None:
    global _tp
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _tp = _WORLD_OF_ONE
