"""The prefix directory contract, run against every backend: in memory, and a real Redis."""

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from services.global_scheduler.directory import Match, PrefixDirectory, create_directory
from shared.block_hash import hash_blocks
from shared.ids import WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.helpers import Clock, held

H = hash_blocks(list(range(16 * 6)), 16)  # six chained block hashes
W1, W2 = WorkerId("w1"), WorkerId("w2")

LIVE = {W1: "a", W2: "a"}


@pytest.fixture
def clock() -> Clock:
    """A clock the test moves: pending entries expire by it, not by real time."""
    return Clock(time.time())


@pytest.fixture(params=["memory", "redis"])
async def directory(request: pytest.FixtureRequest, clock: Clock) -> AsyncIterator[PrefixDirectory]:
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        # the semantics here, not the 0.25 s bound a route puts on a Redis call (the e2e test
        # that kills Redis under load): on a loaded 2-core machine, 8 concurrent first
        # connections once took longer than that (make test, 2026-12-03)
        d = create_directory("redis", url=url, prefix=f"test-{uuid.uuid4().hex[:8]}:", clock=clock,
                             timeout_s=5.0)  # fmt: skip
    else:
        d = create_directory("memory", clock=clock)
    yield d
    await d.close()


def stored(seq: int, hashes: list, parent: bytes | None = None) -> KVEventBatch:
    return KVEventBatch(seq, [BlockStored(hashes, parent, 16)])  # type: ignore[arg-type]


async def test_longest_prefix_counts_leading_blocks_per_worker(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W2, "a", stored(1, H[:2]))
    assert held(await directory.longest_prefix(H, LIVE)) == {W1: 4, W2: 2}
    other = hash_blocks(list(range(1, 16 * 3 + 1)), 16)  # a prompt that differs in block 0
    assert held(await directory.longest_prefix(other, {W1: "a"})) == {W1: 0}


async def test_a_hole_ends_the_prefix(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[1]])]))
    assert held(await directory.longest_prefix(H, {W1: "a"})) == {W1: 1}


async def test_only_asked_workers_are_answered(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    assert held(await directory.longest_prefix(H, {W2: "a"})) == {W2: 0}
    assert held(await directory.longest_prefix([], {W1: "a"})) == {W1: 0}


async def test_forget_and_all_cleared(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    await directory.apply(W2, "a", stored(1, H[:3]))
    await directory.forget(W1, "a")
    assert held(await directory.longest_prefix(H, LIVE)) == {W1: 0, W2: 3}
    await directory.apply(W2, "a", KVEventBatch(2, [AllBlocksCleared()]))
    assert held(await directory.longest_prefix(H, {W2: "a"})) == {W2: 0}
    assert await directory.num_blocks(W2, "a") == 0


async def test_resync_replays_to_the_exact_state(directory: PrefixDirectory) -> None:
    """A worker's re-announcement (cleared, then everything it holds) after stale events."""
    await directory.apply(W1, "a", stored(1, H[:5]))
    await directory.apply(W1, "a", KVEventBatch(2, [AllBlocksCleared(), *stored(2, H[:2]).events]))
    assert held(await directory.longest_prefix(H, {W1: "a"})) == {W1: 2}
    assert await directory.num_blocks(W1, "a") == 2


async def test_stale_entries_of_a_restarted_worker_never_count(
    directory: PrefixDirectory,
) -> None:
    await directory.apply(W1, "old", stored(5, H[:4]))
    await directory.apply(W1, "new", stored(1, H[:1]))  # seq restarts with the incarnation
    assert held(await directory.longest_prefix(H, {W1: "new"})) == {
        W1: 1
    }  # at once, before a purge
    assert await directory.num_blocks(W1, "old") == 4
    await directory.forget(W1, "old")  # the lazy purge
    assert await directory.num_blocks(W1, "old") == 0
    assert held(await directory.longest_prefix(H, {W1: "new"})) == {W1: 1}
    assert held(await directory.longest_prefix(H, {W1: "old"})) == {W1: 0}


async def test_replayed_batches_are_ignored(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:2]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[0]])]))
    await directory.apply(W1, "a", stored(1, H[:2]))  # a duplicate of seq 1
    assert held(await directory.longest_prefix(H, {W1: "a"})) == {W1: 0}


async def test_many_workers_updating_concurrently(directory: PrefixDirectory) -> None:
    import asyncio

    workers = [WorkerId(f"w{i}") for i in range(8)]

    async def feed(i: int, w: WorkerId) -> None:
        for seq in range(1, i + 2):
            await directory.apply(w, "a", stored(seq, H[seq - 1 : seq]))
            await asyncio.sleep(0)

    await asyncio.gather(*(feed(i % 6, w) for i, w in enumerate(workers)))
    got = held(await directory.longest_prefix(H, dict.fromkeys(workers, "a")))
    assert got == {w: (i % 6) + 1 for i, w in enumerate(workers)}


# ---- pending entries: a route's blocks, expected on a worker before its events confirm them


async def test_pending_counts_until_confirmed(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:2]))
    await directory.record_pending([(W1, "a")], H[:5], ttl_s=10)
    assert await directory.longest_prefix(H, LIVE) == {W1: Match(2, 3), W2: Match(0, 0)}
    await directory.apply(W1, "a", stored(2, H[2:4]))  # the engine stored two of them
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: Match(4, 1)}
    await directory.apply(W1, "a", stored(3, H[4:5]))
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: Match(5, 0)}


async def test_pending_expires_without_confirmation(
    directory: PrefixDirectory, clock: Clock
) -> None:
    await directory.record_pending([(W1, "a"), (W2, "a")], H[:3], ttl_s=2)
    assert await directory.longest_prefix(H, LIVE) == {W1: Match(0, 3), W2: Match(0, 3)}
    clock.now += 1.9
    assert (await directory.longest_prefix(H, {W1: "a"}))[W1] == Match(0, 3)
    clock.now += 0.2
    assert held(await directory.longest_prefix(H, LIVE)) == {W1: 0, W2: 0}


async def test_recording_again_extends_the_expiry(directory: PrefixDirectory, clock: Clock) -> None:
    await directory.record_pending([(W1, "a")], H[:3], ttl_s=2)
    clock.now += 1.5
    await directory.record_pending([(W1, "a")], H[:2], ttl_s=2)
    clock.now += 1.0  # the first recording's expiry has passed, the second's has not
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: Match(0, 2)}


async def test_removed_or_cleared_blocks_drop_their_pending_entries(
    directory: PrefixDirectory,
) -> None:
    await directory.record_pending([(W1, "a"), (W2, "a")], H[:4], ttl_s=10)
    await directory.apply(W1, "a", KVEventBatch(1, [BlockRemoved([H[1]])]))  # evicted at once
    await directory.apply(W2, "a", KVEventBatch(1, [AllBlocksCleared()]))
    assert await directory.longest_prefix(H, LIVE) == {W1: Match(0, 1), W2: Match(0, 0)}


async def test_pending_of_a_dead_or_restarted_worker_never_counts(
    directory: PrefixDirectory,
) -> None:
    await directory.record_pending([(W1, "old"), (W2, "a")], H[:3], ttl_s=10)
    assert held(await directory.longest_prefix(H, {W1: "new"})) == {W1: 0}  # another process
    await directory.forget(W2, "a")  # the worker died: its pending entries go with it
    assert held(await directory.longest_prefix(H, {W2: "a"})) == {W2: 0}
    await directory.record_pending([(W1, "new")], H[:1], ttl_s=10)
    assert await directory.longest_prefix(H, {W1: "new"}) == {W1: Match(0, 1)}


async def test_a_pending_prefix_ends_where_a_worker_neither_holds_nor_expects(
    directory: PrefixDirectory,
) -> None:
    await directory.apply(W1, "a", stored(1, [H[0], H[2]]))
    await directory.record_pending([(W1, "a")], [H[1]], ttl_s=10)
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: Match(1, 2)}  # 0 ■, 1 ·, 2 ■


async def test_two_replicas_routing_one_prefix_at_once_both_count(
    request: pytest.FixtureRequest, clock: Clock
) -> None:
    """Two scheduler replicas on one Redis look the prefix up before either records its
    route, then send it to two workers: the directory names both, neither record erases the
    other, and it never names none."""
    url = request.getfixturevalue("redis_server").url
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    a = create_directory("redis", url=url, prefix=prefix, clock=clock)
    b = create_directory("redis", url=url, prefix=prefix, clock=clock)
    try:
        seen = [await d.longest_prefix(H, LIVE) for d in (a, b)]
        assert seen[0] == seen[1] == {W1: Match(), W2: Match()}
        await a.record_pending([(W1, "a")], H[:4], ttl_s=10)
        await b.record_pending([(W2, "a")], H[:4], ttl_s=10)
        for d in (a, b):
            assert await d.longest_prefix(H, LIVE) == {W1: Match(0, 4), W2: Match(0, 4)}
        await a.apply(W1, "a", stored(1, H[:4]))  # one replica applies W1's confirmation
        assert await b.longest_prefix(H, LIVE) == {W1: Match(4, 0), W2: Match(0, 4)}
    finally:
        await a.close()
        await b.close()


async def test_redis_back_after_an_outage_fails_no_call() -> None:
    """Connections pooled before Redis went away are stale when it is back: the first call on
    each is retried once on a fresh connection instead of failing (and degrading routing)."""
    from tests.redis_server import RedisServer

    redis = RedisServer.start()
    d = create_directory("redis", url=redis.url)
    try:
        for i in range(4):  # a few pooled connections, all used
            await d.apply(W1, "a", stored(i + 1, H[:2]))
            await d.longest_prefix(H, LIVE)
        redis.kill()
        redis.restart()  # empty, as after a crash
        await d.apply(W1, "b", stored(1, H[:3]))  # no DirectoryUnavailable
        assert held(await d.longest_prefix(H, {W1: "b"})) == {W1: 3}
        await d.ping()
    finally:
        await d.close()
        redis.stop()
