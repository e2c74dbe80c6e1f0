"""Clients of the engine core, one interface over three transports:

- ``InprocClient``: the core in this process; ``get_output`` runs one step. For ``LLM``, tests.
- ``MPClient``: the core in a background process (``EngineCoreProc``), synchronous, over ZMQ.
- ``AsyncMPClient``: the same process and sockets, for asyncio (``AsyncLLM``, the worker service).

Over ZMQ every message is msgpack of a msgspec struct, decoded against a fixed type: nothing on
the socket can build an arbitrary object. Every wait is bounded: a dead core is noticed within
``POLL_S`` and raises ``EngineDeadError``.
"""

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from services.worker.engine.config import EngineConfig
from services.worker.engine.messages import (
    UTILITY_METHODS,
    EngineCoreAbort,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineStats,
    UtilityResult,
)
from shared.tmpdirs import make_private_dir

POLL_S = 0.5
STARTUP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine core process exited; every request in flight has failed."""


class EngineCoreClient:
    """The one interface; each client implements the sync or the async half."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def call_utility(self, method: str) -> Any:
        raise NotImplementedError

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the core and release its resources; idempotent."""


def _decode_result(result: UtilityResult, method: str) -> Any:
    if result.error is not None:
        raise ValueError(result.error)
    return msgspec.msgpack.decode(result.result, type=UTILITY_METHODS[method])


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        # imported here: the core brings torch and the model code, which a process that runs
        # it in ``EngineCoreProc`` (the worker service's front end) never needs
        from services.worker.engine.core import EngineCore

        self.core = EngineCore(config, show_progress)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def call_utility(self, method: str) -> Any:
        call = EngineCoreUtility(0, method)
        return _decode_result(self.core.call_utility(call), method)

    def shutdown(self) -> None:
        self.core.shutdown()


class _CoreProcess:
    """Spawns ``EngineCoreProc`` (a fresh interpreter, config as JSON on stdin: no pickle) and
    owns the two ZMQ sockets to it, bound here on ipc paths in a private temp dir."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float):
        self.tmp = str(make_private_dir("baton-core-"))  # (and stale ones of dead owners go)
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(f"ipc://{self.tmp}/input")
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"ipc://{self.tmp}/output")
        cmd = [
            sys.executable, "-m", "services.worker.engine.core_proc",
            "--input", f"ipc://{self.tmp}/input", "--output", f"ipc://{self.tmp}/output",
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(config))
        self.proc.stdin.close()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready_stats: EngineStats | None = None  # the core's stats when it came up
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            polled = self.output.poll(int(POLL_S * 1000))
            ready = self.decoder.decode(self.output.recv()).ready if polled else None
            if ready is not None:
                self.ready_stats = ready
                return
        self.close()
        raise TimeoutError(f"the engine core did not start within {timeout_s:.0f} s")

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise EngineDeadError(f"the engine core process exited with code {code}")

    def send(self, msg: EngineCoreInput) -> None:
        self.check_alive()
        self.input.send(self.encoder.encode(msg), copy=False)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self.input.send(self.encoder.encode(EngineCoreShutdown()), flags=zmq.NOBLOCK)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmp, ignore_errors=True)


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.core = _CoreProcess(config, startup_timeout_s)
        self._pending: deque[EngineCoreOutputs] = deque()
        self._call_ids = itertools.count()
        self._closed = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.send(EngineCoreAbort(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.popleft()
        return self._recv()

    def _recv(self) -> EngineCoreOutputs:
        while not self.core.output.poll(int(POLL_S * 1000)):
            self.core.check_alive()
        return self.core.decoder.decode(self.core.output.recv())

    def call_utility(self, method: str) -> Any:
        call_id = next(self._call_ids)
        self.core.send(EngineCoreUtility(call_id, method))
        while True:
            outs = self._recv()
            for result in outs.utility_results:
                if result.call_id == call_id:
                    if outs.outputs or outs.kv_events is not None:
                        self._pending.append(
                            EngineCoreOutputs(outputs=outs.outputs, kv_events=outs.kv_events)
                        )
                    return _decode_result(result, method)
            self._pending.append(outs)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()


class AsyncMPClient(EngineCoreClient):
    """The asyncio face of the same process. Utility calls resolve futures keyed by call id, so
    ``get_output_async`` (one reader task) and ``call_utility_async`` never race for a message."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.core = _CoreProcess(config, startup_timeout_s)
        self._input = zmq.asyncio.Socket.from_socket(self.core.input)
        self._output = zmq.asyncio.Socket.from_socket(self.core.output)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._closed = False

    async def _send(self, msg: EngineCoreInput) -> None:
        self.core.check_alive()
        await self._input.send(self.core.encoder.encode(msg), copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(EngineCoreAbort(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            while not await self._output.poll(int(POLL_S * 1000)):
                self.core.check_alive()
            outs = self.core.decoder.decode(await self._output.recv())
            for result in outs.utility_results:
                future = self._calls.pop(result.call_id, None)
                if future is not None and not future.done():
                    future.set_result(result)
            if outs.outputs or outs.kv_events is not None or not outs.utility_results:
                return outs

    def core_dead(self) -> bool:
        return self.core.proc.poll() is not None

    async def call_utility_async(self, method: str, timeout_s: float = 30.0) -> Any:
        """Needs a running ``get_output_async`` reader (AsyncLLM's output task) to resolve."""
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._send(EngineCoreUtility(call_id, method))
        try:
            result = await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        return _decode_result(result, method)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()
