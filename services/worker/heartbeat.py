"""The worker's life line to one global scheduler replica: one bidirectional stream per
connection,

    worker → registration (+ load + every cached block), then every ``heartbeat_interval_s``:
             load + KV events
    scheduler → commands (re-announce the KV blocks: its directory lost events; the KV side
                channels of the registered prefill workers, whenever they change)

and a reconnect with backoff when the stream breaks. On every (re)connection the engine is
asked to re-announce its prefix index (all-cleared, then every cached block), and the
registration carries it, so a restarted scheduler has the exact picture as soon as a worker is
back; a re-announce command is answered at once too (the engine core sends the events with its
answer, busy or idle). A worker keeps one
``Heartbeat`` per scheduler replica; ``main`` fans the engine's KV events out to all of them.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.worker import convert
from services.worker.engine.async_llm import AsyncLLM
from shared.kv_events import KVEventBatch
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import auth, channel

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 1.0  # a restarted scheduler hears from every worker within about a second


class Heartbeat:
    def __init__(
        self,
        address: str,
        registration: scheduler_pb2.WorkerRegistration,
        engine: AsyncLLM,
        load: Callable[[], Awaitable[scheduler_pb2.WorkerLoad]],
        interval_s: float,
        on_kv_peers: Callable[[str, frozenset[str]], None] = lambda replica, peers: None,
    ):
        self.address = address
        self.registration = registration
        self.engine = engine
        self.load = load
        self.interval_s = interval_s
        self.on_kv_peers = on_kv_peers  # (this replica's address, the peers it registered)
        self._events: list[common_pb2.KVEventBatch] = []
        self._wake = asyncio.Event()
        self._stopped = False
        self.connected = asyncio.Event()  # set once the scheduler has our registration

    def on_kv_events(self, batch: KVEventBatch) -> None:
        self._events.append(convert.kv_event_batch(batch))

    def wake(self) -> None:
        """Send a heartbeat now (the worker started draining, say)."""
        self._wake.set()

    async def run(self) -> None:
        backoff = 0.1
        while not self._stopped:
            try:
                async with channel(self.address) as ch:
                    stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
                    async for command in stub.Heartbeat(self._messages(), metadata=auth()):
                        if command.HasField("kv_peers"):
                            self.on_kv_peers(self.address,
                                             frozenset(command.kv_peers.side_channels))  # fmt: skip
                        if command.resync_kv_events:
                            logger.info("scheduler asks for the KV blocks: %s", command.reason)
                            await self.engine.resync_kv_events()
                            self._wake.set()  # the blocks leave now, not a heartbeat later
                    logger.info("the scheduler at %s ended the heartbeat stream", self.address)
                backoff = 0.1
            except grpc.aio.AioRpcError as e:
                if self.connected.is_set():
                    logger.warning("heartbeat to %s broke: %s", self.address, e.code().name)
                self.connected.clear()
            if not self._stopped:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def stop(self) -> None:
        """End the stream after the next message: the scheduler drops this worker at once."""
        self._stopped = True
        self._wake.set()

    async def _messages(self) -> AsyncIterator[scheduler_pb2.WorkerHeartbeat]:
        self._events.clear()  # superseded by the re-announcement below
        await self.engine.resync_kv_events()  # (its events are in self._events when it returns)
        events, self._events = self._events, []
        yield scheduler_pb2.WorkerHeartbeat(
            registration=self.registration, load=await self.load(), kv_events=events
        )
        self.connected.set()
        logger.info("registered with the global scheduler at %s", self.address)
        while not self._stopped:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            events, self._events = self._events, []
            yield scheduler_pb2.WorkerHeartbeat(load=await self.load(), kv_events=events)
