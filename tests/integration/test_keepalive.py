"""Every internal channel pings its peer (shared/rpc.py): a peer that stops answering (stopped,
hung, on a host whose TCP connection never closes) fails the calls open on it within the
keepalive bound, though nothing closed the connection. Here: a RouteStream open to a global
scheduler that is then stopped (SIGSTOP) ends UNAVAILABLE within ~8 s (a ping after 5 s of
quiet, unanswered for 3 s)."""

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from shared import rpc
from shared.internal_auth import Security
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import service_group

BOUND_S = 5.0 + 3.0  # keepalive_time + keepalive_timeout


@pytest.mark.slow
async def test_a_stopped_peer_fails_the_open_stream_within_the_keepalive_bound(
    tiny_model: Path,
) -> None:
    group = service_group(tiny_model)
    before = rpc.security()
    rpc.configure(Security.load())
    try:
        ready = group.spawn("scheduler", ["global-scheduler", "--port", "0"], ready=True)
        address = group.wait_ready("scheduler", ready, 30)["address"]
        async with rpc.channel(address) as ch:
            call = scheduler_pb2_grpc.GlobalSchedulerStub(ch).RouteStream(metadata=rpc.auth())
            route = scheduler_pb2.RouteRequest(request_id="r", model="m")
            await call.write(scheduler_pb2.RouteCall(call_id=1, request=route))
            first = await asyncio.wait_for(call.read(), 10)  # the stream works: no worker
            assert first.call_id == 1 and first.HasField("failure")
            group.procs["scheduler"].send_signal(signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await asyncio.wait_for(call.read(), BOUND_S + 10)
                took = time.monotonic() - start
            finally:
                group.procs["scheduler"].send_signal(signal.SIGCONT)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert took < BOUND_S + 2.0, f"the stopped peer was noticed after {took:.1f} s"
    finally:
        rpc.configure(before)
        group.stop()
