"""Attention backends against a dense float64 attention computed independently of the cache.

The cache uses the real layout (a block contiguous across layers) with shuffled block tables;
the batch mixes prefill chunks that continue a cached prefix with decode rows.
"""

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.flash_attn_backend import available as flash_attn_available
from services.worker.engine.attention.registry import get_backend, known_backends
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views

BS, LAYERS, LAYER = 4, 3, 1


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of k/v [L, Hkv, D]; causal, float64."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_case(  # type: ignore[no-untyped-def]
    seed: int,
    hq: int,
    hkv: int,
    d: int,
    rows: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
):
    """rows: (cached tokens, new tokens) per request."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layout = KVCacheLayout(LAYERS, hkv, d, BS, dtype)
    total_blocks = sum(-(-(c + n) // BS) for c, n in rows) + 3
    kv = torch.randn(layout.shape(total_blocks)).to(dtype)  # garbage where nothing is written
    cache = layer_views(kv, LAYER)
    free = list(range(total_blocks))
    rng.shuffle(free)
    q_parts, k_parts, v_parts, slots, tables, expected = [], [], [], [], [], []
    for cached, new in rows:
        length = cached + new
        table = [free.pop() for _ in range(-(-length // BS))]
        keys = torch.randn(length, hkv, d).to(dtype)
        values = torch.randn(length, hkv, d).to(dtype)
        for pos in range(cached):  # the prefix already sits in the cache
            cache.key[table[pos // BS], pos % BS] = keys[pos]
            cache.value[table[pos // BS], pos % BS] = values[pos]
        q = torch.randn(new, hq, d).to(dtype)
        q_parts.append(q)
        k_parts.append(keys[cached:])
        v_parts.append(values[cached:])
        slots += [table[p // BS] * BS + p % BS for p in range(cached, length)]
        tables.append(table)
        expected.append(dense(q, keys, values, d**-0.5))
    width = max(map(len, tables))
    qsl = [0]
    for _, n in rows:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in rows]
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in rows),
        max_seq_len=max(seq_lens),
    )
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
    return q, k, v, cache, meta, torch.cat(expected), kv


CASES = {
    "decode-only": [(5, 1), (17, 1), (1, 1), (30, 1)],
    "decode-long": [(70, 1), (3, 1), (129, 1)],  # split over the context (see the fixture)
    "prefill-only": [(0, 7), (0, 1), (0, 13)],
    "mixed-with-prefix": [(8, 6), (0, 9), (21, 1), (3, 1), (12, 5)],
    # the trailing one-query rows of a mixed step (the runner puts them last) go through the
    # Triton backend's decode kernel, split over the context for the long one
    "mixed-trailing-decodes": [(5, 1), (8, 6), (0, 9), (21, 1), (3, 1), (70, 1)],
}
# prompts of several query tiles, over a prefix and not: the prefill kernel runs a tile's keys
# before its first query unmasked (tiles of 16 queries in the CPU interpreter, 64 or more on a
# GPU). Its own test: in the interpreter each case of it takes tens of seconds.
LONG_PREFILL = [(20, 21), (0, 34)] + ([(100, 150), (0, 300)] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def small_decode_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the Triton decode kernel split contexts of this test's size, so the split and
    combine path runs too (on a GPU it splits only contexts of thousands of tokens)."""
    from services.worker.engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "TOKENS_PER_SPLIT", 8)
    # ... also over a GPU's measured rule (ops/configs/attention/), which names its own minimum
    rule = triton_backend.num_decode_splits
    monkeypatch.setattr(triton_backend, "num_decode_splits",
                        lambda *a, **kw: rule(*a, **{**kw, "tokens_per_split": 8}))  # fmt: skip


# Inputs are rounded to the dtype first, so only the kernel's own rounding is measured.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_metadata_counts_the_trailing_decode_rows() -> None:
    _, _, _, _, meta, _, _ = build_case(0, 2, 1, 8, CASES["mixed-trailing-decodes"])
    assert (meta.num_decodes, meta.max_decode_seq_len) == (3, 71)
    _, _, _, _, meta, _, _ = build_case(0, 2, 1, 8, CASES["mixed-with-prefix"])
    assert (meta.num_decodes, meta.max_decode_seq_len) == (0, 0)
    _, _, _, _, meta, _, _ = build_case(0, 2, 1, 8, CASES["decode-only"])
    assert (meta.num_decodes, meta.max_decode_seq_len) == (4, 31)


# on a GPU also the head dims of real models (FlashAttention's paged path takes only those)
HEADS = [(4, 4, 16), (8, 2, 32), (6, 1, 8)] + (
    [(8, 2, 64), (8, 4, 128)] if torch.cuda.is_available() else []
)


@pytest.mark.parametrize("backend", known_backends())
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("hq", "hkv", "d"), HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_backend_matches_dense_attention(
    backend: str, case: str, hq: int, hkv: int, d: int, dtype: torch.dtype
) -> None:
    check_backend(backend, case, hq, hkv, d, dtype, longest_first=False)


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if "decode" in c])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 32), (6, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lanes", [1, 4], ids=["one-stream", "lanes"])
def test_triton_decode_rows_in_longest_first_order(
    case: str, hq: int, hkv: int, d: int, dtype: torch.dtype, lanes: int
) -> None:
    """With ``decode_order`` (the runner always gives one) the decode kernel takes its
    requests in that order: each must still land in its own output row and partials. Also
    with the context in interleaved lanes (``DECODE_LANES``) and prefetching."""
    check_backend("triton", case, hq, hkv, d, dtype, longest_first=True, lanes=lanes)


def in_lanes(impl: object, lanes: int) -> None:
    """The Triton decode kernel's context in ``lanes`` streams, both launches, with the keys
    a tile on asked of L2 (a GPU only; the interpreter skips it): over the GPU's own config."""
    if lanes == 1:
        return
    from services.worker.engine.attention.triton_backend import TritonAttentionBackend

    assert isinstance(impl, TritonAttentionBackend)
    impl.tune(torch.device(DEVICE))
    for name, value in (("LANES", lanes), ("PREFETCH", 1)):
        setattr(impl, f"DECODE_{name}", value)
        setattr(impl, f"DECODE_SPLIT_{name}", value)


@pytest.mark.parametrize("backend", known_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_of_several_query_tiles(backend: str, dtype: torch.dtype) -> None:
    hq, hkv, d = (8, 2, 128) if torch.cuda.is_available() else (4, 2, 16)
    check_backend(backend, LONG_PREFILL, hq, hkv, d, dtype, longest_first=False)


def check_backend(
    backend: str,
    case: str | list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    longest_first: bool,
    lanes: int = 1,
) -> None:
    if backend in ("triton", "flash_attn") and dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 matmul (numpy); runs on the GPU")
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("needs FlashAttention-4 on a Hopper GPU (pip install '.[flash-attn]')")
    reqs = CASES[case] if isinstance(case, str) else case
    q, k, v, _, meta, expected, kv = build_case(7, hq, hkv, d, reqs, dtype)
    if longest_first:
        tail = meta.seq_lens[len(meta.seq_lens) - meta.num_decodes :]
        meta.decode_order = torch.argsort(tail, descending=True, stable=True).to(torch.int32)
        assert not torch.equal(meta.decode_order, torch.arange(meta.num_decodes))
    q, k, v, kv = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv.to(DEVICE)
    v = torch.cat([v, torch.zeros_like(v)], dim=1)[:, :hkv]  # a strided view, unlike k
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "decode_order"):
        if getattr(meta, name) is not None:
            setattr(meta, name, getattr(meta, name).to(DEVICE))
    cache = layer_views(kv, LAYER)
    other_layers = kv[:, [i for i in range(LAYERS) if i != LAYER]].clone()
    impl = get_backend(backend)(hq, hkv, d, scale=d**-0.5)
    in_lanes(impl, lanes)
    out = impl.forward(q, k, v, cache, meta)
    tol = TOLERANCE[dtype]
    assert torch.allclose(out.double().cpu(), expected, atol=tol, rtol=tol)
    # the new keys/values landed in their slots, and no other layer was touched
    blocks, offs = meta.slot_mapping // BS, meta.slot_mapping % BS
    assert torch.equal(cache.key[blocks, offs], k) and torch.equal(cache.value[blocks, offs], v)
    assert torch.equal(kv[:, [i for i in range(LAYERS) if i != LAYER]], other_layers)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["mixed-with-prefix", "mixed-trailing-decodes"])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.5, 4.0)], ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lanes", [1, 4], ids=["one-stream", "lanes"])
def test_an_fp8_cache_is_read_as_its_e4m3_values(
    backend: str, case: str, k_scale: float, v_scale: float, dtype: torch.dtype, lanes: int
) -> None:
    """An FP8 (e4m3) cache with a key and a value scale: it holds k / k_scale and v / v_scale.
    The keys and values are chosen so those are on e4m3's grid, so the write is exact and the
    oracle is dense attention over the same values; the backend writes this step's K/V into
    the cache and reads the prefix from it (the decode rows split over the context too).
    bf16 queries: the Triton kernels' dots run in float16 (``_compute_dtype``)."""
    q, k, v, _, meta, _, kv = build_case(3, 8, 2, 32, CASES[case])
    kv8 = kv.to(torch.float8_e4m3fn)  # the codes already in the cache (the prefix)
    codes = layer_views(kv8.float(), LAYER)
    k8 = k.to(torch.float8_e4m3fn).float() * k_scale  # this step's, whose codes are on the grid
    v8 = v.to(torch.float8_e4m3fn).float() * v_scale
    q = q.to(dtype)  # (on bf16's grid too when bf16: the oracle takes the same queries)
    expected, start = [], 0
    tables = meta.block_tables.tolist()
    for i, (n_seq, end) in enumerate(
        zip(meta.seq_lens_cpu, meta.query_start_loc_cpu[1:], strict=True)
    ):
        n_new = end - meta.query_start_loc_cpu[i]
        prefix = n_seq - n_new
        pos = torch.arange(prefix)
        blocks = torch.tensor(tables[i])[pos // BS]
        keys = torch.cat([codes.key[blocks, pos % BS] * k_scale, k8[start:end]])
        values = torch.cat([codes.value[blocks, pos % BS] * v_scale, v8[start:end]])
        expected.append(dense(q[start:end], keys, values, 32**-0.5))
        start = end
    if backend == "torch" and lanes > 1:
        pytest.skip("lanes are the Triton decode kernel's")
    impl = get_backend(backend)(8, 2, 32, scale=32**-0.5)
    in_lanes(impl, lanes)
    q, k8, v8 = q.to(DEVICE), k8.to(dtype).to(DEVICE), v8.to(dtype).to(DEVICE)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    cache = layer_views(kv8.to(DEVICE), LAYER)
    cache.k_scale, cache.v_scale = k_scale, v_scale
    out = impl.forward(q, k8, v8, cache, meta)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    assert torch.allclose(out.double().cpu(), torch.cat(expected), atol=tol, rtol=tol)
    blocks, offs = meta.slot_mapping // BS, meta.slot_mapping % BS
    assert torch.equal(cache.key[blocks, offs].float().cpu() * k_scale, k8.float().cpu())
    assert torch.equal(cache.value[blocks, offs].float().cpu() * v_scale, v8.float().cpu())


def test_a_tuned_config_sets_the_launches_and_the_split_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker.engine.attention import triton_backend
    from services.worker.engine.ops import tuned_configs

    doc = {
        "prefill": {"head_dim_128": {"block_m": 128, "block_n": 32, "warps": 8, "stages": 3}},
        "decode": {"head_dim_128": {"waves": 2, "max_splits": 64, "tokens_per_split": 256}},
        "measured": {"anything": 1},
    }
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(doc))
    monkeypatch.setattr(triton_backend, "CONFIG_DIR", tmp_path)
    tuned_configs.read.cache_clear()
    try:
        assert triton_backend.tuned_config("NVIDIA H200") == doc
        assert triton_backend.tuned_config("Some Other GPU") == {}
    finally:
        tuned_configs.read.cache_clear()
    impl = triton_backend.TritonAttentionBackend(32, 8, 128, 128**-0.5)
    impl.apply_config(doc)
    assert (impl.PREFILL_BLOCK_M, impl.PREFILL_BLOCK_N, impl.PREFILL_WARPS) == (128, 32, 8)
    assert impl.PREFILL_STAGES == 3
    assert impl.split_rule == {"waves": 2, "max_splits": 64, "tokens_per_split": 256}
    # the class defaults are untouched, and another head dim takes nothing from this document
    assert triton_backend.TritonAttentionBackend.PREFILL_BLOCK_M == 64
    other = triton_backend.TritonAttentionBackend(8, 8, 64, 64**-0.5)
    other.apply_config(doc)
    assert (other.PREFILL_BLOCK_M, other.split_rule) == (64, {})
    # one request of 32k tokens on 8 kv heads and 132 SMs: 16 splits by default, 64 by this rule
    assert triton_backend.num_decode_splits(1, 8, 32768, 132) == 16
    assert triton_backend.num_decode_splits(1, 8, 32768, 132, **impl.split_rule) == 64
    with pytest.raises(ValueError, match="unknown prefill launch settings"):
        impl.apply_config({"prefill": {"head_dim_128": {"block_k": 64}}})


def test_the_split_launch_serves_contexts_above_the_long_context_only() -> None:
    """A tuned ``long_context``: a split context up to it takes the one-range launch, a longer
    one the split launch; a decode graph size whose rows split the context is then captured
    for both bounds (a graph keeps its launch), and for one bound where its rows do not split
    it, the two launches are the same, or none is set."""
    from services.worker.engine.attention.triton_backend import TritonAttentionBackend

    impl = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    impl.use_config({"decode": {"head_dim_128": {  # this test's document, not the GPU's
        "block_n": 64, "warps": 4, "stages": 2, "split_block_n": 128, "split_warps": 8,
        "split_stages": 4, "long_context": 16384, "waves": 2}}})  # fmt: skip
    cpu = torch.device("cpu")
    one, split = impl.decode_launches()
    assert (one, split) == ((64, 4, 2), (128, 8, 4))
    assert not impl.is_long_context(16384) and impl.is_long_context(16385)
    # 8 SMs on CPU, 8 kv heads, two waves: one row splits a context in two, two rows do not
    assert impl.decode_graph_contexts(1, 131072, cpu) == (16384, 131072)
    assert impl.decode_graph_contexts(2, 131072, cpu) == (131072,)
    assert impl.decode_graph_contexts(1, 16384, cpu) == (16384,)  # nothing longer to serve
    impl.DECODE_LONG_CONTEXT = None  # every split context takes the split launch
    assert impl.is_long_context(100) and impl.decode_graph_contexts(1, 131072, cpu) == (131072,)
    same = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    same.use_config({"decode": {"head_dim_128": {"long_context": 4096, "waves": 2}}})
    assert same.decode_graph_contexts(1, 131072, cpu) == (131072,)  # no split launch of its own
    # lanes and prefetch alone make a split launch of its own too, and reach the kernel
    lanes = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    lanes.use_config({"decode": {"head_dim_128": {
        "long_context": 4096, "waves": 2, "split_lanes": 4, "split_prefetch": 2}}})  # fmt: skip
    assert lanes.decode_streams() == ((1, 0), (4, 2))
    assert lanes.decode_graph_contexts(1, 131072, cpu) == (4096, 131072)
    q = torch.empty(1, 32, 128)
    assert lanes.decode_launch(q, 2, 8192)["LANES"] == 4  # split, above long_context
    assert lanes.decode_launch(q, 2, 4096)["LANES"] == 1


def test_the_decode_graph_of_a_step_holds_its_batch_and_its_longest_context() -> None:
    from services.worker.engine.worker.cuda_graphs import CudaGraphRunner

    def runner(contexts: dict[int, tuple[int, ...]] | None) -> CudaGraphRunner:
        return CudaGraphRunner(torch.nn.Identity(), (1, 2, 4, 8), 32768, 16, pad_block=0,
                               device=torch.device("cpu"), contexts=contexts)  # fmt: skip

    two = runner({s: (16384, 32768) for s in (1, 2, 4)})  # size 8: the default, one bound
    assert two.contexts[8] == [32768]
    assert two.key(1, [200]) == (1, 16384)
    assert two.key(3, [5, 16384]) == (4, 16384)
    assert two.key(3, [16385, 7]) == (4, 32768)
    assert two.key(5, [10]) == (8, 32768)
    assert runner(None).key(5, [10]) == (8, 32768)  # one graph a size, at the longest context
    with pytest.raises(ValueError, match="must end at 32768"):
        runner({2: (16384,)})
    meta = two.capture_metadata(2, 16384)  # captured as if every row had the bound's context
    assert meta.max_seq_len == 16384 and meta.max_decode_seq_len == 16384


def test_the_kept_configs_are_valid() -> None:
    """Every measured configuration in the package applies to the head dims it names."""
    from services.worker.engine.attention import triton_backend

    for path in sorted(triton_backend.CONFIG_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        dims = {int(k.removeprefix("head_dim_")) for kind in ("prefill", "decode")
                for k in doc.get(kind, {})}  # fmt: skip
        for d in dims:
            impl = triton_backend.TritonAttentionBackend(8, 8, d, d**-0.5)
            impl.apply_config(doc)  # raises on an unknown key
            assert impl.PREFILL_BLOCK_M in (16, 32, 64, 128), path.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_contiguous_prefill_over_a_prefix_in_several_tiles_and_blocks(dtype: torch.dtype) -> None:
    """``contiguous_prefill`` (MLA's prefill over decompressed keys and values): the last
    q_len of seq_len positions, causally, over rows in consecutive blocks; the rows past
    seq_len (NaN here) never read; values narrower than the keys, in a buffer of the keys'
    width whose other columns (NaN here) are never read either."""
    from services.worker.engine.ops.attention import CONTIGUOUS_BLOCK, contiguous_prefill

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 matmul (numpy); runs on the GPU")
    heads, width, v_dim = (16, 192, 128) if DEVICE == "cuda" else (3, 24, 12)
    seq_len, q_len = (300, 170) if DEVICE == "cuda" else (150, 70)  # several tiles each way
    length = -(-seq_len // CONTIGUOUS_BLOCK) * CONTIGUOUS_BLOCK + CONTIGUOUS_BLOCK
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, length, heads, width, generator=g)
    kv[1, :, :, v_dim:] = float("nan")
    kv[:, seq_len:] = float("nan")
    q = torch.randn(q_len, heads, width, generator=g)
    scale = width**-0.5
    keys = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), kv[0, :seq_len].double().transpose(0, 1),
        kv[1, :seq_len, :, :v_dim].double().transpose(0, 1), attn_mask=keys, scale=scale,
    ).transpose(0, 1)  # fmt: skip
    kv = kv.to(DEVICE, dtype)
    got = contiguous_prefill(q.to(DEVICE, dtype), kv[0], kv[1, :, :, :v_dim], seq_len, scale)
    assert got.shape == (q_len, heads, v_dim)
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", known_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("wide", ["keys", "values"])
def test_each_backend_attends_a_contiguous_context(backend: str, dtype: torch.dtype,
                                                   wide: str) -> None:  # fmt: skip
    """``attend_contiguous`` (MLA's prefill over its decompressed context): the last q_len of
    seq_len positions causally over keys and values of their own widths, against float64.
    FlashAttention-4 runs DeepSeek's pair (192-wide keys, 128-wide values) itself and hands
    others to the Triton kernel, which packs both into one buffer of the wider's width."""
    if backend in ("triton", "flash_attn") and dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 matmul (numpy); runs on the GPU")
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("needs FlashAttention-4 on a Hopper GPU (pip install '.[flash-attn]')")
    gpu = DEVICE == "cuda"
    heads, seq_len, q_len = (16, 300, 170) if gpu else (3, 150, 70)  # several tiles each way
    widths = {"keys": (192, 128) if gpu else (24, 12), "values": (64, 128) if gpu else (16, 24)}
    dim, v_dim = widths[wide]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(q_len, heads, dim, generator=g)
    k = torch.randn(seq_len, heads, dim, generator=g)
    v = torch.randn(seq_len, heads, v_dim, generator=g)
    want = dense(q, k, v, dim**-0.5)
    impl = get_backend(backend)(heads, heads, dim, scale=dim**-0.5)
    calls: list[tuple[int, ...]] = []
    if backend == "flash_attn":  # FlashAttention's own calls: the values it was given
        for name in ("_fwd", "_dense"):
            real = getattr(impl, name)
            if real is not None:
                setattr(impl, name, spy_values(real, calls))
    got = impl.attend_contiguous(*(t.to(DEVICE, dtype) for t in (q, k, v)))
    assert got.shape == (q_len, heads, v_dim) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)
    if backend == "flash_attn":
        takes = (dim, v_dim) == (192, 128) and dtype != torch.float32  # (float32: Triton's)
        assert calls == ([(1, seq_len, heads, v_dim)] if takes else [])


def test_the_pytorch_path_attends_a_long_context_a_few_queries_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scores bounded to 7 queries' a call (``CONTIGUOUS_SCORES``): 10 calls for 70 queries,
    each with its own rows of the causal mask, the same result as dense attention."""
    from services.worker.engine.attention import backend as backend_module

    heads, seq_len, q_len, dim = 3, 150, 70, 16
    monkeypatch.setattr(backend_module, "CONTIGUOUS_SCORES", 7 * heads * seq_len * 4)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(q_len, heads, dim, generator=g)
    k, v = torch.randn(2, seq_len, heads, dim, generator=g)
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(q.shape[1])  # (the queries of the call: [heads, queries, D])
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    got = get_backend("torch")(heads, heads, dim, scale=dim**-0.5).attend_contiguous(q, k, v)
    assert calls == [7] * 10
    assert torch.allclose(got.double(), dense(q, k, v, dim**-0.5), atol=1e-5, rtol=1e-5)


def spy_values(real: Any, calls: list[tuple[int, ...]]) -> Any:
    """``real``, recording the shape of the values of each call."""

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        calls.append(tuple(v.shape))
        return real(q, k, v, **kw)

    return spy
