"""Matrix-vector product for one token (batch-1 decode): ``y = x Wᵀ (+ b)``, x: [1, K].

At one token a linear layer is a weight read: cuBLAS reaches ≈ 4.1 TB/s on the large MLP
projections of an 8B model but ≈ 3.1 TB/s on the smaller qkv and o projections, and splits K
over a second reduction kernel (docs/performance.md, "Where the time goes": cuBLAS ≈ 4.1 and
≈ 3.1 TB/s). Here each
program reads ``BLOCK_N`` whole rows in ``BLOCK_K`` chunks, accumulates in float32 and rounds
once, as a bf16 GEMM does; the tile sizes are tuned per (N, K) on first use (before CUDA
graph capture: the capture's warm-up forwards run it eagerly). ``benchmarks/kernels/gemv.py``
compares it with cuBLAS and cuBLASLt per shape.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.engine.ops import gemv_configs
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options


@triton.jit
def _gemv_kernel(
    X, W, B, Y, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    # the first weight tile is read before waiting for the kernel before (no kernel of a step
    # writes weights), so with PDL that read overlaps the previous kernel's tail
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    await_inputs(USE_PDL)
    x = tl.load(X + cols, mask=col_ok, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(X + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (1, 2048, 4, 3), (2, 1024, 4, 3), (2, 2048, 8, 3), (4, 512, 4, 3), (4, 1024, 4, 3),
        (4, 1024, 8, 3), (4, 2048, 8, 2), (8, 512, 4, 3), (8, 512, 8, 4), (8, 1024, 8, 3),
        (16, 256, 4, 4), (16, 512, 8, 3), (32, 256, 8, 3),
    ]
]  # fmt: skip
_gemv_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "HAS_BIAS"])(_gemv_kernel)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] (rows contiguous); returns [1, N] in the wider of their
    dtypes (a float32 weight takes a 16-bit x as it is, widening it as it reads it: the
    product of ``x.float()``, without a launch to cast it). ``config``: this launch's
    BLOCK_N, BLOCK_K, num_warps and num_stages (the tuner's); else this GPU's measured one
    (ops/gemv_configs.py), else the autotuner's."""
    assert x.shape[0] == 1 and weight.stride(1) == 1, "one token, row-major weight"
    x = x.contiguous()
    n, k = weight.shape
    y = torch.empty((1, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    b = bias if bias is not None else y  # (unused without HAS_BIAS)
    args = (x, weight, b, y, n, k, weight.stride(0))
    if x.is_cuda:
        config = config or gemv_configs.launch("gemv", x, n, k)
        if config is not None:
            _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
                *args, HAS_BIAS=bias is not None, **config, **launch_options(x)
            )
            return y
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _gemv_tuned[grid](*args, HAS_BIAS=bias is not None, **launch_options(x))
    else:  # Triton's interpreter (tests on CPU): one fixed tile, nothing to tune
        _gemv_kernel[(triton.cdiv(n, 4),)](
            *args, HAS_BIAS=bias is not None, BLOCK_N=4, BLOCK_K=64
        )  # fmt: skip
    return y


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: bool
) -> torch.Tensor:
    """``F.linear`` of x in the weight's dtype, or with ``kernels`` for one token on a GPU
    ``gemv`` (a float linear layer's product; a router's, whose float32 weight reads a 16-bit x
    as it is)."""
    if kernels and x.is_cuda and x.shape[0] == 1:
        return gemv(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias)
