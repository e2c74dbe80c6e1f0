"""The worker half of KV transfer: one NIXL agent per engine, the KV cache registered once.

    handshake   a ZMQ REP socket (a daemon thread) on the worker's advertised address answers
                peers with msgpack metadata: the NIXL agent blob, a compatibility hash (model,
                dtype, block size, layout, version), the cache's base address, block size in
                bytes and block count. Both sides prove they hold the internal token: the
                hello carries an HMAC of a fresh nonce and the time (refused when wrong or
                older than ``HELLO_MAX_AGE_S``), the answer an HMAC of that nonce and the
                metadata (a decode worker reads from no peer that cannot make it). UCX's
                listeners are bound to the interface of the same address (UCX_NET_DEVICES).
    pull        (decode side) per request, one READ of the missing blocks — one descriptor per
                block, since a block is contiguous across layers (kv_cache/layout.py) — from
                descriptor lists prepared once per peer; indices computed with numpy
    TP          each tensor-parallel rank has its own agent and side channel; a TP engine's
                side channel is its ranks' addresses joined by commas, in rank order. A decode
                rank reads the heads it holds from the prefill rank(s) that hold them
                (kv_transfer/tp_layout.py): whole blocks when both sides split the heads alike,
                else one descriptor per block, layer, K|V and token
    release     (decode side) on completion, a NIXL notification "release:<request id>:<n>"
                to every prefill rank; a prefill rank's lease part ends after n of them (one
                from each decode rank), and the engine's lease when every rank's has
    poll        every engine step: transfer states, and notifications from peers

Single-threaded by contract: every method except the side-channel thread runs on the engine
core's loop. On a GPU the agent has NIXL's progress thread (a peer's notification must not wait
for our next engine step); on the CPU it has none (steadier on few cores) and ``poll`` drives
it.
"""

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import numpy as np
import torch
import zmq

from services.worker.engine.kv_transfer.connector import (
    ONE_RANK,
    ConnectorInfo,
    KVConnector,
    RankPlacement,
    TransferResults,
)
from services.worker.engine.kv_transfer.params import KVLoad
from services.worker.engine.kv_transfer.tp_layout import BlockGeometry, head_runs, run_descriptors
from shared.internal_auth import TOKEN_ENV, is_unspecified

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_MS = 5_000
HELLO_MAX_AGE_S = 30.0
MAX_HELLO_BYTES = 1024  # a hello is ~70 bytes
TRANSFER_TIMEOUT_S = 30.0
NOTICE_TTL_S = 300.0  # a lease part whose other release notices never came is forgotten
UCX_MAX_POLL = 4096  # copies one progress call may complete (a 64k-token pull: 4,096 blocks)
T = TypeVar("T")


class PeerInfo(msgspec.Struct, frozen=True):
    agent_metadata: bytes
    compat_hash: str
    base_address: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # DRAM | VRAM
    device_id: int
    tp_rank: int = 0
    tp_size: int = 1
    local_heads: int = 0  # KV heads in this rank's blocks


class Hello(msgspec.Struct, frozen=True):
    """A decode worker's handshake request."""

    time: float
    nonce: bytes
    mac: bytes


class Answer(msgspec.Struct, frozen=True):
    """The prefill worker's: its ``PeerInfo`` (msgpack) and the proof it holds the token."""

    info: bytes
    mac: bytes


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big") + part)
    return h.digest()


def _net_device(host: str) -> str | None:
    """The network interface that holds ``host``'s address (None: none holds it)."""
    import psutil

    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    return None


class IncompatiblePeer(RuntimeError):
    """The peer's cache cannot be read into ours (different model, dtype, layout, ...)."""


def _check_rank(channel: str, info: PeerInfo, index: int, count: int) -> None:
    """A handle lists a TP engine's ranks in order: reading rank 1's heads as rank 0's would
    fill the cache with the wrong heads, silently."""
    if (info.tp_rank, info.tp_size) != (index, count):
        raise IncompatiblePeer(
            f"{channel} is rank {info.tp_rank} of {info.tp_size}, but the KV handle names it "
            f"rank {index} of {count}"
        )


@dataclass
class _Peer:
    name: str
    remote_dlist: object  # a prepped NIXL descriptor-list handle over every remote block
    info: PeerInfo
    geometry: BlockGeometry


@dataclass
class _Pull:
    load: KVLoad
    handles: list[object]  # one READ per prefill rank read from
    peers: list[str]  # every prefill rank's agent (each gets the release notice)
    channels: list[str]  # their side channels
    descriptors: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)


class NixlConnector(KVConnector):
    def __init__(
        self, engine_id: str, kv_cache: torch.Tensor, compat_hash: str, host: str,
        placement: RankPlacement = ONE_RANK,
    ):  # fmt: skip
        from nixl._api import nixl_agent, nixl_agent_config

        self.tp_rank, self.tp_size = placement.rank, placement.size
        self.num_kv_heads = placement.num_kv_heads or kv_cache.shape[4]
        # one agent per rank: their names must differ
        engine_id = engine_id if self.tp_size == 1 else f"{engine_id}.{self.tp_rank}"
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.kv_cache = kv_cache
        self._key = os.environ.get(TOKEN_ENV, "").encode()  # (the worker's; "" in process)
        if is_unspecified(host):  # the side channel and UCX listen where peers connect
            raise ValueError(f"the KV side channel needs one address to listen on, not {host!r}")
        if "UCX_NET_DEVICES" not in os.environ:  # (the operator's choice wins)
            device = _net_device(host)
            if device is None:  # fail closed: UCX would listen on every interface
                raise ValueError(f"no network interface of this host holds {host}: give the "
                                 "worker its own address, or set UCX_NET_DEVICES")  # fmt: skip
            os.environ["UCX_NET_DEVICES"] = device  # UCX listens on this interface only
        if kv_cache.is_cuda:  # (UCX warns about the variable where cuda_ipc is not loaded)
            # UCX's cuda_ipc completes at most MAX_POLL (default 16) copies per progress
            # call: one call per engine step must be able to finish a whole pull.
            os.environ.setdefault("UCX_CUDA_IPC_MAX_POLL", str(UCX_MAX_POLL))
        # A notification's sender waits until the receiver's agent progresses. Without a
        # progress thread that is once per engine step on the receiving side (a prefill step
        # of a long prompt: 100+ ms), and the decode engine sending "release" stalled that
        # long (measured: benchmarks/kv_transfer.py --peer-poll-ms). On a GPU host the thread
        # costs a core per engine; on a CPU engine (few cores, the model shares them) the
        # engine's own polling does it.
        self.progress_thread = kv_cache.is_cuda
        self.agent = nixl_agent(
            engine_id, nixl_agent_config(enable_prog_thread=self.progress_thread)
        )
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.num_blocks = kv_cache.shape[0]
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        _, layers, kv, block_size, heads, dim = kv_cache.shape
        self.geometry = BlockGeometry(
            layers * kv * block_size, heads, dim * kv_cache.element_size()
        )
        self._base = kv_cache.data_ptr()
        self._reg = self.agent.register_memory(kv_cache)
        base = kv_cache.data_ptr()
        blocks = [(base + i * self.block_bytes, self.block_bytes, self.device_id)
                  for i in range(self.num_blocks)]  # fmt: skip
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, self.mem_type)
        self.stats: dict[str, float] = {"kv_pulls": 0, "kv_pull_failures": 0, "kv_pull_bytes": 0,
                      "kv_pull_descriptors": 0, "kv_pull_seconds": 0.0,
                      "kv_notify_seconds": 0.0}  # fmt: skip
        self._peers: dict[str, _Peer] = {}  # side channel → peer
        self._pulls: dict[str, _Pull] = {}
        self._notices: dict[str, tuple[int, float]] = {}  # request → (releases seen, first)
        self._ctx = zmq.Context()
        self._rep = self._ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)  # a bigger one drops its peer
        port = self._rep.bind_to_random_port(f"tcp://{host}")
        self.side_channel = f"tcp://{host}:{port}"
        self._info = msgspec.msgpack.encode(
            PeerInfo(self.agent.get_agent_metadata(), compat_hash, base, self.block_bytes,
                     self.num_blocks, self.mem_type, self.device_id, self.tp_rank, self.tp_size,
                     heads)
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_handshakes, daemon=True)
        self._thread.start()

    # ---- decode side ---------------------------------------------------------------------
    def start_loads(self, loads: list[KVLoad]) -> list[str]:
        """Start one READ per load; returns the request ids that failed to start."""
        failed = []
        for load in loads:
            if not load.local_block_ids:
                self._pulls[load.req_id] = _Pull(load, [], [], [])  # nothing to read: done
                continue
            pull = _Pull(load, [], [], [])
            try:
                self._start(pull)
                self._pulls[load.req_id] = pull
            except Exception as e:
                logger.error("KV pull for %s from %s failed: %s", load.req_id,
                             load.remote.engine_id, e)  # fmt: skip
                for handle in pull.handles:
                    self._quietly(self.agent.release_xfer_handle, handle)
                self.stats["kv_pull_failures"] += 1
                failed.append(load.req_id)
        return failed

    def _start(self, pull: _Pull) -> None:
        """One READ per prefill rank that holds some of our heads (every rank is greeted: each
        gets the release notice)."""
        load = pull.load
        pull.channels = load.remote.side_channel.split(",")
        peers = [self._peer(ch, load.remote.engine_id, i, len(pull.channels))
                 for i, ch in enumerate(pull.channels)]  # fmt: skip
        pull.peers = [p.name for p in peers]
        local_ids = np.asarray(load.local_block_ids, dtype=np.int64)
        remote_ids = np.asarray(load.remote_block_ids, dtype=np.int64)
        for run in head_runs(self.tp_rank, self.tp_size, len(peers), self.num_kv_heads):
            peer = peers[run.src_rank]
            whole = run.count == self.geometry.local_heads == peer.geometry.local_heads
            if whole:  # both sides split the heads alike: whole blocks, prepared lists
                handle = self.agent.make_prepped_xfer(
                    "READ", self._local, local_ids, peer.remote_dlist, remote_ids
                )
                n = len(local_ids)
            else:
                local = run_descriptors(self._base, self.geometry, load.local_block_ids,
                                        run.dst_start, run.count, self.device_id,
                                        per_row=True)  # fmt: skip
                remote = run_descriptors(peer.info.base_address, peer.geometry,
                                         load.remote_block_ids, run.src_start, run.count,
                                         peer.info.device_id, per_row=True)  # fmt: skip
                handle = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(local, self.mem_type),
                    self.agent.get_xfer_descs(remote, peer.info.mem_type), peer.name,
                )  # fmt: skip
                n = len(local)
            pull.handles.append(handle)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL refused the transfer")
            pull.descriptors += n
            pull.bytes += len(local_ids) * self.geometry.rows * run.count * self.geometry.head_bytes

    def poll(self, notifications: bool = True) -> TransferResults:
        """Transfer states, and (unless told not to) peers' release notifications. A peer that
        died mid-transfer fails its pulls here (NIXL raises a disconnect): never the engine."""
        out = TransferResults()
        for rid, pull in list(self._pulls.items()):
            state = self._state(pull)
            if state == "PROC" and time.monotonic() - pull.started <= TRANSFER_TIMEOUT_S:
                continue
            del self._pulls[rid]
            for handle in pull.handles:
                self._quietly(self.agent.release_xfer_handle, handle)
            if state == "DONE":
                self.stats["kv_pulls"] += 1
                self.stats["kv_pull_bytes"] += pull.bytes
                self.stats["kv_pull_descriptors"] += pull.descriptors
                self.stats["kv_pull_seconds"] += time.monotonic() - pull.started
                out.finished.append(rid)
                # every prefill rank may end its part of the lease once each decode rank says so
                release = f"release:{pull.load.remote.request_id}:{self.tp_size}".encode()
                sent = time.monotonic()
                for peer in pull.peers:
                    self._quietly(self.agent.send_notif, peer, release)
                self.stats["kv_notify_seconds"] += time.monotonic() - sent
            else:
                logger.error("KV pull for %s from %s ended in state %s", rid,
                             pull.load.remote.engine_id, state)  # fmt: skip
                self.stats["kv_pull_failures"] += 1
                out.failed.append(rid)
                for channel in pull.channels:
                    self._forget(channel)
        if notifications:
            notifs = self._quietly(self.agent.get_new_notifs) or {}
            for msgs in notifs.values():
                for msg in msgs:
                    text = msg.decode(errors="replace")
                    if text.startswith("release:"):
                        self._notice(text.removeprefix("release:"), out)
        return out

    def _notice(self, text: str, out: TransferResults) -> None:
        """One decode rank's release of ``<request id>:<decode ranks>``: our part of the lease
        ends with the last of them (a bare ``<request id>``: one rank)."""
        rid, _, count = text.rpartition(":")
        if not (rid and count.isdigit()):
            rid, count = text, "1"
        now = time.monotonic()
        seen = self._notices.pop(rid, (0, now))[0] + 1
        if seen >= int(count):
            out.released.append(rid)
        else:
            self._notices[rid] = (seen, now)
        for old, (_, first) in list(self._notices.items()):  # the rest never came: forget them
            if now - first > NOTICE_TTL_S:
                del self._notices[old]

    def _state(self, pull: _Pull) -> str:
        """DONE when every READ of the pull is, ERR as soon as one fails, else PROC."""
        states = []
        for handle in pull.handles:
            try:
                states.append(str(self.agent.check_xfer_state(handle)))
            except Exception as e:  # nixlRemoteDisconnectError: the prefill worker is gone
                logger.error("KV pull for %s: %s", pull.load.req_id, e)
                return "ERR"
        if any(s not in ("DONE", "PROC") for s in states):
            return "ERR"
        return "PROC" if "PROC" in states else "DONE"

    def _forget(self, side_channel: str) -> None:
        """Drop a failed peer once none of its pulls is in flight (they fail too, and the
        last one drops it): the next request for it handshakes again, or fails fast."""
        peer = self._peers.get(side_channel)
        if peer is None or any(peer.name in p.peers for p in self._pulls.values()):
            return
        del self._peers[side_channel]
        self._quietly(self.agent.release_dlist_handle, peer.remote_dlist)
        self._quietly(self.agent.remove_remote_agent, peer.name)

    @staticmethod
    def _quietly(fn: Callable[..., T], *args: object) -> T | None:
        """A NIXL call whose failure (a peer gone) must not stop the engine: logged, None."""
        try:
            return fn(*args)
        except Exception as e:
            logger.warning("NIXL %s: %s", getattr(fn, "__name__", fn), e)
            return None

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def info(self) -> ConnectorInfo:
        return ConnectorInfo(self.side_channel, not self.progress_thread, dict(self.stats))

    def _peer(self, channel: str, engine_id: str, index: int, count: int) -> _Peer:
        """The prefill rank ``index`` of ``count`` at ``channel`` (greeted once, then cached;
        the rank it said it is must be the one the handle names, every time)."""
        peer = self._peers.get(channel)
        if peer is not None:
            _check_rank(channel, peer.info, index, count)
            return peer
        req = self._ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
        req.setsockopt(zmq.SNDTIMEO, HANDSHAKE_TIMEOUT_MS)
        nonce, now = secrets.token_bytes(16), time.time()
        hello = Hello(now, nonce, _mac(self._key, b"hello", repr(now).encode(), nonce))
        try:
            req.connect(channel)
            req.send(msgspec.msgpack.encode(hello))
            answer = msgspec.msgpack.decode(req.recv(), type=Answer)
        except zmq.Again:
            raise RuntimeError(f"no answer from {channel} (handshake)") from None
        except msgspec.DecodeError:
            raise RuntimeError(f"{channel} refused the handshake") from None
        finally:
            req.close()
        if not hmac.compare_digest(answer.mac, _mac(self._key, b"info", nonce, answer.info)):
            raise RuntimeError(f"{channel} does not hold the internal token")
        info = msgspec.msgpack.decode(answer.info, type=PeerInfo)
        if info.compat_hash != self.compat_hash:
            raise IncompatiblePeer(
                f"peer {engine_id}'s KV cache is not this engine's (model, dtype, block size, "
                f"layout or FP8 scales differ): theirs {info.compat_hash[:200]!r}, ours "
                f"{self.compat_hash!r}"
            )
        _check_rank(channel, info, index, count)
        name = self.agent.add_remote_agent(info.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        blocks = [(info.base_address + i * info.block_bytes, info.block_bytes, info.device_id)
                  for i in range(info.num_blocks)]  # fmt: skip
        dlist = self.agent.prep_xfer_dlist(name, blocks, info.mem_type)
        heads = info.local_heads or self.geometry.local_heads
        geometry = BlockGeometry(self.geometry.rows, heads, self.geometry.head_bytes)
        if geometry.block_bytes != info.block_bytes:
            raise IncompatiblePeer(f"{channel}: blocks of {info.block_bytes} bytes, expected "
                                   f"{geometry.block_bytes}")  # fmt: skip
        peer = self._peers[channel] = _Peer(name, dlist, info, geometry)
        logger.info("KV peer %s at %s (rank %d of %d): %d blocks of %d bytes", name, channel,
                    info.tp_rank, info.tp_size, info.num_blocks, info.block_bytes)  # fmt: skip
        return peer

    # ---- prefill side --------------------------------------------------------------------
    def _serve_handshakes(self) -> None:
        while not self._stop.is_set():
            if not self._rep.poll(200):
                continue
            try:
                self._rep.send(self._answer(self._rep.recv()))
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.warning("handshake socket: %s", e)

    def _answer(self, raw: bytes) -> bytes:
        """The metadata for a hello that proves the token and is fresh; else an empty reply
        (a REP socket must answer), with nothing in it."""
        try:
            hello = msgspec.msgpack.decode(raw, type=Hello)
        except msgspec.DecodeError:
            return b""
        expected = _mac(self._key, b"hello", repr(hello.time).encode(), hello.nonce)
        if not hmac.compare_digest(hello.mac, expected):
            logger.warning("KV handshake refused: the caller does not hold the internal token")
            return b""
        if abs(time.time() - hello.time) > HELLO_MAX_AGE_S:
            logger.warning("KV handshake refused: a stale hello (replayed, or clocks apart)")
            return b""
        mac = _mac(self._key, b"info", hello.nonce, self._info)
        return msgspec.msgpack.encode(Answer(self._info, mac))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._rep.close(linger=0)
        self._ctx.term()
