"""The FP8 kernels (ops/fp8_linear.py) against the plain-PyTorch path they replace on a GPU
(quantization/fp8_math.py: the activations rounded through e4m3 the same way, the weights
dequantized), kernel by kernel and through the engine on the tiny FP8 checkpoints, where the
dequantizing reference model (baton/tiny_fp8) is the oracle as on CPU. Skipped without CUDA."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from services.worker.engine.quantization.fp8_math import (
    FP8,
    dequantize,
    quantize_activations,
    quantize_blocks,
)
from services.worker.engine.quantization.fp8_math import quantize_rows as quantize_weight_rows
from tests.helpers import (
    FP8_GPU_EXACT,
    FP8_GPU_MEDIAN_ATOL,
    FP8_GREEDY,
    FP8_LOGPROB_ATOL,
    FP8_PROMPTS,
    FP8_TIE,
    check_against_fp8_reference,
)

pytestmark = pytest.mark.gpu


def _layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    w[:, :3] *= 20  # outlier input channels, as real checkpoints have
    return quantize_weight_rows(w)


def _reference(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    b: torch.Tensor | None,
    xs: torch.Tensor | None,
) -> torch.Tensor:
    xq = quantize_activations(x, "static" if xs is not None else "token", 128, xs)
    return F.linear(
        xq.double(), dequantize(w, ws, None).double(), None if b is None else b.double()
    )


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_rows_is_the_reference_rounding(static: bool) -> None:
    from services.worker.engine.ops.fp8_linear import quantize_rows

    x = torch.randn(37, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")
    xs = torch.tensor([0.05], device="cuda") if static else None
    q, s = quantize_rows(x, xs)
    assert q.dtype == FP8 and s.shape == (37, 1)
    want = quantize_activations(x, "static" if static else "token", 128, xs)
    assert torch.equal(q.float() * s, want)  # the same codes and scales, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (96, 64), (28672, 4096)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_linear_matches_the_plain_path(
    dtype: torch.dtype, rows: int, n: int, k: int, static: bool
) -> None:
    from services.worker.engine.ops.fp8_linear import fp8_gemv, fp8_mm

    w, ws = _layer(n, k, n + k)
    x = (torch.randn(rows, k, device="cuda") * 2).to(dtype)
    b = (torch.randn(n, device="cuda") * 0.1).to(dtype)
    xs = x.float().abs().amax().reshape(1) / 448 if static else None
    for bias in (None, b):
        want = _reference(x, w, ws, bias, xs)
        got = (fp8_gemv if rows == 1 else fp8_mm)(x, w, ws, bias, xs)
        assert got.dtype == dtype and got.shape == (rows, n)
        # the GEMV in float32: only the order of the float32 sums differs. The tensor cores
        # (fp8_mm) accumulate FP8 products with fewer bits than float32 keep: 2.6e-4 to 9.2e-4
        # of the largest output on an H200, K = 64 to 4096 (docs/performance.md, "FP8": the
        # GEMV, cuBLASLt's FP8 tensor cores 2.6e-4 to 9.2e-4).
        # bf16: one output rounding on top.
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4 if rows == 1 else 2e-3
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err <= tol, (bias is not None, float(err))


@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336)])
def test_fast_accumulation_stays_near_the_plain_path(n: int, k: int) -> None:
    """fp8_mm without float32 promotion of its partial sums (``fast_accumulation``), over the
    longest rows of the 8B shape (down: K = 14,336): within 2e-2 of the largest output."""
    from services.worker.engine.ops.fp8_linear import fp8_mm

    w, ws = _layer(n, k, n + k)
    x = (torch.randn(300, k, device="cuda") * 2).to(torch.bfloat16)
    want = _reference(x, w, ws, None, None)
    got = fp8_mm(x, w, ws, fast_accumulation=True)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert got.dtype == torch.bfloat16 and err <= 2e-2, float(err)


def _fast_gemv_arithmetic(
    codes: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:
    """The fast GEMV's sums, emulated in float64: activation codes / 256; per weight word,
    codes 0 and 2 (1 and 3) multiplied and added in float16, the two sums added in float16,
    then every word's sum added (in float64 here, float32 there)."""
    n, k = w.shape

    def f16(t: torch.Tensor) -> torch.Tensor:  # rounded once (torch goes through float32)
        return torch.from_numpy(t.numpy().astype(np.float16).astype(np.float64))

    x = codes.cpu().double().reshape(k // 4, 4) / 256
    ww = w.cpu().double().reshape(n, k // 4, 4)
    lo, hi = f16(ww[..., 0] * x[:, 0]), f16(ww[..., 1] * x[:, 1])
    lo, hi = f16(ww[..., 2] * x[:, 2] + lo), f16(ww[..., 3] * x[:, 3] + hi)
    scale = s.cpu().double().reshape(()) * ws.cpu().double().reshape(-1)
    return (f16(lo + hi).sum(-1) * 256 * scale).to(codes.device)


@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336), (28672, 4096), (96, 64)])
def test_the_fast_gemv_sums_each_word_in_float16(n: int, k: int) -> None:
    """fp8_gemv over codes with ``fast_accumulation``: the float16 arithmetic of
    ``_fast_gemv_arithmetic`` (to float32's order of sums); 2.2e-4 to 3.7e-4 of the largest
    output from the exact product on such data at these shapes (emulated on CPU), where the
    float32 GEMV is within 1e-4 (test_fp8_linear_matches_the_plain_path). Given the row, it
    stays float32."""
    from services.worker.engine.ops.fp8_linear import fp8_gemv, quantize_rows
    from services.worker.engine.quantization.fp8_math import Codes

    w, ws = _layer(n, k, n + k)
    x = torch.randn(1, k, device="cuda") * 2
    q, s = quantize_rows(x)
    got = fp8_gemv(Codes(q, s, torch.float32), w, ws, fast_accumulation=True).double()[0]
    row = fp8_gemv(x, w, ws, fast_accumulation=True)
    assert torch.equal(row, fp8_gemv(x, w, ws))
    want = _fast_gemv_arithmetic(q[0].float(), s, w.float(), ws)
    exact = (q.double() * s.double()) @ (w.double() * ws.double()).T
    top = exact.abs().max()
    assert ((got - want).abs().max() / top) <= 1e-6, float((got - want).abs().max() / top)
    assert ((got - exact[0]).abs().max() / top) <= 1e-3


GEMM_LAUNCHES = [
    {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "SPLITS": 1, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "SPLITS": 4, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 128, "SPLITS": 2, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_M": 256, "BLOCK_K": 128, "SPLITS": 3, "num_warps": 8, "num_stages": 3},
]


@pytest.mark.parametrize("launch", GEMM_LAUNCHES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("rows", [3, 64, 200, 256])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (208, 320)])
def test_fp8_gemm_is_as_exact_as_cublas_and_deterministic(
    launch: dict[str, int], rows: int, n: int, k: int
) -> None:
    """Our FP8 GEMM (decode batches) against cuBLASLt over the same codes: within twice
    cuBLASLt's own error against float64 in either accumulation mode (plus a bf16 step), the
    same bits on a second call whatever order the K slices finished in, the bias added, and
    the split-K ticket counters left at zero."""
    from services.worker.engine.ops import fp8_linear
    from services.worker.engine.quantization.fp8_math import Codes

    w, ws = _layer(n, k, n + k + rows)
    x = (torch.randn(rows, k, device="cuda") * 2).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
    codes = Codes(*fp8_linear.quantize_rows(x), torch.bfloat16)
    exact = F.linear(codes.codes.double() * codes.scales.double(),
                     dequantize(w, ws, None).double(), b.double())  # fmt: skip
    for fast in (True, False):
        ours = fp8_linear.fp8_gemm(codes, w, ws, b, launch, fast_accumulation=fast)
        again = fp8_linear.fp8_gemm(codes, w, ws, b, launch, fast_accumulation=fast)
        theirs = _cublas(codes, w, ws, fast) + b
        top = exact.abs().max()
        err, cublas = ((y.double() - exact).abs().max() / top for y in (ours, theirs))
        assert ours.shape == (rows, n) and torch.equal(ours, again)
        assert err <= 2 * cublas + 2**-8, (fast, float(err), float(cublas))
    if launch["SPLITS"] > 1:
        assert not fp8_linear._TICKETS[torch.device("cuda", 0)].any()


def test_fp8_gemm_split_k_replays_in_a_cuda_graph() -> None:
    """The ticket counters are reset by the launch itself: a captured split-K GEMM replays to
    the same bits as it runs eagerly, over new inputs each replay."""
    from services.worker.engine.ops import fp8_linear
    from services.worker.engine.quantization.fp8_math import Codes

    w, ws = _layer(4096, 14336, 7)
    launch = GEMM_LAUNCHES[1]
    x = torch.zeros(48, 14336, device="cuda", dtype=torch.bfloat16)
    codes = Codes(*fp8_linear.quantize_rows(x), torch.bfloat16)
    fp8_linear.fp8_gemm(codes, w, ws, None, launch)  # compiled, tickets allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear.fp8_gemm(codes, w, ws, None, launch)
    for seed in range(3):
        new = torch.randn(
            48, 14336, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)
        )
        q, s = fp8_linear.quantize_rows(new.to(torch.bfloat16))
        codes.codes.copy_(q)
        codes.scales.copy_(s)
        graph.replay()
        assert torch.equal(out, fp8_linear.fp8_gemm(codes, w, ws, None, launch))


def _block_layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in 128 × 128 blocks, each with its scale (outlier input channels make the
    blocks' scales differ), as the layer keeps them: e4m3 [n, k], scales [n, k / 128]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    w[:, :3] *= 20
    wq, blocks = quantize_blocks(w, 128)
    return wq, blocks.repeat_interleave(128, 0)


def test_quantize_groups_is_the_reference_rounding() -> None:
    from services.worker.engine.ops.fp8_block import quantize_groups

    x = torch.randn(37, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")
    codes = quantize_groups(x, 128)
    assert codes.codes.dtype == FP8 and codes.scales.shape == (37, 32)
    cols = torch.arange(4096, device="cuda") // 128
    want = quantize_activations(x, "token_group", 128, None)
    assert torch.equal(codes.codes.float() * codes.scales[:, cols], want)  # bit for bit


@pytest.mark.parametrize("path", ["block-scales", "row-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 300, 2048])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (256, 384)])
def test_fp8_block_mm_matches_the_plain_path(
    dtype: torch.dtype, rows: int, n: int, k: int, path: str
) -> None:
    """Block checkpoints' kernels against the plain path's arithmetic in float64. Given the
    per-block scales (as the layers have them): the GEMV for one row (bf16 with fast
    accumulation), cuBLASLt's block scaling from 16 rows of a 16-bit model (any row count:
    padded to a multiple of four); given per-row scales only: our kernel (the default launch,
    K split where the rows are few). Within the FP8 tensor cores' accumulation error
    (test_fp8_linear_matches_the_plain_path), with the bias; the same bits on a second
    call."""
    from services.worker.engine.ops import fp8_block

    w, ws = _block_layer(n, k, n + k + rows)
    x = (torch.randn(rows, k, device="cuda") * 2).to(dtype)
    b = (torch.randn(n, device="cuda") * 0.1).to(dtype)
    cols = torch.arange(k, device="cuda") // 128
    xq = quantize_activations(x, "token_group", 128, None)
    want = F.linear(xq.double(), dequantize(w, ws, cols).double(), b.double())
    blocks = fp8_block.block_scales(ws, 128) if path == "block-scales" else None
    assert path == "row-scales" or blocks is not None
    fast = rows == 1 and dtype == torch.bfloat16
    calls = []
    scaled_mm = torch._scaled_mm

    def counted(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(a[0].shape[0])
        return scaled_mm(*a, **kw)

    torch._scaled_mm = counted  # type: ignore[assignment]
    try:
        got = fp8_block.fp8_block_mm(x, w, ws, b, 128, blocks, fast_accumulation=fast)
        again = fp8_block.fp8_block_mm(x, w, ws, b, 128, blocks, fast_accumulation=fast)
    finally:
        torch._scaled_mm = scaled_mm  # type: ignore[assignment]
    cublas = blocks is not None and rows >= fp8_block.CUBLAS_BLOCK_ROWS and dtype != torch.float32
    cublas = cublas and k // 128 % 4 == 0  # (with 3 groups it returned wrong products)
    assert bool(calls) == cublas
    assert got.dtype == dtype and got.shape == (rows, n) and torch.equal(got, again)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), float(err)


def _cublas(codes: Any, w: torch.Tensor, ws: torch.Tensor, fast: bool) -> torch.Tensor:
    return torch._scaled_mm(codes.codes, w.t(), scale_a=codes.scales, scale_b=ws.reshape(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip


def test_fp8_mm_takes_our_gemm_where_the_table_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.engine.ops import fp8_linear, gemv_configs
    from services.worker.engine.quantization.fp8_math import Codes

    w, ws = _layer(4096, 4096, 3)
    x = torch.randn(32, 4096, device="cuda").to(torch.bfloat16)
    codes = Codes(*fp8_linear.quantize_rows(x), torch.bfloat16)
    launch = GEMM_LAUNCHES[1]
    monkeypatch.setattr(gemv_configs, "gemm_launch", lambda *a: dict(launch))
    for fast in (True, False):
        ours = fp8_linear.fp8_gemm(codes, w, ws, None, launch, fast_accumulation=fast)
        assert torch.equal(fp8_linear.fp8_mm(x, w, ws, fast_accumulation=fast), ours)
    monkeypatch.setattr(gemv_configs, "gemm_launch", lambda *a: None)
    cublas = _cublas(codes, w, ws, True)
    assert torch.equal(fp8_linear.fp8_mm(x, w, ws, fast_accumulation=True), cublas)


GEMV_LAUNCH = {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3}


@pytest.mark.parametrize("group", [0, 128], ids=["per-token", "groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 300])
def test_the_fused_kernels_hand_over_the_layers_own_codes(
    dtype: torch.dtype, rows: int, group: int
) -> None:
    """RMSNorm (with the residual add) and SiLU·mul writing codes, per token or a scale per
    token and 128 columns (block checkpoints): the codes the layer's own pass writes of their
    plain output (quantize_rows, quantize_groups; bit for bit in bf16); the GEMV / fp8_mm, or
    a block layer's kernels, given a row's codes: exactly their output given the row."""
    from services.worker.engine.ops.fp8_block import (
        block_scales,
        fp8_block_mm,
        quantize_groups,
    )
    from services.worker.engine.ops.fp8_linear import fp8_gemv, fp8_mm, quantize_rows
    from services.worker.engine.ops.fused_ops import add_rms_norm, silu_and_mul
    from services.worker.engine.quantization.fp8_math import Codes

    x = torch.randn(rows, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")
    x, res = x.to(dtype), torch.randn(rows, 4096, device="cuda").to(dtype)
    w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
    h = (torch.randn(rows, 2 * 14336, device="cuda") * 3).to(dtype)
    normed, r1 = add_rms_norm(x, res.clone(), w, 1e-6)
    normed_codes, r2 = add_rms_norm(x, res.clone(), w, 1e-6, group or 4096)
    assert torch.equal(r1, r2)
    pairs = ((normed, normed_codes), (silu_and_mul(h), silu_and_mul(h, group or 14336)))
    for plain, codes in pairs:
        assert isinstance(codes, Codes) and isinstance(plain, torch.Tensor)
        own = quantize_groups(plain, group) if group else Codes(*quantize_rows(plain), dtype)
        q, s = own.codes, own.scales
        assert codes.scales.shape == s.shape and codes.scales.stride() == s.stride()
        differ = codes.codes.view(torch.uint8) != q.view(torch.uint8)
        # the kernels with codes and without compile apart, and their float32 rows may part
        # in the last bit (on an H200: 56 of 300 rows' scales, all codes equal;
        # docs/performance.md, "FP8": the activations as codes). Rounded to bf16 first, a row
        # is mostly the same, but a last-bit difference on a rounding edge moves a bf16 value a
        # step: with 300 random rows one code of millions differed, in two GPU runs of many
        # (the same entry)
        step = 2**-7 if dtype == torch.bfloat16 else 1e-6  # (a bf16 step of the largest value)
        assert torch.allclose(codes.scales, s, rtol=step, atol=0)
        assert differ.float().mean() < (1e-5 if dtype == torch.bfloat16 else 1e-3)
        assert (codes.codes.float() - q.float()).abs().le(q.float().abs() / 8 + 2**-9).all()
        if group:
            wq, ws = _block_layer(1024, plain.shape[1], rows)
            blocks = block_scales(ws, 128)
            got = fp8_block_mm(Codes(q, s, dtype), wq, ws, None, 128, blocks)
            assert torch.equal(got, fp8_block_mm(plain, wq, ws, None, 128, blocks))
            continue
        wq, ws = _layer(1024, plain.shape[1], rows)
        # (the GEMV at one launch: its kept launches with and without codes differ, and so
        # would the order of its sums)
        launch = {"config": GEMV_LAUNCH} if rows == 1 else {}
        fn = fp8_gemv if rows == 1 else fp8_mm
        assert torch.equal(fn(Codes(q, s, dtype), wq, ws, **launch), fn(plain, wq, ws, **launch))


@pytest.mark.parametrize("fast", [False, True], ids=["fp32-accumulation", "fast-accumulation"])
@pytest.mark.parametrize(("fmt", "arch"), [("fp8-tensor", "llama"), ("fp8-channel", "qwen3")])
def test_the_engine_on_the_fp8_kernels_matches_the_dequantizing_reference(
    tmp_path: Path, fmt: str, arch: str, fast: bool
) -> None:
    """float32, checked as on CPU (tests/integration/test_fp8.py): each greedy token is the
    reference's argmax teacher-forced, or a near-tie; almost all are exact, the logprobs agree;
    and both kernels really ran (not the plain path). One prompt at a time, so that decode
    steps have one row (the GEMV) and prefill several (the tensor cores), which with ``fast``
    accumulate without float32 promotion."""
    from services.worker.engine.ops import fp8_linear

    path = make_tiny_model(tmp_path / fmt, arch=arch, quantize=fmt, hidden_size=128)
    calls = {"gemv": 0, "mm": 0}
    gemv, mm = fp8_linear.fp8_gemv, fp8_linear.fp8_mm

    def counted_gemv(*a: Any, **kw: Any) -> torch.Tensor:
        calls["gemv"] += 1
        return gemv(*a, **kw)

    def counted_mm(*a: Any, **kw: Any) -> torch.Tensor:
        calls["mm"] += 1
        return mm(*a, **kw)

    fp8_linear.fp8_gemv, fp8_linear.fp8_mm = counted_gemv, counted_mm  # type: ignore[assignment]
    try:
        llm = LLM(model=str(path), dtype="float32", enforce_eager=True, show_progress=False,
                  fp8_fast_accumulation=fast)  # fmt: skip
        outs = [llm.generate([p], FP8_GREEDY, use_tqdm=False)[0] for p in FP8_PROMPTS]
        llm.shutdown()
    finally:
        fp8_linear.fp8_gemv, fp8_linear.fp8_mm = gemv, mm  # type: ignore[assignment]
    assert calls["gemv"] > 0 and calls["mm"] > 0
    # (the fp8-channel checkpoint quantizes its activations per token: its norms and SiLU·mul
    # hand the layers codes, test_the_fused_kernels_hand_over_the_layers_own_codes)
    # the prompts' KV comes from the tensor cores, whose FP8 accumulation moves an output by
    # up to ~1e-3 of the largest (test_fp8_linear_matches_the_plain_path)
    exact = check_against_fp8_reference(path, outs, median_atol=FP8_GPU_MEDIAN_ATOL[fmt])
    assert exact >= FP8_GPU_EXACT[fmt] * len(FP8_PROMPTS) * FP8_GREEDY.max_tokens


def test_the_engine_on_our_fp8_gemm_matches_the_dequantizing_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our FP8 GEMM at every product of more than one row (prefill and the batched decode
    steps, captured in CUDA graphs, K split in two), in float16 (its outputs are 16-bit):
    teacher-forced against the dequantizing reference as the float32 engine is, with the
    tolerances a 16-bit engine needs."""
    from services.worker.engine.ops import fp8_linear, gemv_configs

    path = make_tiny_model(tmp_path / "m", arch="llama", quantize="fp8-channel", hidden_size=128)
    launch = {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 64, "SPLITS": 2, "num_warps": 4,
              "num_stages": 3}  # fmt: skip
    calls = [0]
    gemm = fp8_linear.fp8_gemm

    def counted(*a: Any, **kw: Any) -> torch.Tensor:
        calls[0] += 1
        return gemm(*a, **kw)

    monkeypatch.setattr(gemv_configs, "gemm_launch", lambda *a: dict(launch))
    monkeypatch.setattr(fp8_linear, "fp8_gemm", counted)
    llm = LLM(model=str(path), dtype="float16", show_progress=False)
    try:
        assert llm.client.core.executor.worker.runner.graphs is not None  # type: ignore[attr-defined]
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)  # decode steps of 4 rows
    finally:
        llm.shutdown()
    assert calls[0] > 0
    exact = check_against_fp8_reference(path, outs, median_atol=3e-2)
    assert exact >= 0.85 * len(FP8_PROMPTS) * FP8_GREEDY.max_tokens


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_engine_on_the_block_kernels_matches_the_dequantizing_reference(
    tmp_path: Path, dtype: str
) -> None:
    """A 128 × 128 block checkpoint on the GPU's block kernels (every linear layer: the GEMV
    for one row, our kernel for a few, and in float16 cuBLASLt's block scaling for the four
    prompts at once; float16 with CUDA graphs, float32 eager), teacher-forced against the
    dequantizing reference as on CPU, with the tolerances of the tensor cores'
    accumulation."""
    from services.worker.engine.ops import fp8_block
    from services.worker.engine.quantization.fp8 import Fp8BlockLinearMethod
    from services.worker.engine.quantization.fp8_math import Codes

    # 128-wide heads: the k and v rows fill whole blocks, so every layer has its block scales
    path = make_tiny_model(tmp_path / "m", arch="llama", quantize="fp8-block", hidden_size=512)
    rows: list[int] = []
    handed: list[bool] = []  # the input came as codes from the fused kernel before
    block_mm = fp8_block.fp8_block_mm

    def counted(x: Any, *a: Any, **kw: Any) -> torch.Tensor:
        handed.append(isinstance(x, Codes))
        rows.append(x.rows if isinstance(x, Codes) else x.shape[0])
        return block_mm(x, *a, **kw)

    fp8_block.fp8_block_mm = counted  # type: ignore[assignment]
    try:
        llm = LLM(model=str(path), dtype=dtype, enforce_eager=dtype == "float32",
                  show_progress=False)  # fmt: skip
        model = llm.client.core.executor.worker.runner.model  # type: ignore[attr-defined]
        layers = [m for m in model.modules()
                  if isinstance(getattr(m, "method", None), Fp8BlockLinearMethod)]  # fmt: skip
        assert layers and all(m.block_scales is not None for m in layers)  # for cuBLASLt
        outs = [llm.generate([p], FP8_GREEDY, use_tqdm=False)[0] for p in FP8_PROMPTS]
        outs_batched = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
        llm.shutdown()
    finally:
        fp8_block.fp8_block_mm = block_mm  # type: ignore[assignment]
    # the GEMV (decode of one prompt), our kernel (decode of four), cuBLASLt (the prompts)
    assert 1 in rows and any(1 < r < 16 for r in rows) and max(rows) >= 16
    # qkv, gate_up and down take codes from RMSNorm and SiLU·mul; o quantizes its own input
    assert 0.7 < sum(handed) / len(handed) < 0.8
    # In float16 (512 wide) the engine rounds each activation to float16 before its e4m3
    # codes, the reference (float32) does not: a code on a rounding edge flips, which moves a
    # logprob by up to FP8_LOGPROB_ATOL, so a near-tie may part by as much (on an H200 a token
    # 0.07 nats under the reference's best, docs/performance.md, "FP8": float16 models).
    # Exact argmaxes stay the measure.
    tie = FP8_LOGPROB_ATOL if dtype == "float16" else FP8_TIE
    exact = check_against_fp8_reference(path, outs, median_atol=3e-2, tie=tie)
    assert exact >= 0.85 * len(FP8_PROMPTS) * FP8_GREEDY.max_tokens
    exact = check_against_fp8_reference(path, outs_batched, median_atol=3e-2, tie=tie)
    assert exact >= 0.85 * len(FP8_PROMPTS) * FP8_GREEDY.max_tokens


def test_cuda_graphs_capture_the_fp8_gemv(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", arch="llama", quantize="fp8-channel", hidden_size=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(model=str(path), dtype="float32", enforce_eager=True, show_progress=False)
    want = [o.outputs[0].token_ids for o in eager.generate(FP8_PROMPTS, params, use_tqdm=False)]
    eager.shutdown()
    graphs = LLM(model=str(path), dtype="float32", show_progress=False)
    assert graphs.client.core.executor.worker.runner.graphs is not None  # type: ignore[attr-defined]
    assert [
        o.outputs[0].token_ids for o in graphs.generate(FP8_PROMPTS, params, use_tqdm=False)
    ] == want
    graphs.shutdown()


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.37, 2.5)], ids=["unit", "scaled"])
def test_the_triton_cache_write_rounds_like_the_reference(k_scale: float, v_scale: float) -> None:
    """The Triton backend's ``write_kv`` into an FP8 cache on the GPU: divided by the layer's
    scales, saturated, rounded to nearest even, bit for bit as ``attention/backend.write_kv``
    (on CPU the backend uses the latter)."""
    from services.worker.engine.attention.backend import write_kv
    from services.worker.engine.attention.triton_backend import TritonAttentionBackend
    from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views

    layout = KVCacheLayout(2, 8, 128, 16, FP8)
    ours, ref = layout.allocate(64, "cuda"), layout.allocate(64, "cuda")
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16) * 200  # some saturate
    v = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    impl = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    views = layer_views(ours, 1), layer_views(ref, 1)
    for view in views:
        view.k_scale, view.v_scale = k_scale, v_scale
    impl.write_kv(k, v, views[0], slots)
    write_kv(k, v, views[1], slots)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


def test_an_fp8_cache_on_the_triton_kernels_matches_the_torch_backend(tiny_model: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_model), dtype="float32", kv_cache_dtype="fp8",
                  attention_backend=backend, show_progress=False)  # fmt: skip
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(FP8_PROMPTS, params)]
        llm.shutdown()
    assert outs["triton"] == outs["torch"]
