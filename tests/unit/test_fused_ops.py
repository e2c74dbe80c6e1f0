"""Fused Triton kernels against the PyTorch layer code they replace (interpreter on CPU)."""

import pytest
import torch

from services.worker.engine.attention.backend import LayerKVCache
from services.worker.engine.model_config import RopeConfig
from services.worker.engine.models.layers.activation import SiluAndMul
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.ops.fused_ops import ROTARY_HEAD_TOKENS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def pair(cls, *args):  # type: ignore[no-untyped-def]
    """The same layer twice: the PyTorch version and the fused one, sharing weights."""
    ref, fused = cls(*args, fused=False), cls(*args, fused=True)
    fused.load_state_dict(ref.state_dict())
    return ref.to(DEVICE), fused.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_residual(dtype: torch.dtype) -> None:
    ref, fused = pair(RMSNorm, 48, 1e-6)
    ref.weight.data = torch.rand(48, device=DEVICE) + 0.5
    fused.weight.data = ref.weight.data.clone()
    ref, fused = ref.to(dtype), fused.to(dtype)
    x = torch.randn(5, 48, device=DEVICE, dtype=dtype)
    res = torch.randn(5, 48, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(fused(x), ref(x), atol=TOL[dtype], rtol=TOL[dtype])
    y_ref, r_ref = ref.forward_residual(x, res.clone())
    y, r = fused.forward_residual(x, res.clone())
    torch.testing.assert_close(r, r_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_per_head_on_a_strided_view() -> None:
    ref, fused = pair(RMSNorm, 16, 1e-6)
    qkv = torch.randn(7, 4 * 16 + 2 * 16, device=DEVICE)
    q = qkv[:, : 4 * 16].view(7, 4, 16)  # not contiguous across tokens
    torch.testing.assert_close(fused(q), ref(q))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    ref, fused = pair(SiluAndMul)
    x = torch.randn(6, 2 * 40, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(fused(x), ref(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "rope", [RopeConfig(10000.0), RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64)]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# on a GPU a head per program (few tokens), then a whole q or k per program (in Triton's
# interpreter always the latter), 3 q heads in a tile of 4; in the interpreter one token a
# program (1: as a GPU runs each), up to ROTARY_INTERPRETER_TOKENS, the last program part empty
@pytest.mark.parametrize("tokens", [1, 9, ROTARY_HEAD_TOKENS + 6])
def test_rotary_in_place(rope: RopeConfig, dtype: torch.dtype, tokens: int) -> None:
    ref, fused = pair(RotaryEmbedding, 32, 256, rope)
    qkv = torch.randn(tokens, (3 + 2 + 2) * 32, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 256, (tokens,), device=DEVICE)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, : 3 * 32].view(tokens, 3, 32), t[:, 3 * 32 : 5 * 32].view(tokens, 2, 32)

    q_ref, k_ref = ref(positions, *split(qkv.clone()))
    fused_qkv = qkv.clone()
    q, k = fused(positions, *split(fused_qkv))
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(fused_qkv[:, 5 * 32 :], qkv[:, 5 * 32 :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, ROTARY_HEAD_TOKENS + 6])
def test_interleaved_rotary_in_place_on_mla_views(dtype: torch.dtype, tokens: int) -> None:
    """DeepSeek's adjacent pairs, as MLA's layer hands them: q's rotary part, the last 8 of
    each 24-wide head, and the latent projection's last 8, each a strided view; the kernel
    rotates them where they lie, in halves, as the PyTorch path does (the pairs gathered into
    halves, then rotated: bit for bit in the interpreter; on a GPU within the ulp its fused
    multiply-adds move), and leaves the rest of both tensors alone."""
    rope = RopeConfig(10000.0)
    ref, fused = pair(lambda *a, fused: RotaryEmbedding(*a, fused=fused, interleaved=True), 8,
                      256, rope)  # fmt: skip
    q = torch.randn(tokens, 3, 24, device=DEVICE, dtype=dtype)
    latent = torch.randn(tokens, 40, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 256, (tokens,), device=DEVICE)
    q_ref, k_ref = ref(positions, q[..., 16:], latent[:, 32:].unsqueeze(1))
    q_got, k_got = q.clone(), latent.clone()
    fused(positions, q_got[..., 16:], k_got[:, 32:].unsqueeze(1))
    if DEVICE == "cpu":
        assert torch.equal(q_got[..., 16:], q_ref) and torch.equal(k_got[:, 32:], k_ref[:, 0])
    torch.testing.assert_close(q_got[..., 16:], q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k_got[:, 32:], k_ref[:, 0], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(q_got[..., :16], q[..., :16]) and torch.equal(k_got[:, :32], latent[:, :32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [7, ROTARY_HEAD_TOKENS + 6])
def test_qk_norm_fused_into_rotary(dtype: torch.dtype, tokens: int) -> None:
    """Qwen3's per-head q/k norms inside the rotary kernel: the same numbers as the PyTorch
    layers and as the two fused kernels it replaces (bit for bit in the interpreter; on a GPU
    the two kernels' float32 sums may associate differently, so within a unit in the last
    place)."""
    from services.worker.engine.ops.fused_ops import rms_norm

    ref, fused = pair(RotaryEmbedding, 32, 256, RopeConfig(1e6))
    norms = []
    for _ in range(2):
        nref, nfused = pair(RMSNorm, 32, 1e-6)
        nref.weight.data = torch.rand(32, device=DEVICE) + 0.5
        nfused.weight.data = nref.weight.data.clone()
        norms.append((nref.to(dtype), nfused.to(dtype)))
    qkv = torch.randn(tokens, (4 + 2 + 2) * 32, device=DEVICE, dtype=dtype) * 3
    positions = torch.randint(0, 256, (tokens,), device=DEVICE)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, : 4 * 32].view(tokens, 4, 32), t[:, 4 * 32 : 6 * 32].view(tokens, 2, 32)

    q_ref, k_ref = ref(positions, *split(qkv.clone()), (norms[0][0], norms[1][0]))
    q, k = fused(positions, *split(qkv.clone()), (norms[0][1], norms[1][1]))
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    q2, k2 = split(qkv.clone())
    q2, k2 = rms_norm(q2, norms[0][1].weight, 1e-6), rms_norm(k2, norms[1][1].weight, 1e-6)
    q2, k2 = fused(positions, q2, k2)
    if DEVICE == "cpu":
        assert torch.equal(q, q2) and torch.equal(k, k2)
    torch.testing.assert_close(q, q2, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k2, atol=TOL[dtype], rtol=TOL[dtype])


def _strided_cache(blocks: int, block_size: int, heads: int, d: int, dtype: torch.dtype,
                   scales: tuple[float, float] = (1.0, 1.0)) -> LayerKVCache:  # fmt: skip
    """Keys and values as strided views of one tensor, a block's keys beside its values (as
    the engine's layout keeps a block together), filled with a marker."""
    whole = torch.full((blocks, 2, block_size, heads, d), 0.5, device=DEVICE).to(dtype)
    return LayerKVCache(whole[:, 0], whole[:, 1], *scales)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens,qk_norm", [(5, False), (ROTARY_HEAD_TOKENS + 6, True)], ids=["few-rope", "many-qk-norm"]
)
def test_rotary_stores_keys_and_values(
    dtype: torch.dtype, tokens: int, qk_norm: bool, kv_dtype: torch.dtype | None
) -> None:
    """The fused rotary with a cache to store into: q rotated in place; the cache holds what
    the fused rotary and then the attention backend's own write put there (bit for bit: same
    rounding, FP8 included), within rounding of the PyTorch layers; k is left as it was; no
    slot but the step's is touched (the slots are scattered, one past a block's start)."""
    from services.worker.engine.attention.triton_backend import TritonAttentionBackend

    heads_q, heads_k, d, block_size, blocks = 4, 2, 32, 8, 40
    ref, fused = pair(RotaryEmbedding, d, 256, RopeConfig(1e4))
    norms = None
    if qk_norm:
        norms = []
        for _ in range(2):
            nref, nfused = pair(RMSNorm, d, 1e-6)
            nref.weight.data = torch.rand(d, device=DEVICE) + 0.5
            nfused.weight.data = nref.weight.data.clone()
            norms.append((nref.to(dtype), nfused.to(dtype)))
    qkv = torch.randn(tokens, (heads_q + 2 * heads_k) * d, device=DEVICE, dtype=dtype) * 3
    positions = torch.randint(0, 256, (tokens,), device=DEVICE)
    slots = (torch.randperm(blocks * block_size - 1, device=DEVICE)[:tokens] + 1).long()

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([heads_q * d, heads_k * d, heads_k * d], dim=-1)
        return q.view(tokens, heads_q, d), k.view(tokens, heads_k, d), v.view(tokens, heads_k, d)

    scales = (0.75, 1.5) if kv_dtype is not None else (1.0, 1.0)
    cache_dtype = kv_dtype or dtype
    got = _strided_cache(blocks, block_size, heads_k, d, cache_dtype, scales)
    q, k, v = split(qkv.clone())
    k_before = k.clone()
    fused_norms = (norms[0][1], norms[1][1]) if norms else None
    q = fused.forward_and_store(positions, q, k, v, got, slots, fused_norms)
    assert torch.equal(k, k_before)  # left as it was: the cache holds the rotated keys

    # the two launches it replaces: the fused rotary in place, then the backend's write
    want = _strided_cache(blocks, block_size, heads_k, d, cache_dtype, scales)
    q2, k2, v2 = split(qkv.clone())
    q2, k2 = fused(positions, q2, k2, fused_norms)
    TritonAttentionBackend(heads_q, heads_k, d, d**-0.5).write_kv(k2, v2, want, slots)
    assert torch.equal(q, q2)
    assert torch.equal(got.key.float(), want.key.float())
    assert torch.equal(got.value.float(), want.value.float())

    # and the PyTorch layers: rotary, then attention/backend.write_kv
    plain = _strided_cache(blocks, block_size, heads_k, d, cache_dtype, scales)
    q3, k3, v3 = split(qkv.clone())
    q3 = ref.forward_and_store(positions, q3, k3, v3, plain,
                               slots, (norms[0][0], norms[1][0]) if norms else None)  # fmt: skip
    torch.testing.assert_close(q, q3, atol=TOL[dtype], rtol=TOL[dtype])
    untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    for cache, plain_view in ((got.key, plain.key), (got.value, plain.value)):
        flat, plain_flat = cache.flatten(0, 1).float(), plain_view.flatten(0, 1).float()
        assert bool((flat[untouched] == 0.5).all())
        # an FP8 cache: within one e4m3 step (1/8 relative) of the reference's rounding
        tol = 0.13 if kv_dtype is not None else TOL[dtype] * 4
        torch.testing.assert_close(flat[slots], plain_flat[slots], atol=tol, rtol=tol)


def test_rotary_store_refuses_values_of_another_shape() -> None:
    _, fused = pair(RotaryEmbedding, 32, 256, RopeConfig(1e4))
    q, k = torch.randn(3, 4, 32, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE)
    cache = _strided_cache(4, 8, 2, 32, torch.float32)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="k's shape"):
        fused.forward_and_store(torch.arange(3, device=DEVICE), q, k, k[:, :1], cache, slots)
    with pytest.raises(ValueError, match="a slot per token"):
        fused.forward_and_store(torch.arange(3, device=DEVICE), q, k, k, cache, slots[:2])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(37, 70), (64, 256), (5, 1030), (3, 40)])
def test_gemv_equals_linear(n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """One token through the Triton GEMV equals F.linear (sizes off the tiles: masked edges;
    a K shorter than one tile: only the tile read before the loop)."""
    import torch.nn.functional as F

    from services.worker.engine.ops.gemv import gemv

    w = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    got = gemv(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got, F.linear(x, w, b), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_float32_weight_widens_a_16_bit_x_as_it_reads_it(x_dtype: torch.dtype) -> None:
    """A float32 gate (DeepSeek's router) given the model's 16-bit x: float32 logits, the
    very products of ``x.float()`` (no cast launch before the GEMV); ``linear``'s CPU path
    casts x to the weight's dtype (F.linear takes no mixed dtypes)."""
    from services.worker.engine.ops.gemv import gemv, linear

    if x_dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 arithmetic here; runs on the GPU")
    torch.manual_seed(0)
    w = torch.randn(13, 200, device=DEVICE) / 200**0.5
    x = torch.randn(1, 200, device=DEVICE).to(x_dtype)
    launch = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}  # (one for both)
    got = gemv(x, w, config=launch)
    assert got.dtype == torch.float32
    assert torch.equal(got, gemv(x.float(), w, config=launch))  # the same products, order
    want = torch.nn.functional.linear(x.float().cpu(), w.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.cpu(), w.cpu(), None, True), want, rtol=0, atol=0)


def test_linear_layers_take_the_gemv_for_one_token_on_a_gpu_only() -> None:
    """The unquantized method on the engine's kernels routes a one-token GPU input through the
    GEMV; anything else (several tokens, or CPU tensors) stays on F.linear, so CPU engines are
    unchanged."""
    from unittest import mock

    from services.worker.engine.models.layers.linear import RowParallelLinear
    from services.worker.engine.ops import gemv as gemv_mod
    from services.worker.engine.quantization.unquantized import UnquantizedLinearMethod

    layer = RowParallelLinear(8, 4, method=UnquantizedLinearMethod(kernels=True))
    layer.weight.data.normal_()
    with mock.patch.object(gemv_mod, "gemv", wraps=gemv_mod.gemv) as spy:
        layer(torch.randn(1, 8))
        layer(torch.randn(3, 8))
        assert spy.call_count == 0  # CPU tensors: F.linear
        if DEVICE == "cuda":
            layer.cuda()(torch.randn(1, 8, device="cuda"))
            layer(torch.randn(3, 8, device="cuda"))
            assert spy.call_count == 1


def test_kernels_launch_without_pdl_on_cpu() -> None:
    """Triton's interpreter has no programmatic dependent launch: CPU launches ask for none
    (on a GPU, tests/gpu/test_dependent_launch.py checks the launches that do)."""
    from services.worker.engine.ops.dependent_launch import launch_options

    assert launch_options(torch.zeros(1)) == {"USE_PDL": False}
