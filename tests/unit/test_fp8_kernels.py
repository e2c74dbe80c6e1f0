"""The FP8 kernels (ops/fp8_linear.py) in Triton's interpreter on CPU: their indexing,
scales and bias. The interpreter's float32 → e4m3 cast rounds some values toward zero and drops
a round-up's carry into the next power of two (31.5 becomes 16, where the GPU and PyTorch give
32), so here the products are checked against the codes the kernels' own quantizer wrote; on
the GPU they are checked bit for bit against the reference's rounding
(tests/gpu/test_fp8_kernels.py)."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.ops import fp8_block, fp8_linear
from services.worker.engine.quantization.fp8_math import Codes, dequantize, quantize_blocks
from services.worker.engine.quantization.fp8_math import quantize_rows as quantize_weight_rows


def _case(rows: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.01, 30, k)
    w, ws = quantize_weight_rows(torch.randn(n, k, generator=g) * 0.05)
    return x, w, ws, torch.randn(n, generator=g)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_rows_scales_like_the_reference(static: bool) -> None:
    x, *_ = _case(5, 16, 320)  # K not a multiple of the kernel's chunk
    xs = torch.tensor([0.07]) if static else None
    q, s = fp8_linear.quantize_rows(x, xs)
    want = xs.expand(5, 1) if xs is not None else x.abs().amax(1, keepdim=True) / 448
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s, want)
    # every code is the reference's, or (the interpreter's cast rounds some toward zero, and
    # drops a carry into the next power of two) a smaller one of the same sign, at least half
    ref = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = q.float()
    off = got != ref
    assert (got[off].sign() == ref[off].sign()).all() and off.float().mean() < 0.15
    assert (got[off].abs() < ref[off].abs()).all() and (got[off].abs() >= ref[off].abs() / 2).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_gemv_is_the_product_of_its_quantized_row(static: bool, bias: bool) -> None:
    x, w, ws, b = _case(1, 48, 320)
    xs = torch.tensor([0.07]) if static else None
    q, s = fp8_linear.quantize_rows(x, xs)
    got = fp8_linear.fp8_gemv(x, w, ws, b if bias else None, xs)
    want = F.linear((q.float() * s).double(), dequantize(w, ws, None).double(),
                    b.double() if bias else None)  # fmt: skip
    assert got.shape == (1, 48) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_mm_float32_is_the_product_of_its_quantized_rows() -> None:
    """torch._scaled_mm runs on CPU too: the float32 branch (unscaled product, then scaled)."""
    x, w, ws, b = _case(6, 32, 64)
    q, s = fp8_linear.quantize_rows(x)
    got = fp8_linear.fp8_mm(x, w, ws, b)
    want = F.linear((q.float() * s).double(), dequantize(w, ws, None).double(), b.double())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("rows", "n", "k", "launch"),
    [
        (5, 96, 256, {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 64, "SPLITS": 1}),
        (37, 200, 320, {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 64, "SPLITS": 3}),
        (16, 128, 512, {"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 128, "SPLITS": 2}),
        (40, 64, 384, {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 32, "SPLITS": 4}),
    ],
    ids=["one-slice", "three-slices-ragged", "two-slices", "three-row-tiles-four-slices"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_gemm_is_the_product_of_the_codes(
    rows: int, n: int, k: int, launch: dict[str, int], dtype: torch.dtype
) -> None:
    """The transposed tiles, the split of K and the last slice's in-order sum: the product of
    the codes and scales to within one step of the output's dtype (the interpreter's bf16 cast
    rounds toward zero), with the bias; every ticket counter back at zero."""
    x, w, ws, b = _case(rows, n, k)
    q, s = fp8_linear.quantize_rows(x.to(dtype))
    got = fp8_linear.fp8_gemm(Codes(q, s, dtype), w, ws, b.to(dtype), launch)
    want = F.linear((q.double() * s.double()), dequantize(w, ws, None).double(),
                    b.to(dtype).double())  # fmt: skip
    step = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)  # a step at the value, relative
    assert got.dtype == dtype and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= want.abs() * step + 1e-3).all()
    if launch["SPLITS"] > 1:
        assert not fp8_linear._TICKETS[torch.device("cpu")].any()


def _block_case(rows: int, n: int, k: int, group: int = 128) -> tuple[torch.Tensor, ...]:
    """An activation and a weight quantized in ``group`` × ``group`` blocks (the checkpoint's
    scales, one row per weight row as the layer keeps them), a bias."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.01, 30, k)
    wq, block_scale = quantize_blocks(torch.randn(n, k, generator=g) * 0.05, group)
    ws = block_scale.repeat_interleave(group, 0)[:n]  # [n, k / group]
    return x, wq, ws, torch.randn(n, generator=g)


@pytest.mark.parametrize(("rows", "k"), [(3, 512), (2, 320)], ids=["whole", "ragged"])
def test_quantize_groups_scales_like_the_reference(rows: int, k: int) -> None:
    """A scale per token and 128 columns, as ``quantize_activations``' token_group: the scales
    exactly, the codes as the interpreter's cast rounds them (test above)."""
    x, *_ = _block_case(rows, 16, k)
    codes = fp8_block.quantize_groups(x, 128)
    groups = -(-k // 128)
    assert codes.scales.shape == (rows, groups) and codes.dtype == x.dtype
    want = torch.stack(
        [x[:, g * 128 : (g + 1) * 128].abs().amax(1) / 448 for g in range(groups)], 1
    )
    assert torch.equal(codes.scales, want)
    ref = (x / want.repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)
    off = codes.codes.float() != ref.float()
    assert off.float().mean() < 0.15
    assert (codes.codes.float()[off].abs() < ref.float()[off].abs()).all()


@pytest.mark.parametrize(
    ("rows", "n", "k", "launch"),
    [
        (1, 192, 512, None),
        (5, 256, 384, {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "SPLITS": 2}),
        (20, 128, 320, {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "SPLITS": 3}),
    ],
    ids=["one-row-default-launch", "two-slices", "ragged-k-three-slices"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_block_mm_is_the_product_of_the_block_codes(
    rows: int, n: int, k: int, launch: dict[str, int] | None, dtype: torch.dtype
) -> None:
    """Each K tile scaled by its activation group's and weight block's scales before it is
    added: the product of the codes dequantized group by group (the plain path's arithmetic),
    to within a step of the output's dtype, with the bias; a wrong pairing of scales and tiles
    (say, a block's scale on the next block's columns) is off by far more."""
    x, w, ws, b = _block_case(rows, n, k)
    x, b = x.to(dtype), b.to(dtype)
    codes = fp8_block.quantize_groups(x, 128)
    cols = torch.arange(k) // 128
    got = fp8_block.fp8_block_mm(x, w, ws, b, 128, config=launch)
    xd = codes.codes.double() * codes.scales.double()[:, cols]
    want = F.linear(xd, dequantize(w, ws, cols).double(), b.double())
    step = 2.0 ** -(7 if dtype == torch.bfloat16 else 20)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= want.abs() * step + 1e-3).all()
    assert not fp8_linear._TICKETS.get(torch.device("cpu"), torch.zeros(1)).any()
    if k > 128:  # the check tells the pairings apart: each group's scale on its neighbour's
        shifted = codes.codes.double() * codes.scales.double()[:, cols.roll(128)]
        wrong = F.linear(shifted, dequantize(w, ws, cols.roll(128)).double(), b.double())
        assert (wrong - want).abs().max() > 10 * (want.abs().max() * step + 1e-3)


@pytest.mark.parametrize(("k", "bias"), [(512, True), (320, False)], ids=["whole", "ragged"])
def test_the_block_gemv_is_the_product_of_the_block_codes(k: int, bias: bool) -> None:
    """One row of a block layer: the GEMV with each column's activation and weight block
    scales in its sums (two block rows, so a program's block row matters), as the product of
    the codes dequantized group by group."""
    x, w, ws, b = _block_case(1, 256, k)
    blocks = fp8_block.block_scales(ws, 128)
    assert blocks is not None
    codes = fp8_block.quantize_groups(x, 128)
    cols = torch.arange(k) // 128
    got = fp8_block.fp8_block_mm(x, w, ws, b if bias else None, 128, blocks)
    xd = codes.codes.double() * codes.scales.double()[:, cols]
    want = F.linear(xd, dequantize(w, ws, cols).double(), b.double() if bias else None)
    assert got.shape == (1, 256) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_block_launch_fills_the_gpu_with_k_slices() -> None:
    """64 weight rows a tile, K split until about three programs an SM, at least eight K
    tiles a slice (the 8B shape's fastest launches at one row on an H200)."""
    one = fp8_block.block_launch(1, 4096, 4096, 128, 132)
    assert (one["BLOCK_N"], one["BLOCK_M"], one["BLOCK_K"]) == (64, 16, 128)
    assert one["SPLITS"] == 4  # o: 64 tiles × 4 slices of 8 K tiles
    assert fp8_block.block_launch(1, 4096, 14336, 128, 132)["SPLITS"] == 7  # down
    assert fp8_block.block_launch(1, 28672, 4096, 128, 132)["SPLITS"] == 1  # gate_up: 448 tiles
    assert fp8_block.block_launch(1, 4096, 512, 128, 132)["SPLITS"] == 1  # four K tiles
    assert fp8_block.block_launch(300, 4096, 4096, 128, 132)["BLOCK_M"] == 128


def test_block_scales_are_the_layers_per_row_scales_a_block() -> None:
    """cuBLASLt's per-block weight scales from a layer's per-row ones: one row a block,
    transposed; None where 128 rows do not share their scales (a shard off the block grid) or
    the rows are no whole number of blocks."""
    blocks = torch.rand(3, 5) + 0.1
    rows = blocks.repeat_interleave(128, 0)
    got = fp8_block.block_scales(rows, 128)
    assert got is not None and got.shape == (5, 3) and torch.equal(got, blocks.t())
    shifted = rows.roll(64, 0)
    assert fp8_block.block_scales(shifted, 128) is None
    assert fp8_block.block_scales(rows[:320], 128) is None


def test_the_layers_take_the_kernels_on_a_gpu_only() -> None:
    """On CPU a layer stays on the plain path: no FP8 tensor cores."""
    x, w, *_ = _case(2, 32, 64)
    assert not fp8_linear.supported(x, w)


def _own_codes(plain: torch.Tensor, group: int) -> Codes:
    """The codes the FP8 layer's own quantization pass writes for ``plain``: per token (group
    the row's width) or a scale per token and ``group`` columns (block checkpoints)."""
    if group == plain.shape[1]:
        return Codes(*fp8_linear.quantize_rows(plain), plain.dtype)
    return fp8_block.quantize_groups(plain, group)


def _assert_same_codes(got: Codes, want: Codes) -> None:
    assert got.dtype == want.dtype and got.codes.shape == want.codes.shape
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert got.scales.shape == want.scales.shape and torch.equal(got.scales, want.scales)
    assert got.scales.stride() == want.scales.stride()  # (groups: as cuBLASLt reads them)


@pytest.mark.parametrize("group", [640, 128], ids=["per-token", "groups"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_writes_the_codes_the_layer_would(residual: bool, group: int) -> None:
    """RMSNorm handing an FP8 layer its input quantized: the codes and scales of its own output,
    bit for bit (the same rounding as the layer's quantize_rows, or quantize_groups for a
    block checkpoint: 5 groups of 128 in a 1,024-wide program), the residual as without."""
    from services.worker.engine.ops.fused_ops import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 640, generator=g) * torch.linspace(0.01, 30, 640)
    r = torch.randn(4, 640, generator=g)
    w = torch.rand(640, generator=g) + 0.5
    if residual:
        plain, r_plain = add_rms_norm(x, r.clone(), w, 1e-6)
        codes, r_codes = add_rms_norm(x, r.clone(), w, 1e-6, group)
        assert torch.equal(r_codes, r_plain)
    else:
        plain, codes = rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, group)
    assert isinstance(codes, Codes) and isinstance(plain, torch.Tensor)
    assert codes.rows == 4
    _assert_same_codes(codes, _own_codes(plain, group))


@pytest.mark.parametrize(("n", "group"), [(1100, 1100), (1280, 128)], ids=["per-token", "groups"])
def test_silu_mul_writes_the_codes_the_layer_would(n: int, group: int) -> None:
    """Per token one program a row; in groups 1,024 columns a program (here two, the second
    with two groups of its eight)."""
    from services.worker.engine.ops.fused_ops import silu_and_mul

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2 * n, generator=g) * 4  # wider than one 1024-column program
    plain, codes = silu_and_mul(x), silu_and_mul(x, group)
    assert isinstance(codes, Codes) and isinstance(plain, torch.Tensor)
    _assert_same_codes(codes, _own_codes(plain, group))


def test_the_fused_kernels_refuse_codes_they_cannot_write() -> None:
    """A group that does not divide the row, or a flag where a width belongs, is refused."""
    from services.worker.engine.ops.fused_ops import rms_norm, silu_and_mul

    x = torch.randn(2, 320)
    for group in (128, True):
        with pytest.raises(AssertionError, match="groups"):
            rms_norm(x, torch.ones(320), 1e-6, group)
        with pytest.raises(AssertionError, match="groups"):
            silu_and_mul(torch.randn(2, 640), group)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_block_kernels_take_group_codes_as_their_own_quantization(rows: int) -> None:
    """Given a block layer's input as codes in groups (what the fused kernels hand over), the
    block GEMV (one row) and our block GEMM compute exactly what they compute from x."""
    x, w, ws, b = _block_case(rows, 256, 512)
    blocks = fp8_block.block_scales(ws, 128)
    codes = fp8_block.quantize_groups(x, 128)
    got = fp8_block.fp8_block_mm(codes, w, ws, b, 128, blocks)
    assert got.dtype == x.dtype and torch.equal(
        got, fp8_block.fp8_block_mm(x, w, ws, b, 128, blocks)
    )


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 6])
def test_the_kernels_take_codes_as_their_own_quantization(rows: int, bias: bool) -> None:
    """Given the codes of x, the GEMV and fp8_mm compute exactly what they compute from x."""
    x, w, ws, b = _case(rows, 48, 320)
    q, s = fp8_linear.quantize_rows(x)
    fn = fp8_linear.fp8_gemv if rows == 1 else fp8_linear.fp8_mm
    got = fn(Codes(q, s, x.dtype), w, ws, b if bias else None)
    assert got.dtype == x.dtype and torch.equal(got, fn(x, w, ws, b if bias else None))


def _row_parallel(k: int, quant: Any, kernels: bool = True) -> Any:
    from services.worker.engine.models.layers.linear import RowParallelLinear
    from services.worker.engine.quantization.registry import linear_method

    return RowParallelLinear(k, 32, method=linear_method(quant, kernels))


def test_only_fused_dynamic_layers_on_a_gpu_take_codes() -> None:
    from services.worker.engine.quantization.config import parse_quantization

    fp8 = parse_quantization({}, "fp8")
    x = torch.randn(1, 64)
    assert not _row_parallel(64, fp8).input_group(x)  # CPU
    assert not _row_parallel(64, None).input_group(x)  # not FP8


def test_a_layer_says_which_codes_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels run (here: made to say so on CPU), a per-token layer takes codes of
    its whole input row, a block layer codes a scale per 128 columns, when its columns fall in
    whole blocks; a static or float layer takes the row (0)."""
    from services.worker.engine.quantization.config import QuantConfig, parse_quantization

    monkeypatch.setattr(fp8_linear, "supported", lambda x, w: True)
    x = torch.randn(1, 64)
    block = QuantConfig("block", "token_group")
    assert _row_parallel(384, parse_quantization({}, "fp8")).input_group(x) == 384
    assert _row_parallel(384, block).input_group(x) == 128
    assert _row_parallel(320, block).input_group(x) == 0
    assert _row_parallel(384, block, kernels=False).input_group(x) == 0
    static = QuantConfig("tensor", "static")
    assert _row_parallel(384, static).input_group(x) == 0
    assert _row_parallel(384, None).input_group(x) == 0
