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

Kernels:

- ``_conv_kernel``: grid (sequences, blocks of D), each program a sequence's tokens in tiles;
- ``_recurrent_kernel`` (a decode batch, and a mixed step's trailing decode rows:
  ``num_decodes``): grid (sequences, value heads, blocks of dv), the [dk, BV] state block in
  registers, token by token;
- prefill and mixed batches: the delta rule's chunked form (the UT transform, as in
  flash-linear-attention), over chunks of BT = 64 tokens of one sequence (its last chunk
  may be partial), in three kernels, below: ``_prepare_kernel``, grid (chunks, value heads),
  the work that does not depend on the state; ``_state_kernel``, grid (sequences, value
  heads, blocks of dv), the one serial pass, a sequence's chunks in turn from state[src] to
  state[dst]; ``_output_kernel``, grid (chunks, value heads, blocks of dv).

In a chunk of BT tokens, G the cumulative sum of g inside it, Γ_ij = exp(G_i - G_j) for
i >= j (0 above the diagonal) and β = diag(beta)::

    prepare:  A = strictly-lower(β K Kᵀ ⊙ Γ)      T = (I + A)⁻¹
              U = T β V,   W = T β diag(exp G) K
    state:    S_c = S (S at the chunk's start);   V' = U - W S   (what S does not yet predict)
              S <- exp(G_last) S + (diag(exp(G_last - G)) K)ᵀ V'
    output:   O = diag(exp G) Q S_c + lower(Q Kᵀ ⊙ Γ) V'

T is blocked (``_unit_lower_inverse``): the inverses of the 16×16 diagonal blocks, by forward
substitution (15 steps, the four blocks at once), combined by matrix products. Scratch in
float32, allocated per call: G [T, Hv], W [T, Hv, dk], U (then V') [T, Hv, dv] and S_c
[chunks, Hv, dk, dv]; about 2 GiB for 32k tokens at Qwen3-Next's shapes. The map of chunks to
sequences is made on the device (no host sync); the grids take a host bound on the chunks
(tokens // BT + sequences), programs past the last chunk exiting at once.

Every exponent there is <= 0 (g is a log-decay), so nothing overflows. The kernels read only
device values (bounds, pages, flags); the decode kernel allocates no more than its output:
a decode step can be captured in a CUDA graph. The products run in float32
(``input_precision="ieee"``), which Triton computes with FMAs holding each product's operands
whole in registers: the chunked kernels sum over slices of KS = 16 (of dk, or of a chunk's
rows) read from memory (S_c and V' as just written, behind a barrier), so that ptxas does
not spill (checked for sm_90: none in the state and output kernels, under 1 KB a thread in
the prepare kernel's [BT, BT] products).

Not yet timed by the repository's benchmarks, nor run on a GPU. A one-off check of the first
version on an H200 (a script not kept; Qwen3-Next's shapes) saw the decode kernels agree with
the PyTorch path, and that version's prefill (a program per sequence and head walking its
chunks) take 62 ms for one 4,096-token sequence: what the three kernels above replace.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk, in both the chunked kernels and the PyTorch path
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
    stride_page, DK, DV, scale, FIRST, GROUP: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    """Sequence ``FIRST + program_id(0)``, value head ``program_id(1)``, token by token."""
    i = FIRST + tl.program_id(0)
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
def _unit_lower_inverse(a, BT: tl.constexpr, BC: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower [BT, BT] ``a``, BT <= 4 BC. First the inverse Di of its
    diagonal blocks [BC, BC] (I + D), by forward substitution, all blocks at once: step r does
    row r of every block (row r of X = Di - I is -a_r - Σ_(j<r) a_rj · (row j), its rows j < r
    done; the blocks' columns are disjoint, so one [BT] vector holds all their rows r). Then,
    with E the rest of a (below the diagonal blocks) and N = Di E (N⁴ = 0):
    (I + a)⁻¹ = (I + N)⁻¹ Di = (I - N)(I + N²) Di."""
    tl.static_assert(BT <= 4 * BC)
    r = tl.arange(0, BT)
    block = (r[:, None] // BC) == (r[None, :] // BC)
    x = -tl.where(block, a, 0.0)
    for row in range(1, BC):
        sel = (r % BC) == row
        this = tl.sum(tl.where(sel[:, None], x, 0.0), 0)
        done = this + tl.sum(this[:, None] * x, 0)
        x = tl.where(sel[:, None] & block, done[None, :], x)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    d_inv = x + eye
    n = tl.dot(d_inv, tl.where(block, 0.0, a), input_precision="ieee")
    n2 = tl.dot(n, n, input_precision="ieee")
    t = tl.dot(eye - n, eye + n2, input_precision="ieee")
    return tl.dot(t, d_inv, input_precision="ieee")


@triton.jit
def _chunk_rows(QSL, CFIRST, i, c, BT: tl.constexpr):
    """Chunk c's rows t [BT] (it is one of sequence i's) and which of them are in it."""
    bos = tl.load(QSL + i).to(tl.int64) + (c - tl.load(CFIRST + i)).to(tl.int64) * BT
    t = bos + tl.arange(0, BT)
    return t, t < tl.load(QSL + i + 1).to(tl.int64)


@triton.jit
def _prepare_kernel(
    K, V, G, BETA, W, U, GC, QSL, CSEQ, CFIRST, n_seqs,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, DK, DV,
    GROUP: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    KS: tl.constexpr,
):  # fmt: skip
    """Chunk ``program_id(0)``, value head ``program_id(1)``: G, W and U (module docstring),
    which do not depend on the state, into the scratch rows of its tokens."""
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hv = tl.num_programs(1)
    i = tl.load(CSEQ + c)
    if i >= n_seqs:  # past the last chunk
        return
    t, t_ok = _chunk_rows(QSL, CFIRST, i, c, BT)
    rt = tl.arange(0, BT)
    rs = tl.arange(0, KS)
    k_ptrs = K + t[:, None] * stride_kt + (h // GROUP) * stride_kh + rs[None, :]
    g = tl.load(G + t * stride_gt + h, mask=t_ok, other=0.0).to(tl.float32)
    beta = tl.load(BETA + t * stride_bt + h, mask=t_ok, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    tl.store(GC + t * hv + h, gc, mask=t_ok)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)  # ‖k‖², for the L2 norm
    for k0 in range(0, DK, KS):
        k = tl.load(k_ptrs + k0, mask=t_ok[:, None] & (k0 + rs < DK)[None, :], other=0.0)
        k = k.to(tl.float32)
        kk += tl.dot(k, tl.trans(k), input_precision="ieee")
        sq += tl.sum(k * k, 1)
    norm = tl.rsqrt(sq + 1e-6)
    gamma = tl.exp(tl.where(rt[:, None] > rt[None, :], gc[:, None] - gc[None, :], float("-inf")))
    inv = _unit_lower_inverse((beta * norm)[:, None] * kk * norm[None, :] * gamma, BT, BC)
    scaled = (beta * tl.exp(gc) * norm)[:, None]
    for k0 in range(0, DK, KS):
        ok = t_ok[:, None] & (k0 + rs < DK)[None, :]
        k = tl.load(k_ptrs + k0, mask=ok, other=0.0).to(tl.float32)
        w = tl.dot(inv, scaled * k, input_precision="ieee")
        tl.store(W + (t[:, None] * hv + h) * DK + k0 + rs[None, :], w, mask=ok)
    for v0 in range(0, DV, BV):
        rv = v0 + tl.arange(0, BV)
        ok = t_ok[:, None] & (rv < DV)[None, :]
        v = tl.load(V + t[:, None] * stride_vt + h * stride_vh + rv[None, :], mask=ok,
                    other=0.0).to(tl.float32)  # fmt: skip
        u = tl.dot(inv, beta[:, None] * v, input_precision="ieee")
        tl.store(U + (t[:, None] * hv + h) * DV + rv[None, :], u, mask=ok)


@triton.jit
def _state_kernel(
    K, W, U, GC, STATE, STARTS, QSL, SRC, DST, HAS, CFIRST,
    stride_kt, stride_kh, stride_page, DK, DV,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    KS: tl.constexpr,
):  # fmt: skip
    """Sequence ``program_id(0)``, value head ``program_id(1)``, state columns ``BV *
    program_id(2)`` on, its chunks in turn: records S at each chunk's start in STARTS,
    overwrites U with V' = U - W S, carries S on. The products take their operands in slices
    of KS (of dk, then of the chunk's rows) from memory, S's and V''s as just stored."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    hv = tl.num_programs(1)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, KS)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = rv < DV
    ok = (rk < DK)[:, None] & v_ok[None, :]
    block = (h * DK + rk[:, None]) * DV + rv[None, :]
    has = tl.load(HAS + i) != 0
    s = tl.load(STATE + tl.load(SRC + i).to(tl.int64) * stride_page + block, mask=ok & has,
                other=0.0).to(tl.float32)  # fmt: skip
    bos = tl.load(QSL + i).to(tl.int64)
    eos = tl.load(QSL + i + 1).to(tl.int64)
    c = tl.load(CFIRST + i).to(tl.int64)
    for c0 in range(bos, eos, BT):
        t = c0 + rt
        t_ok = t < eos
        start = STARTS + (c * hv + h) * DK * DV + rv[None, :]
        tl.store(start + rk[:, None] * DV, s, mask=ok)
        u_ptrs = U + (t[:, None] * hv + h) * DV + rv[None, :]
        u_ok = t_ok[:, None] & v_ok[None, :]
        v_new = tl.load(u_ptrs, mask=u_ok, other=0.0)
        last = tl.load(GC + (tl.minimum(eos, c0 + BT) - 1) * hv + h)
        tl.debug_barrier()  # S, as stored, for every thread
        for k0 in range(0, DK, KS):
            w = tl.load(W + (t[:, None] * hv + h) * DK + k0 + rs[None, :],
                        mask=t_ok[:, None] & (k0 + rs < DK)[None, :], other=0.0)  # fmt: skip
            s_rows = tl.load(start + (k0 + rs)[:, None] * DV,
                             mask=(k0 + rs < DK)[:, None] & v_ok[None, :], other=0.0)  # fmt: skip
            v_new -= tl.dot(w, s_rows, input_precision="ieee")
        tl.store(u_ptrs, v_new, mask=u_ok)
        tl.debug_barrier()  # V', as stored, for every thread
        s = s * tl.exp(last)
        for r0 in range(0, BT, KS):
            tr = c0 + r0 + rs
            tr_ok = tr < eos
            k = tl.load(K + tr[:, None] * stride_kt + hk * stride_kh + rk[None, :],
                        mask=tr_ok[:, None] & (rk < DK)[None, :], other=0.0)  # fmt: skip
            gr = tl.load(GC + tr * hv + h, mask=tr_ok, other=0.0)
            k = k.to(tl.float32)
            k = k * (tl.rsqrt(tl.sum(k * k, 1) + 1e-6) * tl.exp(last - gr))[:, None]
            v_rows = tl.load(U + (tr[:, None] * hv + h) * DV + rv[None, :],
                             mask=tr_ok[:, None] & v_ok[None, :], other=0.0)  # fmt: skip
            s += tl.dot(tl.trans(k), v_rows, input_precision="ieee")
        c += 1
    tl.store(STATE + tl.load(DST + i).to(tl.int64) * stride_page + block,
             s.to(STATE.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def _output_kernel(
    Q, K, VNEW, GC, STARTS, OUT, QSL, CSEQ, CFIRST, n_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, DK, DV, scale,
    GROUP: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, KS: tl.constexpr,
):  # fmt: skip
    """Chunk ``program_id(0)``, value head ``program_id(1)``, output columns ``BV *
    program_id(2)`` on: O = diag(exp G) Q S + lower(Q Kᵀ ⊙ Γ) V', S the chunk's start
    (products over dk in slices of KS)."""
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    hv = tl.num_programs(1)
    i = tl.load(CSEQ + c)
    if i >= n_seqs:  # past the last chunk
        return
    t, t_ok = _chunk_rows(QSL, CFIRST, i, c, BT)
    rt = tl.arange(0, BT)
    rs = tl.arange(0, KS)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    ok = t_ok[:, None] & (rv < DV)[None, :]
    q_ptrs = Q + t[:, None] * stride_qt + hk * stride_qh + rs[None, :]
    k_ptrs = K + t[:, None] * stride_kt + hk * stride_kh + rs[None, :]
    start = STARTS + (c.to(tl.int64) * hv + h) * DK * DV + rv[None, :]
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    qs = tl.zeros([BT, BV], dtype=tl.float32)
    q_sq = tl.zeros([BT], dtype=tl.float32)  # ‖q‖², ‖k‖², for the L2 norms
    k_sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, DK, KS):
        k_ok = t_ok[:, None] & (k0 + rs < DK)[None, :]
        q = tl.load(q_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
        s_rows = tl.load(start + (k0 + rs)[:, None] * DV,
                         mask=(k0 + rs < DK)[:, None] & (rv < DV)[None, :], other=0.0)  # fmt: skip
        qk += tl.dot(q, tl.trans(k), input_precision="ieee")
        qs += tl.dot(q, s_rows, input_precision="ieee")
        q_sq += tl.sum(q * q, 1)
        k_sq += tl.sum(k * k, 1)
    q_norm = tl.rsqrt(q_sq + 1e-6) * scale
    k_norm = tl.rsqrt(k_sq + 1e-6)
    gc = tl.load(GC + t * hv + h, mask=t_ok, other=0.0)
    gamma = tl.exp(tl.where(rt[:, None] >= rt[None, :], gc[:, None] - gc[None, :], float("-inf")))
    v_new = tl.load(VNEW + (t[:, None] * hv + h) * DV + rv[None, :], mask=ok, other=0.0)
    attn = q_norm[:, None] * qk * k_norm[None, :] * gamma
    o = (q_norm * tl.exp(gc))[:, None] * qs + tl.dot(attn, v_new, input_precision="ieee")
    tl.store(OUT + (t[:, None] * hv + h) * DV + rv[None, :], o.to(OUT.dtype.element_ty), mask=ok)


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
    num_decodes: int = 0,
) -> torch.Tensor:
    """The gated delta rule (module docstring) of q, k [T, Hk, dk], v [T, Hv, dv], g and beta
    [T, Hv] (the log-decay and the sigmoid's output), from the states in ``state[state_src]``
    to ``state[state_dst]``. ``max_query_len``: the longest sequence's tokens (1 takes the
    recurrent kernel; the caller knows it without reading the device). ``num_decodes``: the
    trailing sequences of one token each (a mixed step's decode rows), which the recurrent
    kernel takes while the chunked ones take the rest (a decode row as a chunk would cost a
    [dk, dv] scratch state a head). ``use_kernel``: the Triton kernels (by default where
    ``v`` is on a GPU). Returns o [T, Hv, dv] in ``v``'s dtype."""
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
    d = n if max_query_len == 1 else min(max(num_decodes, 0), n)  # the recurrent kernel's
    if d:
        bk, bv = max(16, triton.next_power_of_2(dk)), max(16, min(32, triton.next_power_of_2(dv)))
        _recurrent_kernel[(d, hv, triton.cdiv(dv, bv))](
            q, k, v, g, beta, state, out, query_start_loc, state_src, state_dst, has_state,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), state.stride(0), dk, dv, dk**-0.5, n - d,
            GROUP=hv // hk, BK=bk, BV=bv, num_warps=4,
        )  # fmt: skip
    if n > d:
        m = n - d
        _chunked(q, k, v, g, beta, state, out, query_start_loc[: m + 1], state_src[:m],
                 state_dst[:m], has_state[:m])  # fmt: skip
    return out


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, out: torch.Tensor, qsl: torch.Tensor, src: torch.Tensor,
    dst: torch.Tensor, has: torch.Tensor,
) -> None:  # fmt: skip
    """The chunked kernels, in turn, into ``out``. Chunk c of the batch (sequence by sequence,
    each one's chunks in order) is sequence ``seq[c]``'s chunk ``c - first[seq[c]]``; the map
    is made on the device, and ``chunks`` programs (a bound, from the host's shapes) cover it."""
    (n,), (t, hk, dk), (_, hv, dv) = src.shape, q.shape, v.shape
    lengths = (qsl[1 : n + 1] - qsl[:n]).long()
    ends = ((lengths + CHUNK - 1) // CHUNK).cumsum(0)  # each sequence's chunks, inclusive
    first = ends - (lengths + CHUNK - 1) // CHUNK
    # a chunk holds a token; each sequence's chunks are ≤ its tokens // CHUNK + 1
    chunks = min(t, t // CHUNK + n)
    seq = torch.searchsorted(ends, torch.arange(chunks, device=v.device), right=True)
    scratch = lambda *shape: torch.empty(shape, dtype=torch.float32, device=v.device)  # noqa: E731
    w, u, gc = scratch(t, hv, dk), scratch(t, hv, dv), scratch(t, hv)  # u becomes V'
    starts = scratch(chunks, hv, dk, dv)  # S at each chunk's start
    # sizes checked with ptxas for sm_90 at dk = dv = 128 (module docstring)
    sizes = {"GROUP": hv // hk, "BT": CHUNK, "KS": 16}
    bv = max(16, min(32, triton.next_power_of_2(dv)))
    if chunks:
        _prepare_kernel[(chunks, hv)](
            k, v, g, beta, w, u, gc, qsl, seq, first, n, k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), g.stride(0), beta.stride(0), dk, dv, **sizes, BV=bv,
            BC=16, num_warps=8,
        )  # fmt: skip
    _state_kernel[(n, hv, triton.cdiv(dv, bv))](
        k, w, u, gc, state, starts, qsl, src, dst, has, first, k.stride(0), k.stride(1),
        state.stride(0), dk, dv, **sizes, BK=max(16, triton.next_power_of_2(dk)), BV=bv,
        num_warps=8, num_stages=1,
    )  # fmt: skip
    if chunks:
        _output_kernel[(chunks, hv, triton.cdiv(dv, bv))](
            q, k, u, gc, starts, out, qsl, seq, first, n, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), dk, dv, dk**-0.5, **sizes, BV=bv, num_warps=8,
        )  # fmt: skip
