"""The worker half of KV transfer, as an interface: what moves a decode leg's prompt blocks
from the prefill engine that leased them into this engine's cache.

    scheduler half (kv_transfer/scheduler_side.py, pure bookkeeping)
        │  SchedulerOutput.kv_loads: the pulls to start this step
        ▼
    KVConnector.start_loads ──▶ … ──▶ KVConnector.poll() → TransferResults
        │  carried on the executor's StepResult (``transfers``) back to the core, which hands
        ▼  it to Scheduler.update_from_transfers: the one way in for transfer progress
    decode on | recompute | fail;  leases a peer has pulled end

Implementations come from ``CONNECTORS`` by name, imported lazily: ``nixl`` (NIXL over UCX,
the real one) and ``fake`` (plain tensor copies between engines of one process, for tests).

Contract: every method runs on the engine core's loop (single-threaded); ``poll`` never raises
for a peer's failure (the pull fails instead); ``close`` is idempotent.
"""

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.engine.kv_transfer.params import KVLoad

if TYPE_CHECKING:
    import torch


@dataclass
class TransferResults:
    """Transfer progress seen by one poll; each request id appears in at most one list."""

    finished: list[str] = field(default_factory=list)  # pulls complete: the KV is in place
    failed: list[str] = field(default_factory=list)  # pulls that cannot complete
    released: list[str] = field(default_factory=list)  # our leased requests a peer has pulled


@dataclass(frozen=True)
class ConnectorInfo:
    """What the core needs to know of its connector (``Executor.transfer_info``)."""

    side_channel: str  # where peers reach this engine (handed out in KV handles); "" if none
    needs_idle_progress: bool  # poll even when idle, or peers' READs and notices wait
    stats: dict[str, int | float]  # counters for get_stats (pulls, bytes, failures, seconds)


NO_CONNECTOR = ConnectorInfo("", False, {})


class KVConnector(ABC):
    side_channel: str  # this engine's address for peers, set by the constructor

    @abstractmethod
    def start_loads(self, loads: list[KVLoad]) -> list[str]:
        """Start one pull per load (``local_block_ids`` ← the peer's ``remote_block_ids``);
        returns the ids of those that could not start. The scheduler has allocated the local
        blocks and keeps them out of the prefix index until the pull finishes."""

    @abstractmethod
    def poll(self) -> TransferResults:
        """Pulls that ended since the last poll (a finished one tells its peer, which ends
        the lease), and peers' notices that they have pulled our leased blocks."""

    @abstractmethod
    def info(self) -> ConnectorInfo:
        """Side channel, idle-progress need and counters, as of now."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving peers and release registered memory; idempotent."""


PROTOCOL_VERSION = 1  # of the KV layout and handshake: engines of different versions refuse


def compat_hash(
    model: str,
    kv_dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: Sequence[tuple[float, float]] = (),
    parts: int = 2,
    groups: str = "",
) -> str:
    """What must agree for one engine to read another's blocks byte for byte: the KV cache's
    dtype and the model's whole KV geometry, not one rank's shard (engines of different TP
    sizes exchange KV), and an FP8 cache's per-layer scales (the same codes under other
    scales are other values). ``parts``: 2 for K and V, 1 for MLA's latent. ``groups``: the
    KV cache groups (``KVCacheGroups.describe()``): which layers share a block, and each
    group's window.

    Readable before its hash, so that a refused peer's error says what differs (an MLA cache
    against a dense one, another dtype or block size)."""
    kind = f"{'K|V' if parts == 2 else 'latent'} {num_kv_heads}x{head_dim}"
    scales = ",".join(f"{k!r}/{v!r}" for k, v in kv_scales)
    text = (f"v{PROTOCOL_VERSION}|{model}|{kv_dtype}|{block_size}|{num_layers}|{num_kv_heads}|"
            f"{head_dim}|{scales}|{parts}|{groups}")  # fmt: skip
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    hybrid = groups and not groups.startswith("1 ")  # (one group: every layer alike)
    layers = f"{num_layers} layers" + (f" in {groups}" if hybrid else "")
    return f"{kind}, {kv_dtype}, {layers}, blocks of {block_size} #{digest}"


@dataclass(frozen=True)
class RankPlacement:
    """Which tensor-parallel rank a connector's cache belongs to (kv_transfer/tp_layout.py)."""

    rank: int = 0
    size: int = 1
    num_kv_heads: int = 0  # the model's, over all ranks (0: the cache's own, at tp=1)


ONE_RANK = RankPlacement()


# name → "module:Class"; each is built as cls(engine_id, kv_cache, compat_hash, host, placement)
CONNECTORS = {
    "nixl": "services.worker.engine.kv_transfer.nixl_connector:NixlConnector",
    "fake": "services.worker.engine.kv_transfer.fake_connector:FakeConnector",
}


def make_connector(
    name: str, engine_id: str, kv_cache: "torch.Tensor", compat_hash: str, host: str,
    placement: RankPlacement = ONE_RANK,
) -> KVConnector:  # fmt: skip
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(sorted(CONNECTORS))}")
    module, cls = CONNECTORS[name].split(":")
    connector: KVConnector = getattr(importlib.import_module(module), cls)(
        engine_id, kv_cache, compat_hash, host, placement=placement
    )
    return connector
