"""``EngineCoreProc``: the engine core in its own process, behind two ZMQ sockets.

The loop drains every pending input, runs one step when there is work, and sends the outputs;
idle, it blocks on the input socket for at most ``POLL_MS`` so it notices a dead parent (for
``IDLE_KV_POLL_MS`` when its NIXL agent has no progress thread: it progresses the agent then). The
config arrives as JSON on stdin; messages are msgpack decoded against a fixed tagged union.

Calls (``get_stats`` and the like) are answered between steps only, so the core also pushes its
stats with the outputs of its steps: a frontend knows the load of a core that is busy in one
long step without waiting for that step to end.
"""

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import msgspec
import zmq

from services.worker.engine.config import EngineConfig
from services.worker.engine.core import EngineCore
from services.worker.engine.messages import (
    EngineCoreAbort,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineStats,
)
from shared import hop_trace
from shared.lifecycle import freeze_startup_heap

POLL_MS = 500
KV_POLL_MS = 2
IDLE_KV_POLL_MS = 20  # idle, measured: 1.2-1.6 % of a core per engine core (2.2-2.4 % at 10 ms)
STATS_PUSH_S = 0.1  # how stale a busy core's pushed stats may get (the heartbeat sends 2 a second)
logger = logging.getLogger("baton.engine_core")


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int):
        self.parent_pid = parent_pid
        self.orphaned = False
        self.ipc_dir = _ipc_dir(input_addr)
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        self.core = EngineCore(config, show_progress=False)
        self._idle_progress = self.core.needs_idle_progress()
        self._stats_pushed_at, self._stats_pushed = time.monotonic(), self.core.stats()
        self._send(EngineCoreOutputs(ready=self._stats_pushed))

    def run(self) -> None:
        while self._handle_inputs(self._wait_ms()):
            outs = EngineCoreOutputs()
            if self.core.has_work() or self.core.needs_polling():
                outs = self.core.step()
            elif self._idle_progress:
                self.core.progress_transfers()
            outs.stats = self._stats_due()
            if outs.outputs or outs.kv_events or outs.stats is not None:
                self._send(outs)
        self.close()

    def _stats_due(self) -> EngineStats | None:
        """The stats to push now, when they changed since the last push: at most every
        ``STATS_PUSH_S`` while steps run (or KV transfers are polled), at once otherwise (so a
        frontend's copy is exact within that bound of the last change, busy or idle)."""
        now = time.monotonic()
        busy = self.core.has_work() or self.core.needs_polling()
        if busy and now - self._stats_pushed_at < STATS_PUSH_S:
            return None
        stats = self.core.stats()
        if stats == self._stats_pushed:
            return None
        self._stats_pushed_at, self._stats_pushed = now, stats
        return stats

    def _wait_ms(self) -> int:
        """How long to wait for input: not at all with work, briefly while KV transfers need
        polling, ``IDLE_KV_POLL_MS`` when idle with a NIXL agent that has no progress thread,
        else up to ``POLL_MS`` (then the parent's liveness is checked)."""
        if self.core.has_work():
            return 0
        if self.core.needs_polling():
            return KV_POLL_MS
        return IDLE_KV_POLL_MS if self._idle_progress else POLL_MS

    def _handle_inputs(self, wait_ms: int) -> bool:
        """Process every queued input; False on shutdown or when the parent is gone (checked
        every step too: an orphaned core must not keep computing for nobody)."""
        if wait_ms:
            self.input.poll(wait_ms)
        if os.getppid() != self.parent_pid:
            logger.warning("parent process %d is gone; exiting", self.parent_pid)
            self.orphaned = True
            return False
        while True:
            try:
                raw = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = self.decoder.decode(raw)
            except msgspec.DecodeError as e:
                logger.error("dropping a malformed message: %s", e)
                continue
            if isinstance(msg, EngineCoreShutdown):
                return False
            self._dispatch(msg)

    def _dispatch(self, msg: EngineCoreInput) -> None:
        if isinstance(msg, EngineCoreRequest):
            hop_trace.mark("core.request_in", msg.request_id)
            self.core.add_request(msg)
        elif isinstance(msg, EngineCoreAbort):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, EngineCoreUtility):
            # with any KV events it made (a re-announce): an idle engine may not step for long
            result = self.core.call_utility(msg)
            events = self.core.take_kv_events()
            self._send(EngineCoreOutputs(utility_results=[result], kv_events=events))

    def _send(self, outs: EngineCoreOutputs) -> None:
        if hop_trace.ENABLED:
            for out in outs.outputs:
                hop_trace.mark("core.output", out.request_id)
        self.output.send(self.encoder.encode(outs), copy=False)

    def close(self) -> None:
        self.core.shutdown()
        self.ctx.destroy(linger=1000 if not self.orphaned else 0)
        if self.orphaned and self.ipc_dir is not None:  # nobody else is left to remove it
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _ipc_dir(addr: str) -> str | None:
    """The private socket dir ``MPClient`` made (``ipc://<tmp>/baton-core-*/input``)."""
    path = Path(addr.removeprefix("ipc://")).parent
    return str(path) if addr.startswith("ipc://") and path.name.startswith("baton-core-") else None


def main() -> None:
    parser = argparse.ArgumentParser(description="Baton engine core process")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    proc = EngineCoreProc(config, args.input, args.output, args.parent_pid)
    freeze_startup_heap()
    proc.run()


if __name__ == "__main__":
    main()
