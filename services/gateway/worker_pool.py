"""The gateway's connections to workers: one gRPC channel per worker address, reused across
requests, and on it one ``GenerateClient`` (the worker's long-lived GenerateStream)."""

import grpc

from services.gateway.generate_client import GenerateClient
from shared.protos.baton.v1 import worker_pb2_grpc
from shared.rpc import channel


class WorkerChannels:
    """One gRPC channel per worker address, reused across requests, and on it one
    GenerateClient (its long-lived GenerateStream)."""

    def __init__(self, generate_stream: bool = True) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._generate: dict[str, GenerateClient] = {}
        self._generate_stream = generate_stream

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        if address not in self._stubs:
            ch = channel(address)
            self._stubs[address] = (ch, worker_pb2_grpc.WorkerStub(ch))
        return self._stubs[address][1]

    def generate(self, address: str) -> GenerateClient:
        if address not in self._generate:
            self._generate[address] = GenerateClient(self.stub(address), self._generate_stream)
        return self._generate[address]

    async def close(self) -> None:
        for client in self._generate.values():
            await client.close()
        self._generate.clear()
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()
