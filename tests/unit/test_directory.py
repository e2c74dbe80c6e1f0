"""The prefix directory contract, run against every backend (the in-memory one today)."""

from collections.abc import Callable

import pytest

from services.global_scheduler.directory import InMemoryDirectory, PrefixDirectory
from shared.block_hash import hash_blocks
from shared.ids import WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

H = hash_blocks(list(range(16 * 6)), 16)  # six chained block hashes
W1, W2 = WorkerId("w1"), WorkerId("w2")

BACKENDS: dict[str, Callable[[], PrefixDirectory]] = {"memory": InMemoryDirectory}


@pytest.fixture(params=sorted(BACKENDS))
def directory(request: pytest.FixtureRequest) -> PrefixDirectory:
    return BACKENDS[request.param]()


def stored(seq: int, hashes: list, parent: bytes | None = None) -> KVEventBatch:
    return KVEventBatch(seq, [BlockStored(hashes, parent, 16)])  # type: ignore[arg-type]


async def test_longest_prefix_counts_leading_blocks_per_worker(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W2, "a", stored(1, H[:2]))
    assert await directory.longest_prefix(H, [W1, W2]) == {W1: 4, W2: 2}
    other = hash_blocks(list(range(1, 16 * 3 + 1)), 16)  # a prompt that differs in block 0
    assert await directory.longest_prefix(other, [W1]) == {W1: 0}


async def test_a_hole_ends_the_prefix(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:4]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[1]])]))
    assert await directory.longest_prefix(H, [W1]) == {W1: 1}


async def test_only_asked_workers_are_answered(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    assert await directory.longest_prefix(H, [W2]) == {W2: 0}
    assert await directory.longest_prefix([], [W1]) == {W1: 0}


async def test_forget_and_all_cleared(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:3]))
    await directory.apply(W2, "a", stored(1, H[:3]))
    await directory.forget(W1)
    assert await directory.longest_prefix(H, [W1, W2]) == {W1: 0, W2: 3}
    await directory.apply(W2, "a", KVEventBatch(2, [AllBlocksCleared()]))
    assert await directory.longest_prefix(H, [W2]) == {W2: 0}
    assert await directory.num_blocks(W2) == 0


async def test_resync_replays_to_the_exact_state(directory: PrefixDirectory) -> None:
    """A worker's re-announcement (cleared, then everything it holds) after stale events."""
    await directory.apply(W1, "a", stored(1, H[:5]))
    await directory.apply(W1, "a", KVEventBatch(2, [AllBlocksCleared(), *stored(2, H[:2]).events]))
    assert await directory.longest_prefix(H, [W1]) == {W1: 2}
    assert await directory.num_blocks(W1) == 2


async def test_restarted_worker_drops_the_old_incarnations_blocks(
    directory: PrefixDirectory,
) -> None:
    await directory.apply(W1, "old", stored(5, H[:4]))
    await directory.apply(W1, "new", stored(1, H[:1]))  # seq restarts with the incarnation
    assert await directory.longest_prefix(H, [W1]) == {W1: 1}


async def test_replayed_batches_are_ignored(directory: PrefixDirectory) -> None:
    await directory.apply(W1, "a", stored(1, H[:2]))
    await directory.apply(W1, "a", KVEventBatch(2, [BlockRemoved([H[0]])]))
    await directory.apply(W1, "a", stored(1, H[:2]))  # a duplicate of seq 1
    assert await directory.longest_prefix(H, [W1]) == {W1: 0}


async def test_many_workers_updating_concurrently(directory: PrefixDirectory) -> None:
    import asyncio

    workers = [WorkerId(f"w{i}") for i in range(8)]

    async def feed(i: int, w: WorkerId) -> None:
        for seq in range(1, i + 2):
            await directory.apply(w, "a", stored(seq, H[seq - 1 : seq]))
            await asyncio.sleep(0)

    await asyncio.gather(*(feed(i % 6, w) for i, w in enumerate(workers)))
    got = await directory.longest_prefix(H, workers)
    assert got == {w: (i % 6) + 1 for i, w in enumerate(workers)}
