# ruff: noqa: E741  (a record of what ran, as it ran)
"""Lab: the decode kernel with the tile's keys split over warps (a batched dot: each warp its
own keys, its own running max and sum; merged once at the end)."""

import triton
import triton.language as tl

from services.worker.engine.attention.triton_kernels import (
    DECODE_PER_STEP,
    _compute_dtype,
    _prefetch_rows,
    _widen_values,
)
from services.worker.engine.dependent_launch import await_inputs


@triton.jit(do_not_specialize=DECODE_PER_STEP)
def _decode_ws(
    Q, K, V, Out, part_acc, part_ml,
    block_tables, query_start_loc, seq_lens, first_req, order,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    qk_scale, v_scale,
    KV_BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, ORDERED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, DOT_F16: tl.constexpr = False, GPU: tl.constexpr = False,
    LANES: tl.constexpr = 4, PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    await_inputs(USE_PDL)
    if ORDERED:
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
    STEP: tl.constexpr = LANES * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), STEP) * STEP
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, LANES)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _compute_dtype(q, DOT_F16)
    qb = tl.broadcast_to(q[None, :, :], (LANES, GROUP_PAD, BLOCK_D))
    m_i = tl.full([LANES, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([LANES, GROUP_PAD], tl.float32)
    acc = tl.zeros([LANES, GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, STEP):
        offs_n = start + offs_w[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [L, N]
        n_ok = offs_n < hi
        if PREFETCH > 0 and GPU:
            ahead = tl.reshape(offs_n, [LANES * BLOCK_N]) + PREFETCH * STEP
            a_ok = ahead < hi
            a_block = tl.load(table + ahead // KV_BLOCK, mask=a_ok, other=0).to(tl.int64)
            a_kv = a_block * stride_kb + (ahead % KV_BLOCK) * stride_ks + kv_head * stride_kh
            row_bytes: tl.constexpr = HEAD_DIM * K.dtype.element_ty.primitive_bitwidth // 8
            _prefetch_rows(K, a_kv, a_ok, row_bytes)
            _prefetch_rows(V, a_kv, a_ok, row_bytes)
        block = tl.load(table + offs_n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv = block * stride_kb + (offs_n % KV_BLOCK) * stride_ks + kv_head * stride_kh
        ptr = kv[:, :, None] + offs_d[None, None, :]
        mask = n_ok[:, :, None] & d_ok[None, None, :]
        k = tl.load(K + ptr, mask=mask, other=0.0)
        v = tl.load(V + ptr, mask=mask, other=0.0)
        k, v = k.to(q.dtype), _widen_values(v, q.dtype, GPU)
        s = tl.dot(qb, tl.permute(k, (0, 2, 1)), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # merge the lanes
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_safe[None, :]))
    l = tl.sum(l_i * w, 0)
    acc = tl.sum(acc * w[:, :, None], 0)
    out_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc * v_scale / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(
            Out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        slot = (local.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(
            part_acc + slot[:, None] * BLOCK_D + offs_d[None, :], acc * v_scale, mask=g_ok[:, None]
        )
        tl.store(part_ml + slot * 2, m, mask=g_ok)
        tl.store(part_ml + slot * 2 + 1, l, mask=g_ok)
