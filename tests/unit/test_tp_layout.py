"""Where a decode rank reads its KV heads from across a TP split, the byte spans of those
reads, and how the executor merges its ranks' transfer progress into the engine's."""

import numpy as np
import pytest

from services.worker.engine.executor.rank import TransferMerge, merge_infos
from services.worker.engine.kv_transfer.connector import ConnectorInfo, TransferResults
from services.worker.engine.kv_transfer.tp_layout import (
    BlockGeometry,
    HeadRun,
    global_kv_heads,
    head_runs,
    run_descriptors,
)
from services.worker.engine.models.layers.linear import QKVParallelLinear


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 8), (4, 8), (8, 8), (4, 2), (8, 2)])
def test_placement_matches_the_qkv_layers_split(tp: int, heads: int) -> None:
    """The heads a rank's cache holds are the heads its QKV layer loads (GQA replication too)."""
    from services.worker.engine.distributed import parallel_state
    from services.worker.engine.distributed.parallel_state import GroupCoordinator

    for rank in range(tp):
        with parallel_state.use_tp_group(GroupCoordinator(rank, tp)):
            layer = QKVParallelLinear(64, 4, 8, heads)
        held = global_kv_heads(rank, tp, heads)
        assert len(held) == layer.num_kv_heads
        replicas = max(1, tp // heads)
        assert held.start == (rank // replicas) * layer.num_kv_heads  # its weight_loader's start


def test_head_runs() -> None:
    assert head_runs(0, 2, 2, 8) == [HeadRun(0, 0, 0, 4)]  # alike: the whole block
    assert head_runs(1, 2, 1, 8) == [HeadRun(0, 4, 0, 4)]  # 1 → 2: half of rank 0's heads
    assert head_runs(0, 1, 2, 8) == [HeadRun(0, 0, 0, 4), HeadRun(1, 0, 4, 4)]  # 2 → 1
    assert head_runs(1, 2, 4, 8) == [HeadRun(2, 0, 0, 2), HeadRun(3, 0, 2, 2)]
    # the prefill side replicates (4 ranks, 2 heads): each head read once, from its first rank
    assert head_runs(0, 1, 4, 2) == [HeadRun(0, 0, 0, 1), HeadRun(2, 0, 1, 1)]
    # the decode side replicates: ranks 2 and 3 both read head 1
    assert head_runs(3, 4, 1, 2) == head_runs(2, 4, 1, 2) == [HeadRun(0, 1, 0, 1)]
    # both sides replicate alike (4 ranks, 2 heads): each rank reads its own peer, whose pages
    # of a recurrent state (split over every rank) are the ones it needs
    assert [head_runs(r, 4, 4, 2) for r in range(4)] == [[HeadRun(r, 0, 0, 1)] for r in range(4)]
    for d in (1, 2, 4, 8):  # every decode rank gets each of its heads exactly once
        for p in (1, 2, 4, 8):
            for r in range(d):
                runs = head_runs(r, d, p, 8)
                assert sum(run.count for run in runs) == len(global_kv_heads(r, d, 8))


def test_run_descriptors_cover_the_heads_of_every_row() -> None:
    geom = BlockGeometry(rows=3, local_heads=4, head_bytes=8)  # a block: 3 × 4 × 8 = 96 bytes
    whole = run_descriptors(1000, geom, [0, 2], 0, 4, 7)
    assert whole.tolist() == [[1000, 96, 7], [1192, 96, 7]]
    part = run_descriptors(1000, geom, [2], 1, 2, 0)
    assert part.tolist() == [[1192 + 8, 16, 0], [1224 + 8, 16, 0], [1256 + 8, 16, 0]]
    rows = run_descriptors(1000, geom, [0], 0, 4, 0, per_row=True)
    assert rows[:, 0].tolist() == [1000, 1032, 1064] and set(rows[:, 1]) == {32}
    # the spans of a sub-range, laid over a real block, pick exactly those heads
    block = np.arange(3 * 4 * 2, dtype=np.int32).reshape(3, 4, 2)  # head_bytes = 2 × 4
    spans = run_descriptors(0, BlockGeometry(3, 4, 8), [0], 1, 2, 0)
    flat = block.reshape(-1).view(np.uint8)
    got = np.concatenate([flat[a : a + n] for a, n, _ in spans]).view(np.int32)
    assert got.tolist() == block[:, 1:3].reshape(-1).tolist()


def test_a_pull_ends_when_every_rank_has_ended_it() -> None:
    merge = TransferMerge(2)
    assert merge.add({0: TransferResults(finished=["a"], failed=["b"])}) == TransferResults()
    out = merge.add({1: TransferResults(finished=["a", "b"], released=["x"])})
    assert out.finished == ["a"] and out.failed == ["b"]  # b failed on rank 0: failed
    assert out.released == []  # rank 0 still holds its part of lease x
    assert merge.add({0: TransferResults(released=["x"])}).released == ["x"]
    assert (merge.pulls, merge.failures) == (1, 1)  # requests, not rank reads
    one = TransferMerge(1)
    res = TransferResults(finished=["a"])
    assert one.add({0: res}) is res


def test_a_tp_engines_side_channel_is_its_ranks_in_order() -> None:
    info = merge_infos([
        ConnectorInfo("tcp://h:1", False, {"kv_pulls": 1, "kv_pull_seconds": 0.5}),
        ConnectorInfo("tcp://h:2", True, {"kv_pulls": 2, "kv_pull_seconds": 0.25}),
    ])  # fmt: skip
    assert info.side_channel == "tcp://h:1,tcp://h:2" and info.needs_idle_progress
    assert info.stats == {"kv_pulls": 3, "kv_pull_seconds": 0.75}  # summed without a merge
    merge = TransferMerge(2)
    merge.add({0: TransferResults(finished=["a"]), 1: TransferResults(finished=["a"])})
    infos = [ConnectorInfo("a", False, {"kv_pulls": 1, "kv_pull_failures": 0,
                                       "kv_pull_bytes": 10})] * 2  # fmt: skip
    assert merge_infos(infos, merge).stats == {"kv_pulls": 1, "kv_pull_failures": 0,
                                               "kv_pull_bytes": 20}  # fmt: skip
    assert merge_infos([ConnectorInfo("", False, {})]).side_channel == ""
