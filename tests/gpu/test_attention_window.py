"""Sliding-window attention and sinks on the GPU: the Triton (and FlashAttention) backends
against the torch reference (itself checked against an explicit float64 oracle and Hugging
Face's definitions in tests/unit/test_attention_window.py) at real head dims and windows
(gpt-oss's 128 with sinks, Gemma 3's 512 and 1024, and one long enough for decode to split),
in float32, float16 and bfloat16 (FlashAttention-4 takes the 16-bit prefill rows); a windowed
decode captured in a CUDA graph and replayed at other contexts. (That the keys before the
window cost nothing is a benchmark's to show, not a timed test's.)"""

import pytest
import torch

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.flash_attn_backend import available as flash_attn_available
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BS = 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def metadata(rows: list[tuple[int, int]], tables: torch.Tensor) -> AttentionMetadata:
    """rows: (cached, new) per request, decode rows last; ``tables`` [reqs, width] on the GPU."""
    qsl = [0]
    for _, new in rows:
        qsl.append(qsl[-1] + new)
    seq_lens = [c + n for c, n in rows]
    slots = [int(tables[i, p // BS]) * BS + p % BS
             for i, (c, n) in enumerate(rows) for p in range(c, c + n)]  # fmt: skip
    dev = tables.device
    return AttentionMetadata(
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in rows),
        max_seq_len=max(seq_lens),
    )


def random_cache(
    rows: list[tuple[int, int]], hkv: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of random (finite) entries in the real layout and shuffled block tables."""
    width = max(-(-(c + n) // BS) for c, n in rows)
    num_blocks = width * len(rows) + 1
    kv = torch.randn(KVCacheLayout(2, hkv, d, BS, dtype).shape(num_blocks), device="cuda")
    tables = torch.randperm(num_blocks, device="cuda")[: width * len(rows)]
    return kv.to(dtype), tables.view(len(rows), width).to(torch.int32)


def oracle(
    rows: list[tuple[int, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kv: torch.Tensor, tables: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The torch reference in float32 over the same (rounded) values, on a copy of the cache."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    ref = get_backend("torch")(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    cache = layer_views(kv.float(), 1)
    return ref.forward(q.float(), k.float(), v.float(), cache, metadata(rows, tables))


CASES = {
    # a long prompt from scratch, a chunk over cached blocks, decode rows around the window
    "mixed": [(0, 1500), (900, 300), (5000, 1), (300, 1), (130, 1), (2000, 1)],
    # decode rows only, long enough to split over a long window
    "decode": [(9000, 1), (5000, 1), (100, 1)],
}
BACKENDS = ["triton", "flash_attn"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("window", "with_sinks"), [(128, True), (512, False), (1024, False),
                                                    (4096, True), (None, True)])  # fmt: skip
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 64), (16, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_windowed_attention_matches_the_reference(
    backend: str, case: str, window: int | None, with_sinks: bool,
    hq: int, hkv: int, d: int, dtype: torch.dtype,
) -> None:  # fmt: skip
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("needs FlashAttention-4 on a Hopper GPU")
    torch.manual_seed(0)
    rows = CASES[case]
    kv, tables = random_cache(rows, hkv, d, dtype)
    n = sum(new for _, new in rows)
    q, k, v = (torch.randn(n, h, d, device="cuda").to(dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, device="cuda") * 2 + 1 if with_sinks else None
    expected = oracle(rows, q, k, v, kv, tables, window, sinks)
    impl = get_backend(backend)(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    out = impl.forward(q, k, v, layer_views(kv, 1), metadata(rows, tables))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_a_windowed_decode_replays_in_a_cuda_graph() -> None:
    """Captured at the bound's context (the split count it implies, the window's), replayed
    after the runner rewrote the lengths and tables in place: nothing read on the host."""
    torch.manual_seed(0)
    hq, hkv, d, window, bound = 16, 4, 128, 4096, 12000
    rows = [(bound - 1, 1)] * 4
    kv, tables = random_cache(rows, hkv, d, torch.bfloat16)
    q = torch.randn(4, hq, d, device="cuda").to(torch.bfloat16)
    k, v = torch.randn(2, 4, hkv, d, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(hq, device="cuda")
    impl = get_backend("triton")(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    cache, meta = layer_views(kv, 1), metadata(rows, tables)
    out = torch.empty_like(q)
    impl.forward(q, k, v, cache, meta, out=out)  # compile and tune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(q, k, v, cache, meta, out=out)
    replay = [(11000, 1), (99, 1), (4096, 1), (5000, 1)]
    now = metadata(replay, tables)
    meta.seq_lens.copy_(now.seq_lens)
    meta.slot_mapping.copy_(now.slot_mapping)
    graph.replay()
    torch.cuda.synchronize()
    expected = oracle(replay, q, k, v, kv, tables, window, sinks)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("window", "with_sinks"), [(128, True), (1024, False), (None, True)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(16, 4, 128), (16, 8, 256)])  # (Gemma-3-12B's)
def test_flash_attn_runs_windows_and_sinks_over_pages_released_behind_the_window(
    window: int | None, with_sinks: bool, hq: int, hkv: int, d: int
) -> None:
    """The FlashAttention backend's prefill rows of a windowed or sink layer go to
    FlashAttention-4 (its local mask, W − 1 keys left of each query, and its per-head sink),
    not to the Triton prefill; the block table's entries wholly behind every query's window
    may name another page (the spare page past the pool, ``null_block_id``, or a released
    page's stale id), as they do once those blocks are released: here a page past the pool."""
    if not flash_attn_available():
        pytest.skip("needs FlashAttention-4 on a Hopper GPU")
    torch.manual_seed(0)
    rows = CASES["mixed"]
    kv, tables = random_cache(rows, hkv, d, torch.bfloat16)
    kv = torch.cat([kv, torch.zeros_like(kv[:1])])  # the spare page, past the pool
    null = kv.shape[0] - 1
    if window is not None:  # behind the first new query's window: released
        for i, (cached, _) in enumerate(rows):
            behind = max(cached - window + 1, 0) // BS
            tables[i, :behind] = null
    n = sum(new for _, new in rows)
    q, k, v = (torch.randn(n, h, d, device="cuda").to(torch.bfloat16) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, device="cuda") * 2 + 1 if with_sinks else None
    impl = get_backend("flash_attn")(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    calls: list[dict[str, object]] = []
    fwd = impl._fwd

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return fwd(*args, **kwargs)

    impl._fwd = spy
    out = impl.forward(q, k, v, layer_views(kv, 1), metadata(rows, tables))
    assert len(calls) == 1
    assert calls[0]["window_size_left"] == (None if window is None else window - 1)
    assert calls[0]["learnable_sink"] is sinks
    expected = oracle(rows, q, k, v, kv, tables, window, sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
