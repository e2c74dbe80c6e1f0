"""The gateway's view of the model's workers, and its readiness: fresh and naming a worker."""

from typing import Any

import grpc

from services.gateway.catalog import ModelCatalog
from shared.protos.baton.v1 import scheduler_pb2


class Scheduler:
    """A scheduler stub that answers with one worker of model m, or fails when told to."""

    def __init__(self) -> None:
        self.down = False

    async def ListWorkers(
        self, request: Any, timeout: float, metadata: Any = ()
    ) -> scheduler_pb2.ListWorkersResponse:
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata())  # fmt: skip
        reg = scheduler_pb2.WorkerRegistration(model="m", max_model_len=512, block_size=16,
                                               vocab_size=1000)  # fmt: skip
        return scheduler_pb2.ListWorkersResponse(
            workers=[scheduler_pb2.WorkerInfo(registration=reg)]
        )


async def test_ready_only_while_the_scheduler_answers() -> None:
    scheduler, now = Scheduler(), [100.0]
    catalog = ModelCatalog({}, scheduler, refresh_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not catalog.ready("m")  # nothing heard yet
    await catalog.refresh()
    assert catalog.ready("m") and not catalog.ready("other")
    limits = await catalog.limits("m")
    assert limits is not None and limits.vocab_size == 1000
    scheduler.down = True
    now[0] += 3.1  # past three refresh periods without an answer
    await catalog.refresh()
    assert not catalog.ready("m")  # a stale list is not readiness
    scheduler.down = False
    now[0] += 1.0
    await catalog.refresh()
    assert catalog.ready("m")


async def test_readiness_asks_again_when_the_list_held_says_not_ready() -> None:
    """A list fetched while no worker had registered yet (just after a scheduler restart) does
    not keep ``/ready`` false for a refresh period: readiness fetches a fresh one."""
    scheduler, now = Scheduler(), [100.0]
    catalog = ModelCatalog({"m": None}, scheduler, refresh_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type, dict-item]
    scheduler.down = True
    await catalog.refresh()
    assert not catalog.ready("m")
    scheduler.down = False
    now[0] += 0.1  # well within one refresh period
    assert await catalog.readiness() == {"m": True}
    scheduler.down = True
    now[0] += 3.1
    assert await catalog.readiness() == {"m": False}  # stale and unanswered: not ready
