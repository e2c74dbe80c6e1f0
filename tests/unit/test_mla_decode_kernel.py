"""The MLA decode kernel (Triton's interpreter on CPU) against its PyTorch reference, and the
reference against attention written out per head with explicit keys and values.

The cache is one layer's strided view of a two-layer latent cache [nb, 2, 1, bs, 1, D], with
shuffled block tables, uneven contexts and NaN in every slot no request owns (a kernel that
let a masked row into its sums would return NaN)."""

import random

import pytest
import torch

from services.worker.engine.ops.mla_decode import (
    MLALaunch,
    mla_decode,
    mla_decode_reference,
    num_splits,
)

LR, R, BS, LAYERS, LAYER = 32, 16, 16, 2, 1
SCALE = 0.3
# (q_lat, q_pe, cache view, block tables, seq_lens)
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def build(
    seq_lens: list[int], heads: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Case:
    """(q_lat, q_pe, cache view, block tables, seq_lens) for requests of ``seq_lens`` tokens."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    total = sum(need) + 2
    kv = torch.full((total, LAYERS, 1, BS, 1, LR + R), float("nan"))
    free = list(range(total))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(k)] for k in need]
    for table, n in zip(tables, seq_lens, strict=True):
        for pos in range(n):
            kv[table[pos // BS], LAYER, 0, pos % BS, 0] = torch.randn(LR + R)
    width = max(need) + 1  # a spare column, as a table sized for longer contexts has
    block_tables = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables],
                                dtype=torch.int32)  # fmt: skip
    cache = kv.to(dtype)[:, LAYER, 0]
    q_lat = torch.randn(len(seq_lens), heads, LR).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, R).to(dtype)
    return q_lat, q_pe, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def test_reference_is_attention_per_head() -> None:
    q_lat, q_pe, cache, tables, lens = build([5, 21], heads=3)
    got = mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE)
    for b, n in enumerate(lens.tolist()):
        rows = torch.stack([cache[tables[b, t // BS], t % BS, 0] for t in range(n)]).double()
        for h in range(3):
            q = torch.cat([q_lat[b, h], q_pe[b, h]]).double()
            p = (rows @ q * SCALE).softmax(0)
            torch.testing.assert_close(got[b, h].double(), p @ rows[:, :LR], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("seq_lens", "heads", "splits"),
    [
        ([37], 2, 1),
        ([37], 4, 4),
        ([1, 70, 16], 2, 2),
        ([33, 5, 64], 4, 1),
        ([70, 2, 17], 4, 8),
        ([300, 40], 2, 64),
    ],  # 64: ranges combined 16 at a time, many of them empty
)
def test_kernel_matches_reference(seq_lens: list[int], heads: int, splits: int) -> None:
    q_lat, q_pe, cache, tables, lens = build(seq_lens, heads)
    want = mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE)
    got = mla_decode(q_lat, q_pe, cache, tables, lens, SCALE, launch=MLALaunch(block_n=16,
                     splits=splits))  # fmt: skip
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_default_launch_into_strided_out_and_queries() -> None:
    """The split rule's own count (several, on the interpreter's pretend 8 SMs), queries cut
    from wider rows and an ``out`` view that is not contiguous."""
    q_lat, q_pe, cache, tables, lens = build([600, 9], heads=2)
    assert num_splits(2, 1, 600, 8) > 1
    wide = torch.cat([q_lat, q_pe], dim=2)  # [B, H, Lr + R]: q_lat and q_pe as views of it
    out = torch.zeros(2, 2, 2 * LR)[:, :, :LR]
    got = mla_decode(wide[..., :LR], wide[..., LR:], cache, tables, lens, SCALE, out=out,
                     max_seq_len=600)  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    want = mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE)
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)


def test_float16() -> None:
    q_lat, q_pe, cache, tables, lens = build([50, 3], heads=4, dtype=torch.float16)
    want = mla_decode_reference(q_lat, q_pe, cache, tables, lens, SCALE)
    got = mla_decode(q_lat, q_pe, cache, tables, lens, SCALE, launch=MLALaunch(splits=2))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)


def test_fp8_cache_with_a_scale() -> None:
    q_lat, q_pe, cache, tables, lens = build([40, 7], heads=2)
    fp8 = (cache / 0.5).to(torch.float8_e4m3fn)
    want = mla_decode_reference(q_lat, q_pe, fp8, tables, lens, SCALE, kv_scale=0.5)
    got = mla_decode(q_lat, q_pe, fp8, tables, lens, SCALE, kv_scale=0.5,
                     launch=MLALaunch(block_n=16, splits=2))  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_split_rule() -> None:
    assert num_splits(1, 1, 32768, 132) == 128  # batch 1: fill the GPU, up to MAX_SPLITS
    assert num_splits(1, 8, 32768, 132) == 32  # 8 head groups already
    assert num_splits(1, 1, 1000, 132) == 2  # no range under TOKENS_PER_SPLIT
    assert num_splits(64, 8, 32768, 132) == 1  # enough programs without splitting
    assert num_splits(1, 1, 300, 132) == 1  # too short to cut
