"""Triton kernels for paged attention over Baton's KV layout (strided per-layer views
[num_blocks, block_size, kv_heads, head_dim]; the head dimension must be contiguous).

Two kernels and a combine step:

- ``_prefill``: grid (q heads, query tiles, requests). Each program attends BLOCK_M queries of
  one request and one head to that request's whole context, causally:

      context:  | cached prefix (seq_len - q_len) | this step's q_len tokens |
      query m sits at position seq_len - q_len + m and sees keys [0, that position]

  Keys are gathered token by token through the block table, so BLOCK_N need not match the
  KV block size. It can serve a decode row too (a query tile of one), at GROUP times the
  reads of ``_decode``; the backend gives a mixed step's trailing decode rows to ``_decode``.
- ``_decode``: grid (requests, kv heads, splits) over the requests from ``first_req`` on
  (0 in a pure decode step); with ``ORDERED``, grid (kv heads, requests, splits) with the
  requests taken in the order ``order`` gives (the runner's: longest context first, so the
  last programs to start are short ones and no long one runs alone at the end of the launch;
  measured: docs/performance.md). One query per request; the GROUP query heads
  that share a kv head are packed into the M dimension of one tile, so K/V are read once per
  group. The context is cut into NUM_SPLITS ranges processed in parallel (long contexts, small
  batches); ``_combine`` merges the partial results with their log-sum-exp.

A layer's sliding window W (``HAS_WINDOW``, ``window``: the query at position p sees the keys
in (p - W, p]) and sinks (``HAS_SINKS``, ``Sinks``: one logit per query head in the softmax's
denominator, no value) are constexpr switches: without them the kernels are the dense ones.
With a window, a prefill tile starts at its first query's window and decode at seq_len - W, so
the keys before the window cost nothing; the sinks join the denominator once, after the last
key (``_fold_sink``; a split decode's in ``_combine``).

Softmax runs in base 2 with float32 statistics (the flash-attention recurrence). Both kernels
read only device values (lengths, tables), so they can be captured in CUDA graphs.
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.ops.dependent_launch import await_inputs, launch_options

LOG2E = 1.4426950408889634


# Arguments that change from step to step. Triton compiles a variant per value class of an
# integer argument (== 1, divisible by 16, other): the block table's row stride is the widest
# scheduled request's block count, so without this a busy engine compiled a fresh variant of
# these kernels (a second each) at its first step of a new class, long after start-up.
# ``first_req`` likewise: where a mixed step's decode rows start (0 in a pure decode step).
PER_STEP = ["stride_bt"]
DECODE_PER_STEP = ["stride_bt", "first_req"]


@triton.jit
def _compute_dtype(q, DOT_F16: tl.constexpr):
    """The queries in the dtype the dots run in: their own, or with ``DOT_F16`` (bf16 queries
    over an FP8 cache) float16: e4m3 widens to float16 directly, and float16 holds every e4m3
    value and every bf16 query in its normal range exactly (clamped at its largest, 65504);
    the probabilities, in [0, 1], then round to float16's 11 bits instead of bf16's 8."""
    if DOT_F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _widen_values(v, dtype, GPU: tl.constexpr):
    """A tile of values in the dots' dtype. Over an FP8 cache with float16 dots, on a GPU, the
    widening is PTX (two e4m3x2 → f16x2 conversions per four codes) that Triton may not move:
    with Triton's own cast it moves the change to the dot operand's layout before the widening,
    and the values, which the product takes transposed, then come out of shared memory one byte
    at a time (64 single-byte loads a thread for each 64-key tile of the decode kernel on
    sm_90, where bf16 tiles take transposing ldmatrix). Widened in the load's layout, the tile
    goes to shared memory as float16 and takes transposing ldmatrix too."""
    if GPU and v.dtype == tl.float8e4nv and dtype == tl.float16:
        # not pure: Triton moves layout changes only across pure (side-effect free) operations
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )  # fmt: skip
    return v.to(dtype)


@triton.jit
def _prefetch_rows(base, rows, ok, ROW_BYTES: tl.constexpr):
    """Ask L2 for the ``ROW_BYTES`` bytes at ``base + rows`` (where ``ok``), a 128-byte line
    at a time, and go on: a prefetch holds no register or shared memory while its bytes
    arrive, so a loop can ask for tiles it reaches later."""
    LINES: tl.constexpr = (ROW_BYTES + 127) // 128
    step: tl.constexpr = 128 * 8 // base.dtype.element_ty.primitive_bitwidth
    lines = tl.arange(0, LINES) * step
    ptrs = base + rows[:, None] + lines[None, :]
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.b32 p, $2, 0;
        @p prefetch.global.L2 [$1];
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [ptrs, (ok[:, None] & (lines >= 0)[None, :]).to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _kv_offsets(
    table, offs_n, ok, kv_head, stride_kb, stride_ks, stride_kh, KV_BLOCK: tl.constexpr
):  # fmt: skip
    """The cache offsets of token positions ``offs_n`` (those ``ok``; block 0 for the rest)
    of one kv head, through the request's block table."""
    block = tl.load(table + offs_n // KV_BLOCK, mask=ok, other=0).to(tl.int64)
    return block * stride_kb + (offs_n % KV_BLOCK) * stride_ks + kv_head * stride_kh


@triton.jit
def _attend_tile(
    q, K, V, table, offs_n, n_ok, visible, offs_d, d_ok, offs_dv, dv_ok, kv_head,
    stride_kb, stride_ks, stride_kh, qk_scale, m_i, l_i, acc,
    KV_BLOCK: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr = True,
    EVEN_D: tl.constexpr = False, GPU: tl.constexpr = False,
):  # fmt: skip
    """One step of the flash-attention recurrence: gather the keys/values of token positions
    ``offs_n`` through the block table, score them against ``q`` (masked by ``visible``) and
    fold them into the running max ``m_i``, sum ``l_i`` and accumulator ``acc`` (base 2).

    ``MASKED=False`` is a tile every query sees whole (a prefill tile's keys before its first
    query): no token mask, no score mask, and no guard for a row that saw nothing. ``EVEN_D``:
    the head dimension fills ``offs_d`` (and the values' ``offs_dv``), so the loads need no
    column mask either. The values are read at the keys' positions, ``offs_dv`` wide."""
    if MASKED:
        kv = _kv_offsets(table, offs_n, n_ok, kv_head, stride_kb, stride_ks, stride_kh, KV_BLOCK)
    else:
        block = tl.load(table + offs_n // KV_BLOCK).to(tl.int64)
        kv = block * stride_kb + (offs_n % KV_BLOCK) * stride_ks + kv_head * stride_kh
    if MASKED:
        k = tl.load(K + kv[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # fmt: skip
        v = tl.load(V + kv[:, None] + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :],
                    other=0.0)  # fmt: skip
    elif EVEN_D:
        k = tl.load(K + kv[:, None] + offs_d[None, :])
        v = tl.load(V + kv[:, None] + offs_dv[None, :])
    else:
        k = tl.load(K + kv[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(V + kv[:, None] + offs_dv[None, :], mask=dv_ok[None, :], other=0.0)
    # an FP8 cache: e4m3 widens exactly to the dots' dtype (``_compute_dtype``; its scales are
    # applied outside: k_scale in qk_scale, v_scale to the accumulated output)
    k, v = k.to(q.dtype), _widen_values(v, q.dtype, GPU)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fold_sink(m_i, l_i, acc, Sinks, heads, ok):
    """Add each head's sink to the softmax state: a term e^sink (base 2 here: the logit times
    log2 e) in the sum, with no value, the running max and the accumulator rescaled to it."""
    sink = tl.load(Sinks + heads, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 where a row saw no key (m_i = -inf)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _window_bounds(first_q, last_q, window, BLOCK_N: tl.constexpr):
    """The key ranges of a query tile [first_q, last_q] under a sliding window W:

        keys: 0 ......... lo .......... full_lo ............. seen_by_all ......... last_q
              | skipped   | masked:     | whole BLOCK_N tiles | masked: the causal |
              |           | window edge | every query sees    | edge (the caller's)|

    ``lo`` = first_q - W + 1 is the first query's first key; from ``full_lo`` (the last
    query's first key, last_q - W + 1, or later) every query of the tile sees each key up to
    its first query. Without a window: lo = full_lo = 0."""
    lo = tl.maximum(first_q - window + 1, 0)
    full_lo = tl.minimum(tl.maximum(last_q - window + 1, lo), first_q + 1)
    seen_by_all = full_lo + (first_q + 1 - full_lo) // BLOCK_N * BLOCK_N
    return lo, full_lo, seen_by_all


@triton.jit(do_not_specialize=PER_STEP)
def _prefill(
    Q, K, V, Out,
    block_tables, query_start_loc, seq_lens, Sinks, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    qk_scale, v_scale,
    KV_BLOCK: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F16: tl.constexpr = False, GPU: tl.constexpr = False,
    HAS_WINDOW: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    # HEAD_DV: the values' width (a dense layer's HEAD_DIM; MLA's narrower: its values are read
    # at the keys' positions, the first HEAD_DV columns)
    # grid (q heads, query tiles, requests): the heads of one tile run side by side (those of
    # one kv head read the same keys, from L2), and the last tiles, which see the most keys,
    # start first, so no long tile runs alone at the end of the launch
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens + req)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _compute_dtype(q, DOT_F16)
    q_pos = prefix + offs_m

    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DV
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = block_tables + req.to(tl.int64) * stride_bt
    # keys up to the tile's first query are seen by every query of it: whole tiles of them
    # run unmasked; the rest, up to the last query's causal edge, masked
    first_q = prefix + tile * BLOCK_M
    full_lo = 0
    seen_by_all = (first_q + 1) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:  # ... and none before the first query's window (``_window_bounds``)
        lo, full_lo, seen_by_all = _window_bounds(first_q, first_q + BLOCK_M - 1, window,
                                                  BLOCK_N)  # fmt: skip
        for start in range(lo, full_lo, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < full_lo
            visible = n_ok[None, :] & (offs_n[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_tile(
                q, K, V, table, offs_n, n_ok, visible, offs_d, d_ok, offs_dv, dv_ok, kv_head,
                stride_kb, stride_ks, stride_kh, qk_scale, m_i, l_i, acc, KV_BLOCK, PRECISION,
                GPU=GPU,
            )  # fmt: skip
    for start in range(full_lo, seen_by_all, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_tile(
            q, K, V, table, offs_n, offs_n, offs_n, offs_d, d_ok, offs_dv, dv_ok, kv_head,
            stride_kb, stride_ks, stride_kh, qk_scale, m_i, l_i, acc, KV_BLOCK, PRECISION,
            MASKED=False, EVEN_D=(BLOCK_D == HEAD_DIM) and (BLOCK_DV == HEAD_DV), GPU=GPU,
        )  # fmt: skip
    hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)  # the last query's causal edge
    for start in range(seen_by_all, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:  # a window shorter than the tile ends inside it
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(
            q, K, V, table, offs_n, n_ok, visible, offs_d, d_ok, offs_dv, dv_ok, kv_head,
            stride_kb, stride_ks, stride_kh, qk_scale, m_i, l_i, acc, KV_BLOCK, PRECISION,
            GPU=GPU,
        )  # fmt: skip
    if HAS_SINKS:
        l_i, acc = _fold_sink(m_i, l_i, acc, Sinks, head + 0 * offs_m, m_ok)
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & dv_ok[None, :],
    )


@triton.jit
def _prefetch_tile(
    K, V, table, offs_n, hi, kv_head, stride_kb, stride_ks, stride_kh,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Ask L2 for the keys and values of token positions ``offs_n`` (those below ``hi``)."""
    ok = offs_n < hi
    kv = _kv_offsets(table, offs_n, ok, kv_head, stride_kb, stride_ks, stride_kh, KV_BLOCK)
    row_bytes: tl.constexpr = HEAD_DIM * K.dtype.element_ty.primitive_bitwidth // 8
    _prefetch_rows(K, kv, ok, row_bytes)
    _prefetch_rows(V, kv, ok, row_bytes)


@triton.jit
def _attend_lanes(
    q, K, V, table, lo, hi, offs_d, d_ok, kv_head,
    stride_kb, stride_ks, stride_kh, qk_scale,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    """The context [lo, hi) in LANES interleaved streams of BLOCK_N keys: each stream keeps its
    own running max, sum and accumulator (one batched product a tile, a lane per warp when
    LANES equals the warps), so a tile's softmax needs no exchange between warps; the streams
    are merged once at the end. Returns (max, sum, accumulator) as one stream's."""
    STEP: tl.constexpr = LANES * BLOCK_N
    offs_w = tl.arange(0, LANES)
    qb = tl.broadcast_to(q[None, :, :], (LANES, GROUP_PAD, BLOCK_D))
    m_i = tl.full([LANES, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([LANES, GROUP_PAD], tl.float32)
    acc = tl.zeros([LANES, GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, STEP):
        offs_n = start + offs_w[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        n_ok = offs_n < hi
        if PREFETCH > 0 and GPU:
            ahead = tl.reshape(offs_n, [STEP]) + PREFETCH * STEP
            _prefetch_tile(K, V, table, ahead, hi, kv_head, stride_kb, stride_ks, stride_kh,
                           KV_BLOCK, HEAD_DIM)  # fmt: skip
        kv = _kv_offsets(table, offs_n, n_ok, kv_head, stride_kb, stride_ks, stride_kh, KV_BLOCK)
        ptrs = kv[:, :, None] + offs_d[None, None, :]
        mask = n_ok[:, :, None] & d_ok[None, None, :]
        k = tl.load(K + ptrs, mask=mask, other=0.0).to(q.dtype)
        v = _widen_values(tl.load(V + ptrs, mask=mask, other=0.0), q.dtype, GPU)
        s = tl.dot(qb, tl.permute(k, (0, 2, 1)), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_safe[None, :]))
    return m, tl.sum(l_i * w, 0), tl.sum(acc * w[:, :, None], 0)


@triton.jit(do_not_specialize=DECODE_PER_STEP)
def _decode(
    Q, K, V, Out, part_acc, part_ml,
    block_tables, query_start_loc, seq_lens, first_req, order, Sinks, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    qk_scale, v_scale,
    KV_BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, ORDERED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, DOT_F16: tl.constexpr = False, GPU: tl.constexpr = False,
    LANES: tl.constexpr = 1, PREFETCH: tl.constexpr = 0,
    HAS_WINDOW: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    await_inputs(USE_PDL)
    # ``local``: the request's offset from first_req, which also indexes the partials
    if ORDERED:  # every kv head of one request, then the next request of ``order``
        local = tl.load(order + tl.program_id(1))
        kv_head = tl.program_id(0)
        num_heads = tl.num_programs(0) * GROUP
    else:
        local = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_heads = tl.num_programs(1) * GROUP
    req = first_req + local
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    row = tl.load(query_start_loc + req).to(tl.int64)
    if HAS_WINDOW:  # the query, at seq_len - 1, sees [seq_len - W, seq_len): split those
        first = tl.maximum(seq_len - window, 0)
        per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), LANES * BLOCK_N)
        per_split = per_split * LANES * BLOCK_N
        lo = first + split * per_split
    else:
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), LANES * BLOCK_N) * LANES * BLOCK_N
        lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _compute_dtype(q, DOT_F16)
    table = block_tables + req.to(tl.int64) * stride_bt
    if LANES == 1:
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            if PREFETCH > 0 and GPU:  # the keys and values PREFETCH tiles on, into L2
                _prefetch_tile(K, V, table, offs_n + PREFETCH * BLOCK_N, hi, kv_head,
                               stride_kb, stride_ks, stride_kh, KV_BLOCK, HEAD_DIM)  # fmt: skip
            m_i, l_i, acc = _attend_tile(
                q, K, V, table, offs_n, n_ok, n_ok[None, :], offs_d, d_ok, offs_d, d_ok, kv_head,
                stride_kb, stride_ks, stride_kh, qk_scale, m_i, l_i, acc, KV_BLOCK, PRECISION,
                GPU=GPU,
            )  # fmt: skip
    else:
        m_i, l_i, acc = _attend_lanes(
            q, K, V, table, lo, hi, offs_d, d_ok, kv_head, stride_kb, stride_ks, stride_kh,
            qk_scale, KV_BLOCK, HEAD_DIM, GROUP_PAD, BLOCK_D, BLOCK_N, LANES, PRECISION,
            PREFETCH, GPU,
        )  # fmt: skip
    out_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            l_i, acc = _fold_sink(m_i, l_i, acc, Sinks, heads, g_ok)
        out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            Out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials: acc [reqs, heads, splits, BLOCK_D], (max, sum) [reqs, heads, splits, 2]
        slot = (local.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        # whole padded rows (the columns past HEAD_DIM are zeros), so _combine reads no garbage
        tl.store(part_acc + slot[:, None] * BLOCK_D + offs_d[None, :], acc * v_scale,
                 mask=g_ok[:, None])  # fmt: skip
        tl.store(part_ml + slot * 2, m_i, mask=g_ok)
        tl.store(part_ml + slot * 2 + 1, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["first_req"])
def _combine(
    Out, part_acc, part_ml, query_start_loc, first_req, Sinks, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    await_inputs(USE_PDL)
    local = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    row = tl.load(query_start_loc + first_req + local).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    slot = (local.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml + slot * 2)
    l_s = tl.load(part_ml + slot * 2 + 1)
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the head's sink joins the denominator (base 2: its logit times log2 e)
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_acc + slot[:, None] * BLOCK_D + offs_d[None, :])
    denominator = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denominator
    tl.store(
        Out + row * stride_ot + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _write_kv(
    K_new, V_new, K, V, slot_mapping, k_scale, v_scale,
    stride_nt, stride_nh, stride_vt, stride_vh, stride_kb, stride_ks, stride_kh,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False, VALUES: tl.constexpr = True,
):  # fmt: skip
    """Store one token's key and value of one kv head into its cache slot (one launch for all;
    ``cache_values``: an FP8 cache's rounding); without VALUES the key alone (``store_rows``)."""
    await_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HEAD_DIM
    dst = (slot // KV_BLOCK) * stride_kb + (slot % KV_BLOCK) * stride_ks + h * stride_kh + offs
    k = tl.load(K_new + t * stride_nt + h * stride_nh + offs, mask=ok)
    tl.store(K + dst, cache_values(k, k_scale, K.dtype.element_ty), mask=ok)
    if VALUES:
        v = tl.load(V_new + t * stride_vt + h * stride_vh + offs, mask=ok)
        tl.store(V + dst, cache_values(v, v_scale, V.dtype.element_ty), mask=ok)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows [T, H, D] (the last dim contiguous) into ``cache`` [blocks, block size, H, D] (a
    strided view, not FP8) at each token's slot, in one launch (MLA's latent rows: PyTorch's
    scatter took three)."""
    if rows.stride(-1) != 1 or cache.stride(-1) != 1 or cache.dtype == torch.float8_e4m3fn:
        raise ValueError("rows and a 16- or 32-bit cache with a contiguous last dimension")
    if slot_mapping.shape[0] < rows.shape[0]:
        raise ValueError("a slot for every row")
    _write_kv[(rows.shape[0], rows.shape[1])](
        rows, rows, cache, cache, slot_mapping, 1.0, 1.0, rows.stride(0), rows.stride(1),
        rows.stride(0), rows.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        KV_BLOCK=cache.shape[1], HEAD_DIM=rows.shape[2],
        BLOCK_D=triton.next_power_of_2(rows.shape[2]), VALUES=False, **launch_options(rows),
    )  # fmt: skip


@triton.jit
def cache_values(x, scale, dtype):
    """Keys or values as a cache of ``dtype`` holds them. An FP8 cache takes x / scale,
    saturated at e4m3's largest finite value and rounded to nearest even, as
    ``attention/backend.write_kv`` does. (Also the fused rotary's, which stores a step's keys
    and values itself: ``ops/fused_ops._rotary``.)"""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
    return x.to(dtype)


# the block size ``contiguous_prefill`` gives its rows (a fixed constexpr: no compile per length)
CONTIGUOUS_BLOCK = 16


def contiguous_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """One request's causal attention through ``_prefill`` over keys and values that are not
    paged: q [Q, H, D], the last Q of ``seq_len`` positions; k [L, H, D] and v [L, H, DV]
    with DV <= D and k's strides (L >= seq_len, a multiple of ``CONTIGUOUS_BLOCK``; rows from
    ``seq_len`` on are not read), taken as consecutive blocks of one table. Returns [Q, H, DV]
    in q's dtype.

    (MLA's prefill, over a context decompressed from latents: its values, narrower than its
    keys, lie in a buffer of the keys' width, of which only their DV columns are read.)"""
    heads, dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    if k.stride() != v.stride() or k.stride(-1) != 1 or k.shape[0] % CONTIGUOUS_BLOCK:
        raise ValueError("keys and values need one layout, L a multiple of the block size")
    if v_dim > dim:
        raise ValueError(f"values {v_dim} wide, wider than the keys' {dim}")
    dev = q.device
    blocks = k.shape[0] // CONTIGUOUS_BLOCK
    # made on the device: a host list copied there would wait for the stream (and break a step
    # that must not sync, under async scheduling)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    starts = torch.arange(2, dtype=torch.int32, device=dev) * q.shape[0]
    lens = torch.full((1,), seq_len, dtype=torch.int32, device=dev)
    out = q.new_empty(q.shape[0], heads, v_dim)
    gpu = q.is_cuda
    block_d = max(16, triton.next_power_of_2(dim))
    # (float32 tiles of a wide head in 64 x 64 would not fit a GPU's shared memory)
    block_m = block_n = (32 if q.dtype == torch.float32 and block_d > 128 else 64) if gpu else 16
    _prefill[(heads, triton.cdiv(q.shape[0], block_m), 1)](
        q, k, v, out, table, starts, lens, lens, 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        CONTIGUOUS_BLOCK * k.stride(0), k.stride(0), k.stride(1), table.stride(0),
        scale * LOG2E, 1.0,
        KV_BLOCK=CONTIGUOUS_BLOCK, GROUP=1, HEAD_DIM=dim, BLOCK_D=block_d,
        HEAD_DV=v_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GPU=gpu,
        **({"num_warps": 8 if block_d > 128 else 4, "num_stages": 2} if gpu else {}),
    )  # fmt: skip
    return out
