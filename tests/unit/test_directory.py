"""The prefix directory contract, run against every backend: in memory, and a real Redis."""

import uuid
from collections.abc import AsyncIterator

import pytest

from services.global_scheduler.directory import PrefixDirectory, create_directory
from shared.block_hash import hash_blocks
from shared.ids import WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

H = hash_blocks(list(range(16 * 6)), 16)  # six chained block hashes
W1, W2 = WorkerId("w1"), WorkerId("w2")

LIVE = {W1: "a", W2: "a"}


@pytest.fixture(params=["memory", "redis"])
async def directory(request: pytest.FixtureRequest) -> AsyncIterator[PrefixDirectory]:
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        d = create_directory("redis", url=url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    else:
        d = create_directory("memory")
    yield d
    await d.close()


def stored(seq: int, hashes: list, parent: bytes | None = None) -> KVEventBatch:
    return KVEventBatch(seq, [BlockStored(hashes, parent, 16)])  # type: ignore[arg-type]


async def test_longest_prefix_counts_leading_blocks_per_worker(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W2, "a", stored(1, H[:2]))
    assert await directory.longest_prefix(H, LIVE) == {W1: 4, W2: 2}
    other = hash_blocks(list(range(1, 16 * 3 + 1)), 16)  # a prompt that differs in block 0
    assert await directory.longest_prefix(other, {W1: "a"}) == {W1: 0}


async def test_a_hole_ends_the_prefix(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[1]])]))
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: 1}


async def test_only_asked_workers_are_answered(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    assert await directory.longest_prefix(H, {W2: "a"}) == {W2: 0}
    assert await directory.longest_prefix([], {W1: "a"}) == {W1: 0}


async def test_forget_and_all_cleared(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    await directory.apply(W2, "a", stored(1, H[:3]))
    await directory.forget(W1, "a")
    assert await directory.longest_prefix(H, LIVE) == {W1: 0, W2: 3}
    await directory.apply(W2, "a", KVEventBatch(2, [AllBlocksCleared()]))
    assert await directory.longest_prefix(H, {W2: "a"}) == {W2: 0}
    assert await directory.num_blocks(W2, "a") == 0


async def test_resync_replays_to_the_exact_state(directory: PrefixDirectory) -> None:
    """A worker's re-announcement (cleared, then everything it holds) after stale events."""
    await directory.apply(W1, "a", stored(1, H[:5]))
    await directory.apply(W1, "a", KVEventBatch(2, [AllBlocksCleared(), *stored(2, H[:2]).events]))
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: 2}
    assert await directory.num_blocks(W1, "a") == 2


async def test_stale_entries_of_a_restarted_worker_never_count(
    directory: PrefixDirectory,
) -> None:
    await directory.apply(W1, "old", stored(5, H[:4]))
    await directory.apply(W1, "new", stored(1, H[:1]))  # seq restarts with the incarnation
    assert await directory.longest_prefix(H, {W1: "new"}) == {W1: 1}  # at once, before a purge
    assert await directory.num_blocks(W1, "old") == 4
    await directory.forget(W1, "old")  # the lazy purge
    assert await directory.num_blocks(W1, "old") == 0
    assert await directory.longest_prefix(H, {W1: "new"}) == {W1: 1}
    assert await directory.longest_prefix(H, {W1: "old"}) == {W1: 0}


async def test_replayed_batches_are_ignored(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:2]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[0]])]))
    await directory.apply(W1, "a", stored(1, H[:2]))  # a duplicate of seq 1
    assert await directory.longest_prefix(H, {W1: "a"}) == {W1: 0}


async def test_many_workers_updating_concurrently(directory: PrefixDirectory) -> None:
    import asyncio

    workers = [WorkerId(f"w{i}") for i in range(8)]

    async def feed(i: int, w: WorkerId) -> None:
        for seq in range(1, i + 2):
            await directory.apply(w, "a", stored(seq, H[seq - 1 : seq]))
            await asyncio.sleep(0)

    await asyncio.gather(*(feed(i % 6, w) for i, w in enumerate(workers)))
    got = await directory.longest_prefix(H, dict.fromkeys(workers, "a"))
    assert got == {w: (i % 6) + 1 for i, w in enumerate(workers)}
