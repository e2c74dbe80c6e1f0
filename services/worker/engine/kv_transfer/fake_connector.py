"""An in-process ``KVConnector``: engines of one process pull each other's blocks with plain
tensor copies. For tests of the P/D paths without NIXL (scheduler traces in milliseconds,
failures on demand); ``kv_connector="fake"`` selects it in an engine.

    FakeFabric      the "network": side channel → connector, and the faults to inject
    FakeConnector   one engine's end; a pull completes ``fabric.latency_polls`` polls after it
                    starts (0: at the first poll), copying ``kv_cache[local] = peer[remote]``,
                    then queues a release notice on the peer, which its next poll returns

A pull fails when its peer is not on the fabric (never joined, closed, or ``fabric.kill``ed)
at start or while it waits, or when ``fabric.fail_next`` names its request.
"""

from dataclasses import dataclass, field

import torch

from services.worker.engine.kv_transfer.connector import (
    ConnectorInfo,
    KVConnector,
    RankPlacement,
    TransferResults,
)
from services.worker.engine.kv_transfer.params import KVLoad


@dataclass
class FakeFabric:
    connectors: dict[str, "FakeConnector"] = field(default_factory=dict)  # by side channel
    latency_polls: int = 0  # polls a pull waits before it completes
    fail_next: set[str] = field(default_factory=set)  # request ids whose pull will fail

    def kill(self, side_channel: str) -> None:
        """The peer dies: its pulls in flight and every later one fail."""
        self.connectors.pop(side_channel, None)


DEFAULT_FABRIC = FakeFabric()  # where engines built by name (kv_connector="fake") meet


@dataclass
class _Pull:
    load: KVLoad
    polls_left: int


class FakeConnector(KVConnector):
    def __init__(
        self,
        engine_id: str,
        kv_cache: torch.Tensor,
        compat_hash: str = "",
        host: str = "",
        fabric: FakeFabric | None = None,
        placement: RankPlacement | None = None,
    ):
        if placement is not None and placement.size > 1:
            raise ValueError("the fake KV connector copies within one process: tp=1 only")
        self.engine_id = engine_id
        self.kv_cache = kv_cache
        self.compat_hash = compat_hash
        self.fabric = DEFAULT_FABRIC if fabric is None else fabric
        self.side_channel = f"fake://{engine_id}"
        self.fabric.connectors[self.side_channel] = self
        self._pulls: dict[str, _Pull] = {}
        self._notices: list[str] = []  # our leased requests that a peer has pulled
        self.stats: dict[str, float] = {"kv_pulls": 0, "kv_pull_failures": 0, "kv_pull_bytes": 0}

    def start_loads(self, loads: list[KVLoad]) -> list[str]:
        failed = []
        for load in loads:
            peer = self.fabric.connectors.get(load.remote.side_channel)
            if load.local_block_ids and (peer is None or peer.compat_hash != self.compat_hash):
                self.stats["kv_pull_failures"] += 1
                failed.append(load.req_id)
                continue
            self._pulls[load.req_id] = _Pull(load, self.fabric.latency_polls)
        return failed

    def poll(self) -> TransferResults:
        out = TransferResults(released=self._notices)
        self._notices = []
        for rid, pull in list(self._pulls.items()):
            load = pull.load
            peer = self.fabric.connectors.get(load.remote.side_channel)
            if (peer is None and load.local_block_ids) or rid in self.fabric.fail_next:
                self.fabric.fail_next.discard(rid)
                del self._pulls[rid]
                self.stats["kv_pull_failures"] += 1
                out.failed.append(rid)
                continue
            if pull.polls_left > 0:
                pull.polls_left -= 1
                continue
            del self._pulls[rid]
            if peer is not None:
                src = torch.tensor(load.remote_block_ids, dtype=torch.long)
                dst = torch.tensor(load.local_block_ids, dtype=torch.long)
                self.kv_cache[dst] = peer.kv_cache[src].to(self.kv_cache.device)
                peer._notices.append(load.remote.request_id)
                self.stats["kv_pull_bytes"] += len(dst) * self.kv_cache[0].nbytes
            self.stats["kv_pulls"] += 1
            out.finished.append(rid)
        return out

    def info(self) -> ConnectorInfo:
        return ConnectorInfo(self.side_channel, needs_idle_progress=True, stats=dict(self.stats))

    def close(self) -> None:
        if self.fabric.connectors.get(self.side_channel) is self:
            del self.fabric.connectors[self.side_channel]
