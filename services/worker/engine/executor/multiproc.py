"""``MultiprocExecutor``: one process per tensor-parallel rank, on one host.

    engine core ──PUSH ipc://<dir>/rank-N──▶ rank N (executor/rank_proc.py), one socket per rank
                ◀──────PULL ipc://<dir>/replies── every rank's answers

``<dir>`` is a private (0700) temp dir that also holds the ranks' ``FileStore``; nothing listens
on a TCP port for the executor (gloo's and NCCL's own sockets are kept on the loopback interface
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise). Each step costs one message
to every rank, and one more (``Collect``) when the core takes its tokens; only rank 0 answers,
with the sampled tokens. Every wait is bounded and watches the ranks: a rank that exits or
reports an error fails the engine within ``POLL_MS`` with ``RankFailedError`` saying which rank,
and the executor stops the others.
"""

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import msgspec
import zmq

from services.worker.engine.config import EngineConfig
from services.worker.engine.executor.rank import (
    ANSWERS,
    RankExecutor,
    RankReply,
    Shutdown,
    answered_by,
)
from shared.tmpdirs import make_private_dir

logger = logging.getLogger(__name__)

POLL_MS = 200
START_TIMEOUT_S = 1800.0  # loading a large model from a slow disk takes many minutes
CALL_TIMEOUT_S = 300.0  # the longest one step may take (a full token budget of prefill)
STOP_TIMEOUT_S = 10.0
EXIT_GRACE_S = 1.0  # a rank's error: how long to look for a peer's death behind it


class MultiprocExecutor(RankExecutor):
    def __init__(
        self, config: EngineConfig, show_progress: bool = True,
        start_timeout_s: float = START_TIMEOUT_S,
    ):  # fmt: skip
        super().__init__(config)
        self.tmp = str(make_private_dir("baton-ranks-"))  # (and stale ones of dead owners go)
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(f"ipc://{self.tmp}/replies")
        self.calls = []
        for rank in range(self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            # a dead rank leaves its socket without a peer, where a send would wait forever:
            # sends give up every POLL_MS to look for exited ranks (``_send``)
            sock.setsockopt(zmq.SNDTIMEO, POLL_MS)
            sock.bind(f"ipc://{self.tmp}/rank-{rank}")
            self.calls.append(sock)
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host talk over loopback
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        config_json = msgspec.json.encode(config)
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(self.world_size):
            cmd = [
                sys.executable, "-m", "services.worker.engine.executor.rank_proc",
                "--rank", str(rank), "--calls", f"ipc://{self.tmp}/rank-{rank}",
                "--replies", f"ipc://{self.tmp}/replies", "--store", f"file:{self.tmp}/store",
                "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            proc.stdin.write(config_json)
            proc.stdin.close()
            self.procs.append(proc)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(RankReply)
        self.seq = 0
        self._await(0, range(self.world_size), start_timeout_s, None)
        logger.info("%d tensor-parallel rank(s) up: pids %s", self.world_size,
                    [p.pid for p in self.procs])  # fmt: skip

    def _stop(self) -> None:
        for sock in self.calls:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(self.encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- calls and answers ---------------------------------------------------------------
    def _call(self, call: object, others: object | None = None) -> dict[int, Any]:
        self._check_usable()
        self.seq += 1
        raw = self.encoder.encode(call)
        rest = raw if others is None else self.encoder.encode(others)
        for rank, sock in enumerate(self.calls):
            self._send(sock, raw if rank == 0 else rest)
        ranks = answered_by(call, self.world_size, self.kv_transfer)
        return self._await(self.seq, ranks, CALL_TIMEOUT_S, ANSWERS.get(type(call)))

    def _send(self, sock: zmq.Socket, payload: bytes) -> None:
        """One call to one rank, within ``CALL_TIMEOUT_S``: a rank that has exited (its socket
        then has no peer to take it) fails the engine within ``POLL_MS``."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            try:
                sock.send(payload)
                return
            except zmq.Again:
                exited = self._exited()
                if exited:
                    self._fail(exited)
                if time.monotonic() > deadline:
                    self._fail(f"a tensor-parallel rank took no call within {CALL_TIMEOUT_S:.0f} s")

    def _await(self, seq: int, ranks: range, timeout_s: float, kind: type | None) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(ranks):
            if self.replies.poll(POLL_MS):
                reply = self.decoder.decode(self.replies.recv())
                if reply.error:
                    self._fail(self._root_cause(reply.error))
                if reply.seq != seq or reply.rank not in ranks:
                    self._fail(f"rank {reply.rank} answered call {reply.seq}, expected {seq}")
                got[reply.rank] = (
                    msgspec.msgpack.decode(reply.result, type=kind) if kind is not None else None
                )
                continue
            exited = self._exited()
            if exited:
                self._fail(exited)
            if time.monotonic() > deadline:
                missing = sorted(set(ranks) - set(got))
                self._fail(f"tensor-parallel rank(s) {missing} did not answer within "
                           f"{timeout_s:.0f} s")  # fmt: skip
        return got

    def _exited(self) -> str:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return ""

    def _root_cause(self, error: str) -> str:
        """A rank's error, or first the death of a peer that caused it (a collective with a
        dead rank fails on the live one, often before the dead one is seen to have exited)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            exited = self._exited()
            if exited:
                return f"{exited}; then {error}"
            time.sleep(0.05)
        return error
