"""The MLA decode kernel on the GPU at DeepSeek's widths (Lr 512, R 64) against its float32
PyTorch reference: 16 and 128 heads, batches 1 to 64, contexts up to 32k tokens, bf16 (and
float16, float32, an e4m3 cache); and a CUDA graph captured once and replayed with new
lengths and tables. The interpreter's tiny-shape checks are tests/unit/test_mla_decode_kernel.py.
"""

import pytest
import torch

from services.worker.engine.ops.mla_decode import (
    MLALaunch,
    mla_decode,
    mla_decode_reference,
    supported,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LR, R, LAYERS, LAYER = 512, 64, 2, 1
SCALE = 192**-0.5  # DeepSeek-V2's 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# (q_lat, q_pe, cache view, block tables, seq_lens)
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def build(
    seq_lens: list[int],
    heads: int,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    spare_blocks: int = 0,
    seed: int = 0,
) -> Case:
    """(q_lat, q_pe, cache view, block tables, seq_lens) on the GPU: a shuffled two-layer
    latent cache whose slots no request owns hold NaN; ``spare_blocks`` more table columns."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    total = sum(need) + 1
    kv = torch.full((total, LAYERS, 1, block_size, 1, LR + R), float("nan"), device="cuda")
    perm = torch.randperm(total, device="cuda", generator=gen)
    owned = perm[: sum(need)]
    kv[owned, LAYER] = torch.randn(len(owned), 1, block_size, 1, LR + R, device="cuda",
                                   generator=gen)  # fmt: skip
    width = max(need) + spare_blocks
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32, device="cuda")
    start = 0
    for b, (n, k) in enumerate(zip(seq_lens, need, strict=True)):
        tables[b, :k] = owned[start : start + k]
        start += k
        if n % block_size:  # the last block's free rows
            kv[owned[start - 1], LAYER, 0, n % block_size :] = float("nan")
    cache = kv.to(dtype)[:, LAYER, 0]
    q_lat = torch.randn(len(seq_lens), heads, LR, device="cuda", generator=gen).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, R, device="cuda", generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q_lat, q_pe, cache, tables, lens


def contexts(batch: int, longest: int, seed: int) -> list[int]:
    """Uneven contexts up to ``longest``, the longest among them, and a 1-token one."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (batch,), generator=gen).tolist()
    lens[0] = longest
    if batch > 1:
        lens[-1] = 1
    return lens


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("batch", "longest"), [(1, 32768), (1, 1000), (8, 32768), (64, 4096)])
def test_bf16_against_reference(heads: int, batch: int, longest: int) -> None:
    q_lat, q_pe, cache, tables, lens = build(contexts(batch, longest, seed=batch), heads)
    assert supported(q_lat, cache)
    got = mla_decode(q_lat, q_pe, cache, tables, lens, SCALE, max_seq_len=longest)
    check(got, mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE), torch.bfloat16)


@pytest.mark.parametrize(
    "launch",
    [MLALaunch(block_h=16, num_warps=8), MLALaunch(block_h=64, block_n=16, num_warps=8),
     MLALaunch(block_h=32, num_warps=8, num_stages=3), MLALaunch(block_n=16, splits=32)],
    ids=str,
)  # fmt: skip
def test_other_launches(launch: MLALaunch) -> None:
    """Launches a sweep may make the default, at 96 heads (not a multiple of 64)."""
    q_lat, q_pe, cache, tables, lens = build(contexts(3, 6000, seed=5), 96)
    got = mla_decode(q_lat, q_pe, cache, tables, lens, SCALE, launch=launch)
    check(got, mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 64])
def test_other_dtypes_and_block_sizes(dtype: torch.dtype, block_size: int) -> None:
    lens = contexts(5, 5000, seed=7)
    q_lat, q_pe, cache, tables, lens_t = build(lens, 16, dtype, block_size, spare_blocks=3)
    got = mla_decode(q_lat, q_pe, cache, tables, lens_t, SCALE)  # bound: the table's capacity
    check(got, mla_decode_reference(q_lat, q_pe, cache, tables, lens_t, SCALE), dtype)


def test_fp8_cache() -> None:
    q_lat, q_pe, cache, tables, lens = build(contexts(4, 9000, seed=3), 128)
    fp8 = (cache.float() / 0.25).to(torch.float8_e4m3fn)
    assert supported(q_lat, fp8)
    got = mla_decode(q_lat, q_pe, fp8, tables, lens, SCALE, kv_scale=0.25)
    want = mla_decode_reference(q_lat, q_pe, fp8, tables, lens, SCALE, kv_scale=0.25)
    check(got, want, torch.bfloat16)


@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_replays_with_new_lengths(heads: int) -> None:
    """Captured at one set of lengths and tables, replayed at others (copied into the same
    device tensors): the replay gives the new lengths' answer, split count and all."""
    first = [4000, 70, 1, 2500]
    second = [17, 4001, 3000, 900]
    q_lat, q_pe, cache, tables, lens = build(first + second, heads)
    q1, p1, t1, l1 = q_lat[:4].clone(), q_pe[:4].clone(), tables[:4].clone(), lens[:4].clone()
    out = torch.empty_like(q1)
    run = lambda: mla_decode(q1, p1, cache, t1, l1, SCALE, out=out, max_seq_len=8192)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    check(out.clone(), mla_decode_reference(q1, p1, cache, t1, l1, SCALE), torch.bfloat16)
    q1.copy_(q_lat[4:])
    p1.copy_(q_pe[4:])
    t1.copy_(tables[4:])
    l1.copy_(lens[4:])
    graph.replay()
    want = mla_decode_reference(q_lat[4:], q_pe[4:], cache, tables[4:], lens[4:], SCALE)
    check(out, want, torch.bfloat16)
