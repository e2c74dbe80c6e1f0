"""The worker's life line to one global scheduler replica: one bidirectional stream per
connection,

    worker → registration (+ load + every cached block), then every ``heartbeat_interval_s``:
             load + KV events; ``leaving`` last where it ends the stream on purpose (stopping,
             or registering anew)
    scheduler → commands (re-announce the KV blocks: its directory lost events; the KV side
                channels of the registered prefill workers, whenever they change; dropped:
                this worker had gone silent past its timeout, its work was moved)

and a reconnect with backoff when the stream breaks. On every (re)connection the engine is
asked to re-announce its prefix index (all-cleared, then every cached block), and the
registration carries it, so a restarted scheduler has the exact picture as soon as a worker is
back; a re-announce command is answered at once too (the engine core sends the events with its
answer). A worker keeps one ``Heartbeat`` per scheduler replica (``schedulers.SchedulerSet``,
which retires the heartbeat of a replica that leaves the set); ``main`` fans the engine's KV
events out to all of them.

A heartbeat never waits on the engine's step: the load it reports is the engine's last pushed
stats (``load`` returns at once), and a re-announcement waits at most ``RESYNC_WAIT_S`` (the
engine answers between steps only; a late answer's blocks follow on a later heartbeat). Any
failure ends the stream and starts a new one: a worker busy in one long step, or hit by an
unexpected error, stays registered.

``dropped`` goes to ``on_dropped`` (the worker ends its requests and takes a new incarnation:
watchdog.Reincarnation), and the stream starts again; ``reregister`` gives every heartbeat the
new registration, each ending its stream to register it on a new one.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc

from services.worker import convert
from shared.kv_events import KVEventBatch
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import auth, channel

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 1.0  # a restarted scheduler hears from every worker within about a second
RESYNC_WAIT_S = 1.0  # how long a (re)registration waits for the engine's blocks


# (this replica's address, the registration of the stream it answered ``dropped`` on)
OnDropped = Callable[[str, scheduler_pb2.WorkerRegistration], Awaitable[None]]


async def _register_again(replica: str, registered: scheduler_pb2.WorkerRegistration) -> None:
    """By default a dropped worker registers again as it was."""


class KVResync(Protocol):
    async def resync_kv_events(self) -> None:
        """Have the engine re-announce its prefix index through the KV-event listener."""


class Heartbeat:
    def __init__(
        self,
        address: str,
        registration: scheduler_pb2.WorkerRegistration,
        engine: KVResync,
        load: Callable[[], scheduler_pb2.WorkerLoad],
        interval_s: float,
        on_kv_peers: Callable[[str, frozenset[str]], None] = lambda replica, peers: None,
        tls_name: str | None = None,
    ):
        self.address = address
        self.tls_name = tls_name  # what the scheduler's certificate names (a DNS-found address)
        self.registration = registration
        self.engine = engine
        self.load = load  # the worker's load now; must return at once (never await the engine)
        self.interval_s = interval_s
        self.on_kv_peers = on_kv_peers  # (this replica's address, the peers it registered)
        self._events: list[common_pb2.KVEventBatch] = []
        self._wake = asyncio.Event()
        self._stopped = False
        self._reregister = False  # end the stream: the next one registers anew
        # a replica said it had dropped this worker (main: a new incarnation for all replicas)
        self.on_dropped: OnDropped = _register_again
        self._failure: BaseException | None = None  # why our side ended the last stream
        self.connected = asyncio.Event()  # set once the scheduler has our registration
        self.disconnected_at: float | None = time.monotonic()  # None while connected

    def on_kv_events(self, batch: KVEventBatch) -> None:
        self._events.append(convert.kv_event_batch(batch))

    def wake(self) -> None:
        """Send a heartbeat now (the worker started draining, say)."""
        self._wake.set()

    async def run(self) -> None:
        """Until ``stop``: stream, and on any failure log it and stream again (backoff)."""
        backoff = 0.1
        while not self._stopped:
            try:
                await self._stream()
                backoff = 0.1
            except grpc.aio.AioRpcError as e:
                if self.connected.is_set():
                    logger.warning("heartbeat to %s broke: %s", self.address, e.code().name)
            except asyncio.CancelledError:
                if _cancelling():  # we are being stopped
                    raise
                # grpc cancels the call when the stream's messages fail (the reason is kept)
                logger.error("heartbeat to %s failed: %r; reconnecting", self.address,
                             self._failure)  # fmt: skip
            except Exception:
                logger.exception("heartbeat to %s failed; reconnecting", self.address)
            self._on_disconnect()
            if not self._stopped:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def stop(self) -> None:
        """End the stream with a goodbye (``leaving``) as its next message: the scheduler drops
        this worker at once. (Stopped before its registration went out, it sends nothing.)"""
        self._stopped = True
        self._wake.set()

    def reregister(self, registration: scheduler_pb2.WorkerRegistration) -> None:
        """Register ``registration`` (a new incarnation): the stream ends at once, its next
        message the goodbye, and the next stream starts with it."""
        self.registration = registration
        self._reregister = True
        self._wake.set()

    def retire(self) -> None:
        """``stop``, for a replica that left the worker's set: the KV peers it named no longer
        count (and no later word from it does)."""
        self.stop()
        self.on_kv_peers(self.address, frozenset())

    async def _stream(self) -> None:
        self._failure, self._reregister = None, False
        registration = self.registration
        async with channel(self.address, self.tls_name) as ch:
            stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
            async for command in stub.Heartbeat(self._messages(registration), metadata=auth()):
                if command.dropped:
                    logger.warning("the scheduler at %s: %s", self.address, command.reason)
                    await self.on_dropped(self.address, registration)
                    return  # (it ends the stream too) the next one registers again
                if command.HasField("kv_peers") and not self._stopped:
                    self.on_kv_peers(self.address, frozenset(command.kv_peers.side_channels))
                if command.resync_kv_events:
                    logger.info("scheduler asks for the KV blocks: %s", command.reason)
                    await self._resync()
                    self._wake.set()  # the blocks leave now, not a heartbeat later
        if self._failure is not None:
            logger.error("heartbeat to %s failed: %r; reconnecting", self.address, self._failure)
        elif self._reregister:
            logger.info("registering again with %s as incarnation %s", self.address,
                        self.registration.incarnation)  # fmt: skip
        elif not self._stopped:
            logger.info("the scheduler at %s ended the heartbeat stream", self.address)

    def _on_disconnect(self) -> None:
        self.connected.clear()
        if self.disconnected_at is None:
            self.disconnected_at = time.monotonic()

    async def _resync(self) -> None:
        """Ask the engine to re-announce its blocks; bounded (see the module's docstring)."""
        try:
            await asyncio.wait_for(self.engine.resync_kv_events(), RESYNC_WAIT_S)
        except TimeoutError:
            logger.info("the engine is in a step: its KV blocks follow when the step ends")

    async def _messages(
        self, registration: scheduler_pb2.WorkerRegistration
    ) -> AsyncIterator[scheduler_pb2.WorkerHeartbeat]:
        """The stream's messages, the first registering ``registration``. Never raises (grpc
        would cancel the call without a word): a failure is kept in ``_failure`` and ends the
        stream, and ``run`` starts another."""
        try:
            self._events.clear()  # superseded by the re-announcement below
            await self._resync()  # (its events are in self._events when it returns in time)
            if self._stopped:
                return  # (nothing registered on this stream: no goodbye owed)
            events, self._events = self._events, []
            yield scheduler_pb2.WorkerHeartbeat(
                registration=registration, load=self.load(), kv_events=events
            )
            self.connected.set()
            self.disconnected_at = None
            logger.info("registered with the global scheduler at %s", self.address)
            while not self._stopped:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                self._wake.clear()
                if self._reregister or self._stopped:
                    break  # the goodbye next, before anything else
                events, self._events = self._events, []
                yield scheduler_pb2.WorkerHeartbeat(load=self.load(), kv_events=events)
            # ended on purpose: said, so that the scheduler does not take it for a break
            yield scheduler_pb2.WorkerHeartbeat(leaving=True)
        except Exception as e:
            self._failure = e


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
