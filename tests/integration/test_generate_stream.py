"""Generate over the worker's long-lived GenerateStream (services/gateway/generate_client.py
against the real WorkerServicer and engine, in this process): concurrent requests share one
stream and each gets what a unary Generate gives; a refusal ends only its own request; a
caller that leaves aborts its request on the worker; deadlines hold; a broken stream ends its
requests UNAVAILABLE; a worker without the stream is called unary."""

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from baton import AsyncLLM, EngineArgs
from services.gateway.call_stream import status_of
from services.gateway.generate_client import GenerateClient, GenerateFailed
from services.worker.servicer import GenerateFn, WorkerServicer
from services.worker.settings import WorkerSettings
from shared.protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from shared.rpc import channel, server


class UnaryOnly(worker_pb2_grpc.WorkerServicer):
    """A worker from before GenerateStream."""

    def __init__(self, inner: WorkerServicer):
        self.inner = inner

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        async for response in self.inner.Generate(request, context):
            yield response


class Recording(worker_pb2_grpc.WorkerServicer):
    """The worker's GenerateStream, recording what each side sends on it."""

    def __init__(self, inner: WorkerServicer):
        self.inner = inner
        self.calls: list[str] = []  # start | abort
        self.events: list[str] = []  # response | end

    async def GenerateStream(self, calls, context):  # type: ignore[no-untyped-def]
        recording = self

        async def seen():  # type: ignore[no-untyped-def]
            async for call in calls:
                recording.calls.append(call.WhichOneof("call"))
                yield call

        class Context:
            async def write(self, event: worker_pb2.GenerateEvent) -> None:
                recording.events.append(event.WhichOneof("event"))
                await context.write(event)

        await self.inner.GenerateStream(seen(), Context())  # type: ignore[arg-type]


class Worker:
    """A worker server on a free port (engine on the tiny model) and a GenerateClient to it."""

    def __init__(self, tiny_model: Path, unary_only: bool = False, record: bool = False):
        self.tiny_model, self.unary_only, self.record = tiny_model, unary_only, record

    async def __aenter__(self) -> "Worker":
        args = EngineArgs(model=str(self.tiny_model), max_model_len=512, num_kv_blocks=256)
        self.engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self.servicer = WorkerServicer(WorkerSettings(engine=args), self.engine)
        impl: worker_pb2_grpc.WorkerServicer = self.servicer
        if self.unary_only:
            impl = UnaryOnly(self.servicer)
        elif self.record:
            impl = self.recording = Recording(self.servicer)
        self.server = server()
        worker_pb2_grpc.add_WorkerServicer_to_server(impl, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = channel(f"127.0.0.1:{port}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.client = GenerateClient(self.stub)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.channel.close()
        await self.server.stop(0)
        self.engine.shutdown()


def request(
    i: int, max_tokens: int = 8, prompt: list[int] | None = None
) -> worker_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1, ignore_eos=True)
    return worker_pb2.GenerateRequest(
        request_id=f"r{i}", prompt_token_ids=prompt or [5 + i, 6, 7, 8], params=params
    )


async def tokens(responses: AsyncIterator[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for r in [r async for r in responses] for d in r.deltas for t in d.token_ids]


def calls(transport: str) -> float:
    value = REGISTRY.get_sample_value(
        "baton_gateway_generate_calls_total", {"transport": transport}
    )
    return value or 0.0  # (not exported before its first call)


def without_engine(tiny_model: Path, generate: GenerateFn) -> WorkerServicer:
    """A servicer whose requests answer what ``generate`` yields: the transport alone."""
    settings = WorkerSettings(engine=EngineArgs(model=str(tiny_model)))
    return WorkerServicer(settings, None, generate)  # type: ignore[arg-type]


async def test_concurrent_requests_share_the_stream_and_equal_unary(tiny_model: Path) -> None:
    async with Worker(tiny_model) as w:
        before = calls("stream")
        streamed = await asyncio.gather(
            *(tokens(w.client.generate(request(i), 30.0, f"t{i}")) for i in range(6))
        )
        assert calls("stream") - before == 6
        unary = [await tokens(w.stub.Generate(request(i), timeout=30)) for i in range(6)]
        assert streamed == unary and all(len(t) == 8 for t in streamed)


async def test_a_refusal_ends_only_its_own_request(tiny_model: Path) -> None:
    async with Worker(tiny_model) as w:
        bad = request(1, prompt=[10**6])  # outside the vocabulary

        async def refused() -> grpc.StatusCode:
            with pytest.raises(GenerateFailed) as e:
                await tokens(w.client.generate(bad, 30.0, "t"))
            return status_of(e.value)[0]

        code, good = await asyncio.gather(
            refused(), tokens(w.client.generate(request(2), 30.0, "t"))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(good) == 8


async def test_leaving_early_aborts_on_the_worker_and_deadlines_hold(tiny_model: Path) -> None:
    async with Worker(tiny_model) as w:
        responses = w.client.generate(request(1, max_tokens=400), 30.0, "t")
        await anext(responses)
        await responses.aclose()  # what the orchestrator does when its client leaves
        for _ in range(100):
            if (await w.engine.get_stats()).num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert (await w.engine.get_stats()).num_running == 0
        with pytest.raises(GenerateFailed) as e:
            await tokens(w.client.generate(request(2, max_tokens=400), 0.05, "t"))
        assert status_of(e.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(await tokens(w.client.generate(request(3), 30.0, "t"))) == 8  # stream lives


async def test_a_broken_stream_ends_its_requests_unavailable(tiny_model: Path) -> None:
    async with Worker(tiny_model) as w:
        responses = w.client.generate(request(1, max_tokens=400), 30.0, "t")
        await anext(responses)
        await w.server.stop(0)
        with pytest.raises(GenerateFailed) as e:
            async for _ in responses:
                pass
        assert status_of(e.value)[0] == grpc.StatusCode.UNAVAILABLE


async def test_a_worker_without_the_stream_is_called_unary(tiny_model: Path) -> None:
    async with Worker(tiny_model, unary_only=True) as w:
        before = calls("unary")
        first = await tokens(w.client.generate(request(1), 30.0, "t"))
        second = await tokens(w.client.generate(request(2), 30.0, "t"))
        assert len(first) == len(second) == 8
        assert calls("unary") - before == 2  # the first after UNIMPLEMENTED, then directly


class OneWriteAtATime:
    """A servicer context whose writes behave as gRPC's: one outstanding write per call (a
    second one started meanwhile fails, as GRPC_CALL_ERROR_TOO_MANY_OPERATIONS does), and a
    write once started completes even when the task awaiting it is cancelled."""

    def __init__(self) -> None:
        self.busy = False
        self.events: list[worker_pb2.GenerateEvent] = []

    async def write(self, event: worker_pb2.GenerateEvent) -> None:
        if self.busy:
            raise RuntimeError("too many operations: a write is still in flight")
        self.busy = True
        await asyncio.shield(asyncio.ensure_future(self._complete(event)))

    async def _complete(self, event: worker_pb2.GenerateEvent) -> None:
        await asyncio.sleep(0.002)
        self.events.append(event)
        self.busy = False


async def test_an_abort_during_a_write_leaves_the_stream_whole(tiny_model: Path) -> None:
    """An abort cancels its request's task, maybe while that task's write is in flight; the
    other requests on the stream must still get every event and their end (the write after a
    cancelled one used to start too early, fail, and leave its request waiting forever)."""

    async def generate(request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        for i in range(40):
            yield worker_pb2.GenerateResponse(deltas=[worker_pb2.CompletionDelta(token_ids=[i])])
            await asyncio.sleep(0)

    servicer = without_engine(tiny_model, generate)
    context = OneWriteAtATime()
    inbox: asyncio.Queue[worker_pb2.GenerateCall | None] = asyncio.Queue()

    async def calls() -> AsyncIterator[worker_pb2.GenerateCall]:
        while (call := await inbox.get()) is not None:
            yield call

    handler = asyncio.ensure_future(servicer.GenerateStream(calls(), context))  # type: ignore[arg-type]
    for rid in ("a", "b", "c"):
        await inbox.put(worker_pb2.GenerateCall(start=worker_pb2.GenerateRequest(request_id=rid)))
    for _ in range(10):  # abort "a" then "c" at different points of their writes
        await asyncio.sleep(0.001)
    await inbox.put(worker_pb2.GenerateCall(abort="a"))
    await asyncio.sleep(0.005)
    await inbox.put(worker_pb2.GenerateCall(abort="c"))
    await inbox.put(None)  # the gateway closes its side: the stream ends after "b"
    await asyncio.wait_for(handler, 10)
    got = [e for e in context.events if e.request_id == "b"]
    assert [e.response.deltas[0].token_ids[0] for e in got[:-1]] == list(range(40))
    assert got[-1].HasField("end") and got[-1].end.code == 0
    assert not any(e.HasField("end") for e in context.events if e.request_id in ("a", "c"))


class SlowWrite(OneWriteAtATime):
    """One request's third event takes 0.5 s to write; ``slow`` is set while it is in flight."""

    def __init__(self, rid: str) -> None:
        super().__init__()
        self.rid, self.seen, self.slow = rid, 0, asyncio.Event()

    async def _complete(self, event: worker_pb2.GenerateEvent) -> None:
        if event.request_id == self.rid:
            self.seen += 1
            if self.seen == 3:
                self.slow.set()
                await asyncio.sleep(0.5)
        await super()._complete(event)


@pytest.mark.parametrize("stop", ["deadline", "abort"])
async def test_a_stop_during_a_write_waits_for_it_and_spares_the_others(
    tiny_model: Path, stop: str
) -> None:
    """A request stopped while one of its events is being written (its deadline passes, or
    the gateway aborts it) ends once that write is done; the stream's other requests get
    everything. Cancelling the request's task mid-write instead would let the next write
    start while gRPC still has this one in flight: it fails, and so does its request."""
    stopped: list[str] = []

    async def generate(request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        try:
            for i in range(30):
                yield worker_pb2.GenerateResponse(
                    deltas=[worker_pb2.CompletionDelta(token_ids=[i])]
                )
        finally:  # the engine's abort
            stopped.append(request.request_id)

    servicer = without_engine(tiny_model, generate)
    context = SlowWrite("x")

    async def calls() -> AsyncIterator[worker_pb2.GenerateCall]:
        for rid in ("a", "x", "c"):
            # x's third write starts within ~15 ms (2 ms a write) and lasts 0.5 s
            timeout = 0.25 if (rid == "x" and stop == "deadline") else 0.0
            start = worker_pb2.GenerateRequest(request_id=rid)
            yield worker_pb2.GenerateCall(start=start, timeout_s=timeout)
        if stop == "abort":
            await context.slow.wait()
            yield worker_pb2.GenerateCall(abort="x")

    await asyncio.wait_for(servicer.GenerateStream(calls(), context), 10)  # type: ignore[arg-type]
    assert context.slow.is_set()
    for rid in ("a", "c"):
        got = [e for e in context.events if e.request_id == rid]
        assert [e.response.deltas[0].token_ids[0] for e in got[:-1]] == list(range(30))
        assert got[-1].HasField("end") and got[-1].end.code == 0
    x = [e for e in context.events if e.request_id == "x"]
    assert [e.response.deltas[0].token_ids[0] for e in x if e.HasField("response")] == [0, 1, 2]
    if stop == "deadline":
        assert x[-1].end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    else:
        assert not x[-1].HasField("end")  # an aborted request owes nobody an end
    assert sorted(stopped) == ["a", "c", "x"]  # every generator closed, x's early


async def test_a_deadline_during_the_last_write_leaves_a_finished_request_finished(
    tiny_model: Path,
) -> None:
    """Its finished response is on the wire when the deadline passes: the request ended well,
    and no DEADLINE_EXCEEDED end may follow it."""

    async def generate(request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        for i in range(3):
            delta = worker_pb2.CompletionDelta(token_ids=[i])
            yield worker_pb2.GenerateResponse(deltas=[delta], finished=i == 2)

    servicer = without_engine(tiny_model, generate)
    context = SlowWrite("x")  # the third, finished response takes 0.5 s to write

    async def calls() -> AsyncIterator[worker_pb2.GenerateCall]:
        start = worker_pb2.GenerateRequest(request_id="x")
        yield worker_pb2.GenerateCall(start=start, timeout_s=0.25)

    await asyncio.wait_for(servicer.GenerateStream(calls(), context), 10)  # type: ignore[arg-type]
    assert context.slow.is_set()
    assert [e.WhichOneof("event") for e in context.events] == ["response"] * 3
    assert context.events[-1].response.finished


async def test_an_abort_right_behind_its_start_ends_the_stream(tiny_model: Path) -> None:
    """An abort read before its request's task first ran cancels that task before it starts;
    the stream must still forget the request and end when the gateway closes its side."""
    started: list[str] = []

    async def generate(request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        started.append(request.request_id)
        yield worker_pb2.GenerateResponse(deltas=[worker_pb2.CompletionDelta(token_ids=[1])])

    servicer = without_engine(tiny_model, generate)
    context = OneWriteAtATime()

    async def calls() -> AsyncIterator[worker_pb2.GenerateCall]:
        yield worker_pb2.GenerateCall(start=worker_pb2.GenerateRequest(request_id="y"))
        yield worker_pb2.GenerateCall(abort="y")  # no await between: the task has not run
        yield worker_pb2.GenerateCall(start=worker_pb2.GenerateRequest(request_id="z"))

    await asyncio.wait_for(servicer.GenerateStream(calls(), context), 10)  # type: ignore[arg-type]
    assert started == ["z"]  # "y" never ran
    assert [(e.request_id, e.WhichOneof("event")) for e in context.events] == [
        ("z", "response"), ("z", "end"),
    ]  # fmt: skip


async def test_a_request_the_engine_fails_ends_with_internal_not_silence(tiny_model: Path) -> None:

    async def generate(request: worker_pb2.GenerateRequest):  # type: ignore[no-untyped-def]
        yield worker_pb2.GenerateResponse(deltas=[worker_pb2.CompletionDelta(token_ids=[1])])
        raise RuntimeError("engine core died")

    servicer = without_engine(tiny_model, generate)
    context = OneWriteAtATime()

    async def calls() -> AsyncIterator[worker_pb2.GenerateCall]:
        yield worker_pb2.GenerateCall(start=worker_pb2.GenerateRequest(request_id="x"))

    await asyncio.wait_for(servicer.GenerateStream(calls(), context), 10)  # type: ignore[arg-type]
    assert [e.WhichOneof("event") for e in context.events] == ["response", "end"]
    end = context.events[-1].end
    assert end.code == grpc.StatusCode.INTERNAL.value[0] and "engine core died" in end.message


async def test_a_finished_request_costs_one_message_each_way(tiny_model: Path) -> None:
    """Each message on the stream costs the gateway's event loop and holds the stream's one
    writer: a request that finishes is started, and answered with its responses, the last one
    finished; no CallEnd follows, and the gateway, which stops reading at the finished response
    as the orchestrator does, sends no abort."""
    async with Worker(tiny_model, record=True) as w:

        async def until_finished(i: int) -> int:
            n = 0
            async for response in w.client.generate(request(i, max_tokens=3), 30.0, "t"):
                n += sum(len(d.token_ids) for d in response.deltas)
                if response.finished:
                    break  # as the orchestrator returns at a finish reason
            return n

        assert await asyncio.gather(*(until_finished(i) for i in range(5))) == [3] * 5
        await asyncio.sleep(0.2)  # anything still on its way arrives
        assert w.recording.calls == ["start"] * 5
        assert "end" not in w.recording.events and w.recording.events.count("response") >= 5


async def test_a_new_prefill_peer_is_asked_about_before_a_handle_is_refused(
    tiny_model: Path,
) -> None:
    """A prefill worker the scheduler has just registered can route its first handle to a
    decode worker whose heartbeat has not brought the news yet: the decode worker asks (its
    heartbeats go at once) and reads once an update names the peer; a peer no update names
    within the bound (4 heartbeat intervals) is refused."""
    settings = WorkerSettings(engine=EngineArgs(model=str(tiny_model)), heartbeat_interval_s=0.05,
                              scheduler_addresses=("127.0.0.1:1",))  # fmt: skip
    servicer = WorkerServicer(settings, None)  # type: ignore[arg-type]
    asked = []

    def ask() -> None:
        asked.append(time.monotonic())
        if len(asked) == 1:  # the scheduler answers the first ask, a little later
            asyncio.get_running_loop().call_later(
                0.02, servicer.set_kv_peers, "127.0.0.1:1", frozenset({"tcp://new:1"})
            )

    servicer.ask_for_kv_peers = ask
    start = time.monotonic()
    assert await servicer.kv_refusal("tcp://new:1") is None
    assert len(asked) == 1 and time.monotonic() - start < 0.15
    start = time.monotonic()
    why = await servicer.kv_refusal("tcp://never-registered:1")
    assert why is not None and "is not a prefill worker the scheduler has registered" in why
    assert 0.19 <= time.monotonic() - start < 1.0  # refused at the bound, not before
