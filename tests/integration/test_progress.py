"""A worker that hangs breaks nothing on the wire: its GenerateStream stays open and sends
nothing. The gateway's progress bound (services/gateway/generate_client.py ``Progress``) ends
such a request ``Stalled`` (UNAVAILABLE: the orchestrator resumes it elsewhere) and aborts it on
the worker, over the stream and unary alike; ``abandon`` (the scheduler said the worker missed
its heartbeats) ends every request on the stream at once."""

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.gateway.call_stream import status_of
from services.gateway.generate_client import GenerateClient, GenerateFailed, Progress, Stalled
from services.gateway.worker_pool import WorkerChannels
from services.worker.engine.config import EngineArgs
from services.worker.servicer import WorkerServicer
from services.worker.settings import WorkerSettings
from shared.protos.baton.v1 import worker_pb2, worker_pb2_grpc
from shared.rpc import channel, server


class HangingWorker:
    """A worker server whose requests send ``before`` tokens, then hang until released; it
    records which requests' generators were closed (an abort reached it)."""

    def __init__(self, tiny_model: Path, before: int):
        self.tiny_model, self.before = tiny_model, before
        self.release = asyncio.Event()
        self.closed: list[str] = []

    async def generate(self, request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        try:
            for i in range(self.before):
                yield worker_pb2.GenerateResponse(
                    deltas=[worker_pb2.CompletionDelta(token_ids=[i])]
                )
            await self.release.wait()  # hung
            yield worker_pb2.GenerateResponse(
                deltas=[worker_pb2.CompletionDelta(token_ids=[99])], finished=True
            )
        finally:
            self.closed.append(request.request_id)

    async def __aenter__(self) -> "HangingWorker":
        settings = WorkerSettings(engine=EngineArgs(model=str(self.tiny_model)))
        servicer = WorkerServicer(settings, None, self.generate)  # type: ignore[arg-type]
        self.server = server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = channel(self.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.channel.close()
        await self.server.stop(0)


def request(rid: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3])


async def drain(responses: AsyncIterator[worker_pb2.GenerateResponse]) -> list[int]:
    return [t async for r in responses for d in r.deltas for t in d.token_ids]


async def until(cond, bound_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("before", [0, 3], ids=["before-first-token", "mid-stream"])
async def test_a_hung_worker_ends_the_request_stalled_within_the_bound(
    tiny_model: Path, streaming: bool, before: int
) -> None:
    async with HangingWorker(tiny_model, before) as w:
        client = GenerateClient(w.stub, streaming)
        progress = Progress(first_s=0.6, next_s=0.3)
        got: list[int] = []
        start = time.monotonic()
        with pytest.raises(Stalled) as e:
            async for r in client.generate(request("r"), 30.0, "t", progress):
                got += [t for d in r.deltas for t in d.token_ids]
        waited = time.monotonic() - start
        assert got == list(range(before))
        assert status_of(e.value)[0] == grpc.StatusCode.UNAVAILABLE  # resumable
        assert ("first token" in e.value.details) == (before == 0)
        bound = progress.first_s if before == 0 else progress.next_s
        assert bound <= waited < bound + 1.0
        await until(lambda: "r" in w.closed)  # aborted on the worker
        await client.close()


async def test_with_nowhere_else_to_go_a_silent_worker_is_waited_for(tiny_model: Path) -> None:
    """``keep_waiting`` (no other worker could take the request) turns the bound into a
    look: the request waits on and gets its tokens once the worker answers."""
    async with HangingWorker(tiny_model, 1) as w:
        client = GenerateClient(w.stub)
        looks: list[float] = []

        def keep_waiting() -> bool:
            looks.append(time.monotonic())
            if len(looks) == 3:
                w.release.set()  # the long step ends
            return True

        got = await drain(
            client.generate(request("r"), 30.0, "t", Progress(0.2, 0.2, keep_waiting))
        )
        assert got == [0, 99] and len(looks) >= 3
        # (the worker's generator ends after its last message is sent: not before the client
        # has it, so wait for it, bounded)
        await until(lambda: "r" in w.closed)
        await client.close()


async def test_progress_does_not_cut_a_slow_but_moving_stream(tiny_model: Path) -> None:
    async with HangingWorker(tiny_model, 0) as w:
        w.release.set()
        client = GenerateClient(w.stub)
        got = await drain(client.generate(request("r"), 30.0, "t", Progress(0.5, 0.5)))
        assert got == [99]
        await client.close()


async def test_the_request_deadline_still_ends_it_deadline_exceeded(tiny_model: Path) -> None:
    async with HangingWorker(tiny_model, 1) as w:
        client = GenerateClient(w.stub)
        with pytest.raises(GenerateFailed) as e:
            await drain(client.generate(request("r"), 0.4, "t", Progress(5.0, 5.0)))
        assert not isinstance(e.value, Stalled)
        assert status_of(e.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        await client.close()


async def test_a_lost_worker_ends_every_request_on_its_stream_at_once(tiny_model: Path) -> None:
    async with HangingWorker(tiny_model, 1) as w:
        workers = WorkerChannels()
        workers._stubs[w.address] = (w.channel, w.stub)  # (this server's channel)
        client = workers.generate(w.address)
        signal = workers.lost_signal(w.address)

        async def one(rid: str) -> grpc.StatusCode:
            with pytest.raises(GenerateFailed) as e:
                await drain(client.generate(request(rid), 30.0, "t", Progress(30.0, 30.0)))
            return status_of(e.value)[0]

        running = [asyncio.ensure_future(one(rid)) for rid in ("a", "b", "c")]
        await until(lambda: client.stream is not None and len(client.stream.pending) == 3)
        await asyncio.sleep(0.1)  # each got its first token and now waits
        start = time.monotonic()
        workers.lost(w.address, "missed its heartbeats")
        codes = await asyncio.wait_for(asyncio.gather(*running), 2.0)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 3  # each resumes elsewhere
        assert time.monotonic() - start < 0.5
        assert signal.is_set() and not workers.lost_signal(w.address).is_set()
        # the next request opens a new stream (a worker that comes back is usable)
        w.release.set()
        assert await drain(client.generate(request("d"), 30.0, "t", Progress(5.0, 5.0))) == [0, 99]
        await client.close()
