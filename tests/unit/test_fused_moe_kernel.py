"""The fused MoE kernels (ops/fused_moe.py) in Triton's interpreter on CPU, at tiny shapes (E 4,
H and I 64): the align step's layout, and the experts against ``fused_moe_reference``.

The interpreter's ``tl.dot`` multiplies bfloat16 as integers, so the 16-bit checks here run in
float16 (the same rounding points); bf16 runs on the GPU (tests/gpu/test_fused_moe.py). Its
float32 → e4m3 cast also rounds some codes differently from PyTorch's
(tests/unit/test_fp8_kernels.py), so the FP8 experts are checked against the product of the
codes the kernel's own quantizer writes (``quantize_input``); on the GPU, where that cast is
right, against the reference's rounding."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.ops import gemv_configs
from services.worker.engine.ops import moe_gemv as moe_gemv_module
from services.worker.engine.ops.fused_moe import (
    MoELaunch,
    align,
    fused_moe,
    fused_moe_reference,
    quantize_input,
    supported,
)
from services.worker.engine.ops.moe_gemv import measured_launch, moe_gemv
from services.worker.engine.quantization.fp8_math import (
    FP8,
    Codes,
    quantize_blocks,
    quantize_rows,
)

E, H, INTER = 4, 64, 64  # local experts, hidden, intermediate
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter's CPU tensors)


def _routing(
    t: int, k: int, local_half: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Routing weights, global expert ids [T, k] (int32) and the expert map: without
    ``local_half`` the E experts are all local; with it 2E experts, the odd ones here (local
    index id // 2), the even ones on another rank."""
    g = torch.Generator().manual_seed(seed)
    experts = 2 * E if local_half else E
    weights, ids = torch.randn(t, experts, generator=g).softmax(-1).topk(k, -1)
    if not local_half:
        return weights.to(DEVICE), ids.int().to(DEVICE), None
    emap = torch.full((experts,), -1, dtype=torch.int32)
    emap[1::2] = torch.arange(E, dtype=torch.int32)
    return weights.to(DEVICE), ids.int().to(DEVICE), emap.to(DEVICE)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTER, H, generator=g).to(DEVICE) * H**-0.5,
            torch.randn(E, H, INTER, generator=g).to(DEVICE) * INTER**-0.5)  # fmt: skip


def _tokens(t: int, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    return (torch.randn(t, H, generator=torch.Generator().manual_seed(t)) * scale).to(DEVICE)


@pytest.mark.parametrize(("t", "k", "local_half"), [(1, 1, False), (5, 2, True), (33, 2, True),
                                                    (40, 1, True), (9, 2, False)])  # fmt: skip
def test_align_groups_the_local_pairs_in_padded_runs(t: int, k: int, local_half: bool) -> None:
    """Every local pair exactly once, in an M-block of its expert; each expert's run the
    fewest whole blocks that hold it, in expert order, padded with the sentinel T·k; no pair
    of another rank's expert anywhere."""
    _, ids, emap = _routing(t, k, local_half, seed=t * 10 + k)
    al = align(ids, emap, E, block_m=16)
    local = (emap.long()[ids.long()] if emap is not None else ids.long()).reshape(-1)
    padded = int(al.num_padded)
    counts = torch.bincount(local[local >= 0], minlength=E)
    assert padded == int(((counts + 15) // 16 * 16).sum()) and padded <= al.max_blocks * 16
    rows = al.sorted_ids[:padded].long().view(-1, 16)
    experts = al.block_expert[: padded // 16].long()
    runs = torch.repeat_interleave(torch.arange(E, device=DEVICE), (counts + 15) // 16)
    assert torch.equal(experts, runs)
    real = rows < t * k
    assert torch.equal(local[rows[real]], experts[:, None].expand_as(rows)[real])
    assert torch.equal(rows[real].sort().values, torch.nonzero(local >= 0).flatten())
    assert (rows[~real] == t * k).all()


PATHS = {"grouped": False, "gemv": True}  # the grouped GEMMs or the few-token GEMVs


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_fused_moe_is_the_reference(t: int, k: int, dtype: torch.dtype, path: str) -> None:
    """Half the experts on this rank (k = 2, 3: a top-k not a power of two) or all of them
    (k = 1): the reference's sums over the local experts, rounded at the same points (one
    float16 step at most), by either path."""
    weights, ids, emap = _routing(t, k, local_half=k > 1, seed=t + k)
    w13, w2 = (w.to(dtype) for w in _weights(seed=t))
    x = _tokens(t).to(dtype)
    got = fused_moe(x, w13, w2, weights, ids, expert_map=emap, gemv=PATHS[path])
    want = fused_moe_reference(x, w13, w2, weights, ids, expert_map=emap)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and got.shape == (t, H)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if emap is not None:  # the other rank's experts would have changed it
        everything = fused_moe_reference(x, w13, w2, weights, emap.clamp(min=0)[ids.long()])
        assert (everything - want).abs().max() > 100 * tol


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("t", [1, 5, 33])
def test_gpt_oss_experts_biases_and_clamped_swiglu(t: int, dtype: torch.dtype, path: str) -> None:
    """gpt-oss's experts in the kernels: the gate/up and down biases and the clamped SwiGLU
    (limit 1, so the clamps bind at these scales) equal the reference's, which
    ``FusedMoE.activate``'s arithmetic defines; without them the result is another."""
    weights, ids, emap = _routing(t, 2, local_half=True, seed=t)
    w13, w2 = (w.to(dtype) for w in _weights(seed=t))
    g = torch.Generator().manual_seed(100 + t)
    b13 = (0.5 * torch.randn(E, 2 * INTER, generator=g)).to(DEVICE, dtype)
    b2 = (0.5 * torch.randn(E, H, generator=g)).to(DEVICE, dtype)
    x = _tokens(t, 3.0).to(dtype)
    kw: dict[str, Any] = {"expert_map": emap, "w13_bias": b13, "w2_bias": b2,
                          "swiglu_limit": 1.0, "swiglu_alpha": 1.702}  # fmt: skip
    got = fused_moe(x, w13, w2, weights, ids, **kw, gemv=PATHS[path])
    want = fused_moe_reference(x, w13, w2, weights, ids, **kw)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    gate_up = F.linear(x[:1].float(), w13[0].float(), b13[0].float())
    assert gate_up.abs().max() > 1.0  # (the clamps bind)
    for other in ({**kw, "swiglu_limit": None}, {**kw, "w13_bias": None, "w2_bias": None}):
        assert (fused_moe_reference(x, w13, w2, weights, ids, **other) - want).abs().max() > 0.01


@pytest.mark.parametrize("path", list(PATHS))
def test_a_tokens_slots_are_added_in_slot_order(path: str) -> None:
    """Three slots of three identical experts, weighted 2^24, 1, 1: each slot's row is exactly
    v · weight (v: one slot's row, weight 1), and their float32 sum depends on the order; the
    kernels add them in slot order (0, 1, 2), as the sum step has always done."""
    w13, w2 = (w[:1].repeat(3, 1, 1) for w in _weights(seed=7))
    x = _tokens(1)
    first = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    one = fused_moe(x, w13, w2, torch.ones(1, 1, device=DEVICE), first, gemv=PATHS[path])
    big = torch.tensor(2.0**24, device=DEVICE)
    ids = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.stack([big, torch.ones_like(big), torch.ones_like(big)]).reshape(1, 3)
    got = fused_moe(x, w13, w2, weights, ids, gemv=PATHS[path])
    in_order = (one * big + one) + one
    reversed_order = (one + one) + one * big
    assert not torch.equal(in_order, reversed_order)  # (the order shows)
    assert torch.equal(got, in_order)


@pytest.mark.parametrize("t", [2, 6], ids=["gemv", "grouped"])  # (each path's default)
def test_fused_moe_writes_out_and_takes_int64_ids(t: int) -> None:
    weights, ids, _ = _routing(t, 2, local_half=False, seed=3)
    w13, w2 = _weights(seed=4)
    x = _tokens(t)
    out = torch.full((t, H), float("nan"), device=DEVICE)
    got = fused_moe(x, w13, w2, weights, ids.long(), out=out)
    assert got is out
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids))


def _fp8(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight in e4m3: (codes [E, rows, cols], per-channel scales [E, rows, 1] or
    per-block [E, ⌈rows/b⌉, ⌈cols/b⌉])."""
    parts = [quantize_rows(we) if block is None else quantize_blocks(we, block) for we in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def _dequantize_codes(codes: Codes, block: int | None) -> torch.Tensor:
    cols = torch.arange(codes.codes.shape[1], device=DEVICE) // (block or codes.codes.shape[1])
    return codes.codes.double() * codes.scales.double()[:, cols]


def _dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None:
        return w.double() * scale.double().reshape(-1, 1)
    rows = scale.double().repeat_interleave(block, 0)[: w.shape[0]]
    return w.double() * rows[:, torch.arange(w.shape[1], device=DEVICE) // block]


def _product_of_codes(
    x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor, emap: torch.Tensor | None, block: int | None,
) -> torch.Tensor:  # fmt: skip
    """The FP8 experts over the codes the kernel's quantizer writes, x's and h's, in float64
    (h rounded to float32, x's dtype, before it is quantized, as the kernel rounds it)."""
    local = emap.long()[ids.long()] if emap is not None else ids.long()
    out = torch.zeros(x.shape, dtype=torch.float64, device=DEVICE)
    for e in range(w13.shape[0]):
        tokens, slots = torch.where(local == e)
        xd = _dequantize_codes(quantize_input(x[tokens], block), block)
        gate, up = (xd @ _dequantize_weight(w13[e], s13[e], block).T).float().chunk(2, -1)
        hd = _dequantize_codes(quantize_input(F.silu(gate) * up, block), block)
        y = (hd @ _dequantize_weight(w2[e], s2[e], block).T).float()
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).double())
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("block", [None, 32], ids=["channel", "block32"])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_fp8_experts_are_the_product_of_their_codes(t: int, block: int | None, path: str) -> None:
    """Per-channel and block (32 × 32 here: H and I of two blocks) e4m3 experts, half on this
    rank: the product of the activations' codes and scales (x's per token or per token and
    group, h's likewise) with the dequantized weights; and the reference's result to within
    FP8's error plus the interpreter's cast (above: the same arithmetic, other codes)."""
    weights, ids, emap = _routing(t, 2, local_half=True, seed=t)
    w13, w2 = _weights(seed=t + 1)
    (q13, s13), (q2, s2) = _fp8(w13, block), _fp8(w2, block)
    x = _tokens(t, torch.linspace(0.1, 4, H))
    kw = {"expert_map": emap, "w13_scale": s13, "w2_scale": s2, "block": block}
    got = fused_moe(x, q13, q2, weights, ids, **kw, gemv=PATHS[path])  # type: ignore[arg-type]
    exact = _product_of_codes(x, q13, s13, q2, s2, weights, ids, emap, block)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    want = fused_moe_reference(x, q13, q2, weights, ids, **kw)  # type: ignore[arg-type]
    assert (got - want).norm() < 0.2 * want.norm()
    if block is not None and path == "grouped":  # h's codes from a pass after GEMM 1, or its
        # epilogue (a tile a group)
        fused = MoELaunch(block_m=16, block_n=2 * block, block_k=block)
        assert torch.equal(fused_moe(x, q13, q2, weights, ids, **kw, config=fused), got)  # type: ignore[arg-type]


LAUNCHES = [  # (GEMV 1's, GEMV 2's): tiles that divide the shapes, and rows that overhang them
    ({"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3},
     {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 2, "num_stages": 1}),
    ({"BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 1},
     {"BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}),
]  # fmt: skip


@pytest.mark.parametrize("launches", LAUNCHES, ids=["dividing", "overhanging"])
@pytest.mark.parametrize("block", [None, 32], ids=["float", "fp8-block32"])
def test_the_gemvs_compute_the_same_at_any_given_launch(
    launches: tuple[dict[str, int], dict[str, int]], block: int | None
) -> None:
    """``moe_gemv``'s given launches (the tuner's, or a GPU's measured table's) change its
    tiles and grids, not its result: the default launch's up to float32 summation order."""
    weights, ids, emap = _routing(1, 2, local_half=True, seed=3)
    w13, w2 = _weights(seed=4)
    x = _tokens(1, torch.linspace(0.1, 4, H))
    s13 = s2 = None
    if block:
        (w13, s13), (w2, s2) = _fp8(w13, block), _fp8(w2, block)
    args = (x, w13, w2, weights, ids, emap, s13, s2, block)
    default = moe_gemv(*args, torch.empty_like(x), None, None, None, 1.702)
    given = moe_gemv(*args, torch.empty_like(x), None, None, None, 1.702, launches=launches)
    torch.testing.assert_close(given, default, rtol=1e-5, atol=1e-6)
    assert given.abs().max() > 0


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("launches", LAUNCHES, ids=["dividing", "overhanging"])
@pytest.mark.parametrize("block", [None, 32], ids=["channel", "block32"])
def test_fp8_gemvs_quantizing_their_own_activations_change_no_bit(
    t: int, launches: tuple[dict[str, int], dict[str, int]], block: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """FP8 experts, half on this rank: GEMV 1 making x's codes and GEMV 2 making h's
    (``QUANTIZE_TOKENS``) give the very result of the two quantizing launches between them
    (the same codes and scales, the same sums at one launch: the autotuner tunes the two apart),
    per channel and per 32-wide block, tiles within one block and across two."""
    weights, ids, emap = _routing(t, 2, local_half=True, seed=5)
    w13, w2 = _weights(seed=6)
    (q13, s13), (q2, s2) = _fp8(w13, block), _fp8(w2, block)
    x = _tokens(t, torch.linspace(0.1, 4, H))
    args = (x, q13, q2, weights, ids, emap, s13, s2, block)
    results = []
    for tokens in (0, t):
        monkeypatch.setattr(moe_gemv_module, "QUANTIZE_TOKENS", tokens)
        out = torch.empty_like(x)
        results.append(
            moe_gemv(*args, out, None, None, None, 1.702, launches=launches or (None, None))
        )
    assert torch.equal(results[0], results[1]) and results[0].abs().max() > 0


class _Launches:
    """A Triton kernel whose launches are recorded: (grid, tile keywords), then run."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.seen = kernel, []  # type: ignore[var-annotated]

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kw: Any) -> Any:
            tiles = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
            self.seen.append((grid, {k: kw[k] for k in tiles if k in kw}))
            return self.kernel[grid](*args, **kw)

        return launch


def test_the_given_then_the_measured_launch_reaches_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``moe_gemv`` launches GEMV 1 and GEMV 2 with the tiles it is given, else the GPU
    table's (a stand-in here), else (on CPU) the interpreter's tile, each with its grid: a
    program a pair and BLOCK_N rows of I, a program a token and BLOCK_N columns of H."""
    up_spy = _Launches(moe_gemv_module._gemv_up_kernel)
    down_spy = _Launches(moe_gemv_module._gemv_down_kernel)
    monkeypatch.setattr(moe_gemv_module, "_gemv_up_kernel", up_spy)
    monkeypatch.setattr(moe_gemv_module, "_gemv_down_kernel", down_spy)
    weights, ids, _ = _routing(1, 2, local_half=False, seed=5)
    w13, w2 = _weights(seed=5)
    x = _tokens(1)
    up, down = LAUNCHES[0]
    table = {"moe_up": LAUNCHES[1][0], "moe_down": LAUNCHES[1][1]}

    def run(launches: tuple[dict[str, int] | None, dict[str, int] | None]) -> None:
        args = (x, w13, w2, weights, ids, None, None, None, None, torch.empty_like(x))
        moe_gemv(*args, None, None, None, 1.702, launches=launches)

    run((up, down))
    monkeypatch.setattr(gemv_configs, "launch", lambda kind, *_: table.get(kind))
    run((None, None))
    monkeypatch.setattr(gemv_configs, "launch", lambda *_: None)
    run((None, None))
    interpreter = {"BLOCK_N": 16, "BLOCK_K": 32}
    assert up_spy.seen == [((2, INTER // 8), up), ((2, 1), table["moe_up"]),
                           ((2, INTER // 16), interpreter)]  # fmt: skip
    assert down_spy.seen == [((1, H // 4), down), ((1, 1), table["moe_down"]),
                             ((1, H // 16), interpreter)]  # fmt: skip


def test_a_measured_launch_holds_at_one_token_within_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``measured_launch`` reads the kind of the weights' format and the expert's [N, K] from
    the GPU's table (here a stand-in), at one token only, and never K tiles across scale
    blocks."""
    tile = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    asked: list[tuple[str, int, int]] = []

    def table(kind: str, x: torch.Tensor, n: int, k: int) -> dict[str, int]:
        asked.append((kind, n, k))
        return tile

    monkeypatch.setattr(gemv_configs, "launch", table)
    w13, w2 = _weights(seed=0)
    q13, q2 = w13.to(FP8), w2.to(FP8)
    one, two = torch.randn(1, H), torch.randn(2, H)
    assert measured_launch("up", one, w13, None) == tile
    assert measured_launch("down", one, q2, None) == tile
    assert measured_launch("up", one, q13, 128) == tile
    assert measured_launch("up", one, q13, 64) is None  # 128-wide K tiles over 64-wide blocks
    assert measured_launch("up", two, w13, None) is None  # more tokens: the autotuner's
    block_up = ("moe_up_fp8_block", 2 * INTER, H)
    assert asked == [("moe_up", 2 * INTER, H), ("moe_down_fp8", H, INTER), block_up, block_up]


def test_the_kernels_take_cuda_tensors_only() -> None:
    w13, _ = _weights(seed=0)
    assert not supported(torch.randn(2, H), w13.cpu())
