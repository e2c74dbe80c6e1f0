"""Redis going away: the directory answers at once (no hang), routing falls back to load, the
degraded metric says so, and recovery asks the workers to resync."""

import time

from prometheus_client import REGISTRY

from services.global_scheduler.directory import DirectoryUnavailable, create_directory
from services.global_scheduler.resilient import ResilientDirectory
from shared.block_hash import hash_blocks
from shared.ids import WorkerId
from shared.kv_events import BlockStored, KVEventBatch
from tests.helpers import held
from tests.redis_server import RedisServer

H = hash_blocks(list(range(64)), 16)
W = WorkerId("w")


def degraded_metric() -> float | None:
    return REGISTRY.get_sample_value("baton_scheduler_directory_degraded")


async def test_unreachable_redis_fails_fast_with_a_typed_error() -> None:
    d = create_directory("redis", url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    start = time.monotonic()
    try:
        held(await d.longest_prefix(H, {W: "a"}))
    except DirectoryUnavailable:
        pass
    else:
        raise AssertionError("expected DirectoryUnavailable")
    finally:
        await d.close()
    assert time.monotonic() - start < 1.0


async def test_degrade_route_on_load_then_recover_and_resync() -> None:
    server = RedisServer.start()
    resyncs: list[int] = []
    d = ResilientDirectory(create_directory("redis", url=server.url), probe_interval_s=0.05)
    d.on_recover = lambda: resyncs.append(1)
    try:
        await d.apply(W, "a", KVEventBatch(1, [BlockStored(H, None, 16)]))
        assert held(await d.longest_prefix(H, {W: "a"})) == {W: 4}
        server.kill()
        assert held(await d.longest_prefix(H, {W: "a"})) == {W: 0}  # no error: load alone decides
        assert d.degraded and degraded_metric() == 1
        await d.apply(W, "a", KVEventBatch(2, [BlockStored(H, None, 16)]))  # dropped, no error
        server.restart()
        import asyncio

        probe = asyncio.ensure_future(d.probe_forever())
        for _ in range(100):
            if not d.degraded:
                break
            await asyncio.sleep(0.02)
        probe.cancel()
        assert not d.degraded and degraded_metric() == 0 and resyncs == [1]
    finally:
        await d.close()
        server.stop()
