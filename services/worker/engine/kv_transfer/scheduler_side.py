"""The scheduler half of KV transfer: pure bookkeeping, no I/O (the worker half moves bytes).

Decode leg (a request that arrives with ``KVTransferParams.remote``)::

    WAITING_FOR_REMOTE_KV ──blocks allocated, pull started (KVLoad)──▶ loading
        loading ──finished──▶ kv_ready, back to the queue's head ──▶ RUNNING (decodes on)
        loading ──failed──▶ recompute the prompt here (if configured) | FINISHED_ERROR
    WAITING_FOR_REMOTE_KV ──its handle's lease expired while it waited──▶ failed the same way,
        unread (the prefill engine may have given those blocks to another prompt)

    prompt blocks:   | hit | hit | pull | pull | pull (partial) |
                       └ already held here ┘└─ READ from the prefill engine ─┘

Prefill leg (``do_remote_decode``): when it finishes, its blocks are not freed but leased; the
lease ends when the decode side says it has pulled them, on abort, or at expiry.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.worker.engine.config import KVTransferConfig
from services.worker.engine.kv_transfer.params import NO_BLOCK, KVLoad, RemoteKV
from services.worker.engine.request import Request
from shared.ids import RequestId


@dataclass
class Lease:
    request: Request
    expires_at: float  # time.monotonic()


class KVTransferBookkeeping:
    def __init__(self, config: KVTransferConfig, block_size: int, side_channel: str):
        self.block_size = block_size
        self.lease_seconds = config.lease_seconds
        self.engine_id = config.engine_id
        self.recompute_on_failure = config.recompute_on_failure  # decode side, on a failed pull
        self.side_channel = side_channel  # the worker half's, handed out in KV handles
        self.loading: dict[RequestId, Request] = {}
        self.leases: dict[RequestId, Lease] = {}
        self.num_released = 0  # leases ended by the decode side (or an abort)
        self.num_expired = 0  # leases nobody pulled in time
        self.num_stale = 0  # decode legs whose handle's lease had expired: not read

    def load_for(
        self, request: Request, local_block_ids: Sequence[list[int]], num_hit: int, null: int
    ) -> KVLoad:
        """The pull that fills ``request``'s prompt blocks after its ``num_hit`` local hits:
        in each KV cache group, block for block, those this side holds (``null``: a windowed
        group's block it does not, before the prompt's last window). The handle sends the
        same window (both sides' groups agree: the handshake compares them)."""
        remote = request.kv_transfer.remote if request.kv_transfer else None
        if remote is None:
            raise ValueError("not a decode leg")
        skip = num_hit // self.block_size
        local: list[int] = []
        theirs: list[int] = []
        for mine, sent in zip(local_block_ids, remote.group_block_ids(), strict=True):
            for a, b in zip(mine[skip : len(sent)], sent[skip:], strict=False):
                if a == null:
                    continue
                if b == NO_BLOCK:  # (a peer whose window differs: the handshake refuses it)
                    raise ValueError("the KV handle lacks a block of the prompt's last window")
                local.append(a)
                theirs.append(b)
        self.loading[request.request_id] = request
        return KVLoad(request.request_id, local, theirs, remote)

    def lease_expired(self, request: Request, now: float | None = None) -> bool:
        """Whether a decode leg's handle has outlived its lease (the prefill engine's wall
        clock: hosts are assumed to keep time, as they must for any deadline)."""
        remote = request.kv_transfer.remote if request.kv_transfer else None
        if remote is None or not remote.lease_expires_at:
            return False
        if (time.time() if now is None else now) < remote.lease_expires_at:
            return False
        self.num_stale += 1
        return True

    def lease(self, request: Request, block_ids: Sequence[list[int]], null: int) -> RemoteKV:
        """Keep a finished prefill leg's blocks for the decode side; returns its KV handle
        (each KV cache group's blocks in turn, ``null`` ones as NO_BLOCK)."""
        self.leases[request.request_id] = Lease(request, time.monotonic() + self.lease_seconds)
        return RemoteKV(
            engine_id=self.engine_id,
            side_channel=self.side_channel,
            block_ids=[NO_BLOCK if b == null else b for ids in block_ids for b in ids],
            num_groups=len(block_ids),
            num_tokens=request.num_prompt_tokens,
            lease_expires_at=time.time() + self.lease_seconds,
            request_id=request.request_id,
        )

    def end_lease(self, request_id: str, expired: bool = False) -> Request | None:
        lease = self.leases.pop(RequestId(request_id), None)
        if lease is None:
            return None
        if expired:
            self.num_expired += 1
        else:
            self.num_released += 1
        return lease.request

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [rid for rid, lease in self.leases.items() if lease.expires_at <= now]

    @property
    def busy(self) -> bool:
        """Something needs the engine to keep polling: pulls in flight, or leases to expire."""
        return bool(self.loading or self.leases)
