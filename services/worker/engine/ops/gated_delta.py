"""The token mixer of Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's linear attention) over
a batch of variable-length sequences whose recurrent states live in pages of a paged cache.

Two ops, each a plain-PyTorch path (CPU: the engine's and the tests' reference) and Triton
kernels (CUDA tensors; in the tests, Triton's interpreter on CPU):

- ``causal_conv1d``: the depthwise causal convolution (kernel K, no bias) and SiLU over the
  concatenated q/k/v projections, each sequence continuing from the K-1 inputs it saw last;
- ``gated_delta_rule``: the gated delta rule's recurrence over a [dk, dv] state per value head.

The batch is token-major, sequence i the rows ``query_start_loc[i]:query_start_loc[i+1]``;
rows from ``query_start_loc[B]`` on are padding, which no state sees and whose output is
unspecified. Each sequence reads its state from page ``state_src[i]`` (zeros where
``has_state[i]`` is false) and leaves its final state in page ``state_dst[i]``; the two may
be one page (in place) or two (the source page is then left as it was)::

    conv, sequence i, L tokens, K = 4:
        | conv_state[src]: x_-3 x_-2 x_-1 | x_0 x_1 ... x_L-1 |     (zeros without a state)
          y_t = silu(sum_j w[:, j] · x_(t-3+j))        conv_state[dst] <- x_L-3 x_L-2 x_L-1

    delta rule, value head h (key head h // (Hv // Hk)), per token t, in float32:
        q, k L2-normalised, q scaled by dk^-1/2
        S <- exp(g_t) S;   S <- S + k_t ⊗ beta_t (v_t - Sᵀ k_t);   o_t = Sᵀ q_t
        S: state[src, h] ([dk, dv]) before the first token, state[dst, h] after the last

State pages: ``conv_state`` [num_pages, D, K-1] and ``state`` [num_pages, Hv, dk, dv], each
a view whose first dimension may have any stride (the pages of a cache shared with other
layers) and whose inner dimensions are contiguous, in float32 or bfloat16 (the arithmetic is
float32; a state is rounded to its page's dtype only when stored). The pages of different
sequences are distinct: no sequence's destination is another's source. The activations may
be views with any token stride; their last dimension (g's and beta's heads) is contiguous.

Kernels, each one program per sequence and column block looping over its tokens:

- ``_conv_kernel``: grid (sequences, blocks of D), tiles of BLOCK_T tokens;
- ``_recurrent_kernel`` (``max_query_len == 1``, a decode batch): grid (sequences, value
  heads, blocks of dv), the [dk, BV] state block in registers, token by token;
- ``_chunk_kernel`` (prefill and mixed batches): the same grid, tokens in chunks of BT = 64
  with the chunk's work as matrix products (the UT transform of the delta rule, as in
  flash-linear-attention's chunked form), below.

In a chunk of BT tokens, G the cumulative sum of g inside it, Γ_ij = exp(G_i - G_j) for
i >= j (0 above the diagonal) and β = diag(beta)::

    A = strictly-lower(β K Kᵀ ⊙ Γ)          T = (I + A)⁻¹   (forward substitution)
    U = T β V,  W = T β diag(exp G) K        V' = U - W S    (what S does not yet predict)
    O = diag(exp G) Q S + lower(Q Kᵀ ⊙ Γ) V'
    S <- exp(G_last) S + (diag(exp(G_last - G)) K)ᵀ V'

Every exponent there is <= 0 (g is a log-decay), so nothing overflows. The kernels read only
device values (bounds, pages, flags) and allocate no more than their output: a decode step
can be captured in a CUDA graph. The products run in float32 (``input_precision="ieee"``).

Measured once on an H200 (Qwen3-Next's shapes: Hk 16, Hv 32, dk = dv = 128, D 8192; bf16
activations; do_bench, Python launch included): decode of 256 sequences 0.33 ms for the
rule (float32 states: about the time to read and write them) and 0.19 ms for the conv;
prefill 19 ms for 1,338 tokens in 4 sequences and 62 ms for one of 4,096 tokens. The chunked
kernel is simple rather than fast: one program per (sequence, head, half of dv) walks its
chunks in turn, and the row-by-row inverse is serial; flash-linear-attention's kernels
split this work over many programs.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk, in both the chunked kernel and the PyTorch path
EPS = 1e-6  # the L2 norm's, as Hugging Face's ``l2norm``
# (q, k, v, g, beta, initial state) of one sequence, heads first → (o, final state)
Mixer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# --- PyTorch -----------------------------------------------------------------------------


def _torch_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, bounds: list[int],
    src: list[int], dst: list[int], has: list[bool],
) -> torch.Tensor:  # fmt: skip
    d, width = weight.shape
    taps = weight.float()[:, None, :]  # [D, 1, K], F.conv1d's depthwise layout
    out = torch.zeros_like(x)
    zeros = x.new_zeros((d, width - 1), dtype=torch.float32)
    for i, page in enumerate(dst):
        bos, eos = bounds[i], bounds[i + 1]
        prev = conv_state[src[i]].float() if has[i] else zeros
        xx = torch.cat([prev, x[bos:eos].t().float()], dim=1)  # [D, K-1+L]
        y = F.conv1d(xx[None], taps, groups=d)[0]  # [D, L]
        out[bos:eos] = F.silu(y).t().to(x.dtype)
        conv_state[page].copy_(xx[:, xx.shape[1] - (width - 1) :])
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def _torch_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Token by token: q, k [H, L, dk]; v [H, L, dv]; g, beta [H, L]; s [H, dk, dv]."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        seen = torch.einsum("hkv,hk->hv", s, k[:, t])
        s = s + k[:, t, :, None] * (beta[:, t, None] * (v[:, t] - seen))[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
    return out, s


def _torch_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The chunked form of the module docstring, shapes as ``_torch_recurrent``'s."""
    out = torch.empty_like(v)
    for c in range(0, v.shape[1], CHUNK):
        qc, kc, vc = q[:, c : c + CHUNK], k[:, c : c + CHUNK], v[:, c : c + CHUNK]
        gc, bc = g[:, c : c + CHUNK].cumsum(-1), beta[:, c : c + CHUNK, None]
        n = vc.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        gamma = (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        a = ((bc * kc) @ kc.transpose(1, 2) * gamma).tril(-1)
        u = torch.linalg.solve_triangular(a, bc * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(
            a, bc * gc.exp()[..., None] * kc, upper=False, unitriangular=True
        )
        v_new = u - w @ s
        out[:, c : c + CHUNK] = (gc.exp()[..., None] * qc) @ s + (
            qc @ kc.transpose(1, 2) * gamma
        ) @ v_new
        last = gc[:, -1:]
        s = last.exp()[..., None] * s + ((last - gc).exp()[..., None] * kc).transpose(1, 2) @ v_new
    return out, s


def _torch_gdn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, bounds: list[int], src: list[int], dst: list[int], has: list[bool],
) -> torch.Tensor:  # fmt: skip
    group = v.shape[1] // q.shape[1]
    scale = q.shape[2] ** -0.5
    out = torch.zeros_like(v)
    zeros = state.new_zeros(state.shape[1:], dtype=torch.float32)
    for i, page in enumerate(dst):
        bos, eos = bounds[i], bounds[i + 1]
        qi = _l2norm(q[bos:eos].float()).repeat_interleave(group, 1) * scale
        ki = _l2norm(k[bos:eos].float()).repeat_interleave(group, 1)
        heads = [x.float().transpose(0, 1) for x in (qi, ki, v[bos:eos], g[bos:eos], beta[bos:eos])]
        # one token: the recurrent step, as Hugging Face decodes; more: chunks, as it prefills
        mix: Mixer = _torch_recurrent if eos - bos == 1 else _torch_chunked
        o, s = mix(*heads, state[src[i]].float() if has[i] else zeros)
        out[bos:eos] = o.transpose(0, 1).to(v.dtype)
        state[page].copy_(s)
    return out


# --- Triton ------------------------------------------------------------------------------


@triton.jit
def _conv_kernel(
    X, W, STATE, OUT, QSL, SRC, DST, HAS, D, stride_x, stride_w, stride_o, stride_page,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Sequence ``program_id(0)``, columns ``BLOCK_D * program_id(1)`` on. A token at
    position p < 0 of its sequence (before its first) is the state's column K-1+p."""
    i = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    bos = tl.load(QSL + i).to(tl.int64)
    n = tl.load(QSL + i + 1).to(tl.int64) - bos
    has = tl.load(HAS + i) != 0
    prev = STATE + tl.load(SRC + i).to(tl.int64) * stride_page + d * (K - 1)  # [BLOCK_D]
    xs = X + bos * stride_x + d
    # the new state first: the last K-1 positions of (state ++ tokens), read before any write
    c = tl.arange(0, KP)
    p = n - (K - 1) + c
    ok = d_ok[:, None] & (c < K - 1)[None, :]
    new = tl.where(
        p[None, :] >= 0,
        tl.load(xs[:, None] + p[None, :] * stride_x, mask=ok & (p >= 0)[None, :], other=0.0)
        .to(tl.float32),
        tl.load(prev[:, None] + (p + K - 1)[None, :], mask=ok & (p < 0)[None, :] & has, other=0.0)
        .to(tl.float32),
    )  # fmt: skip
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = (t < n)[:, None] & d_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            pos = t - (K - 1) + j
            from_x = tl.load(xs[None, :] + pos[:, None] * stride_x,
                             mask=t_ok & (pos >= 0)[:, None], other=0.0)  # fmt: skip
            from_s = tl.load(prev[None, :] + (pos + K - 1)[:, None],
                             mask=t_ok & (pos < 0)[:, None] & has, other=0.0)  # fmt: skip
            tap = tl.load(W + d * stride_w + j, mask=d_ok, other=0.0).to(tl.float32)
            x = tl.where((pos >= 0)[:, None], from_x.to(tl.float32), from_s.to(tl.float32))
            acc += x * tap[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(OUT + (bos + t)[:, None] * stride_o + d[None, :], y.to(OUT.dtype.element_ty),
                 mask=t_ok)  # fmt: skip
    dst = STATE + tl.load(DST + i).to(tl.int64) * stride_page + d * (K - 1)
    tl.store(dst[:, None] + c[None, :], new.to(STATE.dtype.element_ty), mask=ok)


@triton.jit
def _state_block(STATE, SRC, HAS, i, h, stride_page, DK, DV, BK: tl.constexpr,
                 BV: tl.constexpr):  # fmt: skip
    """Sequence i's starting state for value head h, its columns ``BV * program_id(2)`` on:
    the pointers of the block [BK, BV] in a page (add the page's offset), their mask and the
    block (float32; zeros without a state)."""
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    ptrs = STATE + h * DK * DV + rk[:, None] * DV + rv[None, :]
    ok = (rk < DK)[:, None] & (rv < DV)[None, :]
    has = tl.load(HAS + i) != 0
    page = tl.load(SRC + i).to(tl.int64) * stride_page
    s = tl.load(ptrs + page, mask=ok & has, other=0.0).to(tl.float32)
    return ptrs, ok, s


@triton.jit
def _recurrent_kernel(
    Q, K, V, G, BETA, STATE, OUT, QSL, SRC, DST, HAS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_page, DK, DV, scale, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Sequence ``program_id(0)``, value head ``program_id(1)``, token by token."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = rk < DK, rv < DV
    ptrs, ok, s = _state_block(STATE, SRC, HAS, i, h, stride_page, DK, DV, BK, BV)
    bos = tl.load(QSL + i).to(tl.int64)
    eos = tl.load(QSL + i + 1).to(tl.int64)
    for t in range(bos, eos):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + rk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + rk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(V + t * stride_vt + h * stride_vh + rv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(G + t * stride_gt + h).to(tl.float32)
        beta = tl.load(BETA + t * stride_bt + h).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        s = s * tl.exp(g)
        seen = tl.sum(s * k[:, None], 0)
        s += k[:, None] * (beta * (v - seen))[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(OUT + (t * tl.num_programs(1) + h) * DV + rv, o.to(OUT.dtype.element_ty),
                 mask=v_ok)  # fmt: skip
    page = tl.load(DST + i).to(tl.int64) * stride_page
    tl.store(ptrs + page, s.to(STATE.dtype.element_ty), mask=ok)


@triton.jit
def _unit_lower_inverse(a, BT: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower [BT, BT] ``a``, row by row (forward substitution):
    row r of the inverse's lower part is -a_r - Σ_(j<r) a_rj · (row j), rows j < r done."""
    r = tl.arange(0, BT)
    inv = -a
    for row in range(1, BT):
        this = tl.sum(tl.where((r == row)[:, None], inv, 0.0), 0)
        done = this + tl.sum(this[:, None] * inv, 0)
        inv = tl.where((r == row)[:, None], done[None, :], inv)
    return inv + tl.where(r[:, None] == r[None, :], 1.0, 0.0)


@triton.jit
def _chunk_kernel(
    Q, K, V, G, BETA, STATE, OUT, QSL, SRC, DST, HAS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_page, DK, DV, scale, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr,
):  # fmt: skip
    """Sequence ``program_id(0)``, value head ``program_id(1)``, a chunk of BT tokens at a
    time (the module docstring's products; rows past the sequence's end are zeros, with
    g = 0, and change nothing)."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    rt = tl.arange(0, BT)
    k_ok, v_ok = rk < DK, rv < DV
    lower = rt[:, None] >= rt[None, :]
    ptrs, ok, s = _state_block(STATE, SRC, HAS, i, h, stride_page, DK, DV, BK, BV)
    bos = tl.load(QSL + i).to(tl.int64)
    eos = tl.load(QSL + i + 1).to(tl.int64)
    for c0 in range(bos, eos, BT):
        t = c0 + rt
        t_ok = t < eos
        qk_ok = t_ok[:, None] & k_ok[None, :]
        q = tl.load(Q + t[:, None] * stride_qt + hk * stride_qh + rk[None, :], mask=qk_ok,
                    other=0.0).to(tl.float32)  # fmt: skip
        k = tl.load(K + t[:, None] * stride_kt + hk * stride_kh + rk[None, :], mask=qk_ok,
                    other=0.0).to(tl.float32)  # fmt: skip
        v = tl.load(V + t[:, None] * stride_vt + h * stride_vh + rv[None, :],
                    mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(G + t * stride_gt + h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(BETA + t * stride_bt + h, mask=t_ok, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        gc = tl.cumsum(g, 0)
        gamma = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(rt[:, None] > rt[None, :], beta[:, None] * kk * gamma, 0.0)
        inv = _unit_lower_inverse(a, BT)
        u = tl.dot(inv, beta[:, None] * v, input_precision="ieee")
        w = tl.dot(inv, (beta * tl.exp(gc))[:, None] * k, input_precision="ieee")
        v_new = u - tl.dot(w, s, input_precision="ieee")
        attn = tl.dot(q, tl.trans(k), input_precision="ieee") * gamma
        o = tl.dot(tl.exp(gc)[:, None] * q, s, input_precision="ieee")
        o += tl.dot(attn, v_new, input_precision="ieee")
        out = OUT + (t[:, None] * tl.num_programs(1) + h) * DV + rv[None, :]
        tl.store(out, o.to(OUT.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])
        last = tl.sum(g, 0)
        k_decayed = tl.exp(last - gc)[:, None] * k
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")
    page = tl.load(DST + i).to(tl.int64) * stride_page
    tl.store(ptrs + page, s.to(STATE.dtype.element_ty), mask=ok)


# --- the ops -----------------------------------------------------------------------------


def _check_pages(pages: torch.Tensor, name: str) -> None:
    if pages.shape[0] and not pages[0].is_contiguous():
        raise ValueError(f"{name}: each page {tuple(pages.shape[1:])} must be contiguous")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    has_state: torch.Tensor,
    num_seqs: int | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """silu(depthwise causal conv) of ``x`` [T, D] with ``weight`` [D, K], each sequence after
    the K-1 inputs in ``conv_state[state_src[i]]`` (zeros without ``has_state[i]``); leaves
    the last K-1 inputs in ``conv_state[state_dst[i]]``. ``num_seqs``: the sequences, the
    first entries of the index tensors (all of them by default). ``use_kernel``: the Triton
    kernel (by default where ``x`` is on a GPU). Returns [T, D] in ``x``'s dtype."""
    n = state_src.shape[0] if num_seqs is None else num_seqs
    _check_pages(conv_state, "conv_state")
    if not (x.is_cuda if use_kernel is None else use_kernel):
        return _torch_conv(
            x, weight, conv_state, query_start_loc[: n + 1].tolist(), state_src[:n].tolist(),
            state_dst[:n].tolist(), [bool(h) for h in has_state[:n].tolist()],
        )  # fmt: skip
    d = x.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n == 0 or d == 0:
        return out
    width = weight.shape[1]
    block_d = min(128, triton.next_power_of_2(d))
    _conv_kernel[(n, triton.cdiv(d, block_d))](
        x, weight, conv_state, out, query_start_loc, state_src, state_dst, has_state, d,
        x.stride(0), weight.stride(0), out.stride(0), conv_state.stride(0),
        K=width, KP=triton.next_power_of_2(max(width - 1, 1)), BLOCK_T=16, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    has_state: torch.Tensor,
    max_query_len: int,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """The gated delta rule (module docstring) of q, k [T, Hk, dk], v [T, Hv, dv], g and beta
    [T, Hv] (the log-decay and the sigmoid's output), from the states in ``state[state_src]``
    to ``state[state_dst]``. ``max_query_len``: the longest sequence's tokens (1 takes the
    recurrent kernel; the caller knows it without reading the device). ``use_kernel``: the
    Triton kernels (by default where ``v`` is on a GPU). Returns o [T, Hv, dv] in ``v``'s
    dtype."""
    n = state_src.shape[0]
    _check_pages(state, "state")
    if not (v.is_cuda if use_kernel is None else use_kernel):
        return _torch_gdn(
            q, k, v, g, beta, state, query_start_loc[: n + 1].tolist(), state_src.tolist(),
            state_dst.tolist(), [bool(h) for h in has_state.tolist()],
        )  # fmt: skip
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return out
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(64 if max_query_len > 1 else 32, triton.next_power_of_2(dv)))
    args = (
        q, k, v, g, beta, state, out, query_start_loc, state_src, state_dst, has_state,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state.stride(0), dk, dv, dk**-0.5,
    )  # fmt: skip
    grid = (n, hv, triton.cdiv(dv, bv))
    if max_query_len == 1:
        _recurrent_kernel[grid](*args, GROUP=hv // hk, BK=bk, BV=bv, num_warps=4)
    else:
        _chunk_kernel[grid](*args, GROUP=hv // hk, BK=bk, BV=bv, BT=CHUNK, num_warps=8)
    return out
