"""The gateway's connections to workers: one gRPC channel per worker address, reused across
requests, and on it one ``GenerateClient`` (the worker's long-lived GenerateStream).

``lost`` is what the scheduler's notice of a worker that missed its heartbeats does: every
request on that worker's stream ends as if the stream broke (each resumes elsewhere), and the
prefill calls waiting on it hear it through ``lost_signal``."""

import asyncio
import logging

import grpc

from services.gateway.generate_client import GenerateClient
from shared.protos.baton.v1 import worker_pb2_grpc
from shared.rpc import channel

logger = logging.getLogger(__name__)


class WorkerChannels:
    """One gRPC channel per worker address, reused across requests, and on it one
    GenerateClient (its long-lived GenerateStream)."""

    def __init__(self, generate_stream: bool = True) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._generate: dict[str, GenerateClient] = {}
        self._generate_stream = generate_stream
        self._lost: dict[str, asyncio.Event] = {}  # address → set when it is declared lost

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        if address not in self._stubs:
            ch = channel(address)
            self._stubs[address] = (ch, worker_pb2_grpc.WorkerStub(ch))
        return self._stubs[address][1]

    def generate(self, address: str) -> GenerateClient:
        if address not in self._generate:
            self._generate[address] = GenerateClient(self.stub(address), self._generate_stream)
        return self._generate[address]

    def lost_signal(self, address: str) -> asyncio.Event:
        """Set when the worker at ``address`` is declared lost (from now on)."""
        return self._lost.setdefault(address, asyncio.Event())

    def lost(self, address: str, why: str) -> None:
        """The worker at ``address`` hangs or is gone: end what waits on it, at once."""
        client = self._generate.get(address)
        waiting = client.stream is not None and bool(client.stream.pending) if client else False
        if client is not None:
            client.abandon(why)
        signal = self._lost.pop(address, None)
        if signal is not None:
            signal.set()
        if waiting or signal is not None:
            logger.warning("worker at %s lost (%s): moving its requests", address, why)

    async def close(self) -> None:
        for client in self._generate.values():
            await client.close()
        self._generate.clear()
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()
