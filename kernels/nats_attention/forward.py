"""Forward kernel of NAtS attention (training and prefill): cost proportional to the kept entries.

For query i and key j the kernels decide visibility from the key's hard type t_j and e_j (the index of
the next global token of its head, see ``plan.py``). Each key has a *limit*, the last query that sees
it: N-1 for a global, e_j for a local, j+W-1 for a sliding token; then

    visible(i, j) = j <= i <= limit_j.

No N x N mask exists in memory. Skipping key blocks is not enough to make a sparse mask cheap: a few
global tokens in every key block keep every block alive. So the kernel walks each head's keys in the
*compact order* of ``plan.py``, [globals | locals | sliding tokens], each group by position, where the keys
a query block [m0, m1] can see lie in three contiguous ranges (``compact_ranges``):

  (a) the globals at positions <= m1;
  (b) the locals after p, the last global before m0 (a local at or before p died at p);
  (c) the sliding tokens at positions >= m0 - W + 1.

Each key is in exactly one range. The kernel (FlashAttention-2 online softmax, fp32 accumulators) loads K/V
rows through the order (no copy of K/V: a copy measured 8% slower at 128k on an H100) and masks only tiles
that need it, so its work per query block is about #globals so far + #live locals + #keys of the band.
For training it also writes the row log-sum-exp (base 2, of the scaled scores) for the backward pass.
"""

import torch

from . import HEAD_DIMS, _env
from ._env import dot_precision, tl, triton
from .plan import R_CG, R_CL, R_CS, R_LIM, R_LIM2, R_ORD, R_ORD2, R_P, R_ROWS


@triton.jit
def key_limit(ty, e, offs_n, W, N):
    """Per key j: the last query that sees it (key j is visible to the queries j..limit), -1 for padding.

    N-1 for a global, e_j for a local, j+W-1 for a sliding key; ``ty`` is 3 beyond the sequence.
    """
    return tl.where(ty == 0, N - 1, tl.where(ty == 1, e, tl.where(ty == 2, offs_n + W - 1, -1)))


@triton.jit
def query_program(N, H_Q, GROUP, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCKS_FIRST: tl.constexpr):
    """Who a program of a query-block kernel (grid ``_env.block_grid``: query blocks x batch*query heads under
    BLOCKS_FIRST, else the transpose) is.

    Returns its ids, batch b, query head h, KV head hk (GQA), ``head`` = the (batch, KV head) row of the
    per-head O(N) arrays, its first query m0, query rows offs_m, offs_d and the row mask.
    Query blocks run last first: under a causal mask the late blocks have the most keys, and the GPU starts
    programs in grid order (axis 0 fastest), so the long programs (of a head, under BLOCKS_FIRST) start first
    and the short ones fill the tail.
    """
    if BLOCKS_FIRST:
        pid_bh = tl.program_id(1)
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)  # int64: batch offsets can exceed 2**31
    h = pid_bh % H_Q
    hk = h // GROUP
    head = b * (H_Q // GROUP) + hk
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    return pid_m, pid_bh, b, h, hk, head, m0, offs_m, tl.arange(0, HEAD_DIM), offs_m < N


@triton.jit
def load_rows(base, offs_m, offs_d, stride_n, row_ok):
    """Rows offs_m of a [N, D] slice as a [BLOCK_M, D] tile, 0 beyond N."""
    return tl.load(base + offs_m[:, None] * stride_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC: tl.constexpr):
    """FlashAttention's update of (acc, row max m_i, row sum l_i) with base-2 scores s [M, N] and values v."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


def check_head_dim(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"the NAtS Triton kernels support head dims {HEAD_DIMS}, got {d}; use the reference")


@triton.jit
def compact_ranges(PLAN, head, N, W, m0, q_hi):
    """The compact entries that queries [m0, q_hi] can see, as three ranges (module doc):

    (a) entries [0, g_hi) of ORD; (b) entries [b_lo, b_hi) of the order at ``b_ord`` (limits at ``b_lim``);
    (c) entries [c_lo, c_hi) of ORD. (b) is the live locals and (c) the band's sliding tokens, or, when the
    last global before m0 lies in the band (then every live local does too), (b) is the band's non-globals
    in ORD2 and (c) is empty: one range instead of two, so one ragged tile fewer.
    Returns g_hi, b_lo, b_hi, c_lo, c_hi and the pointers ORD, LIM, b_ord, b_lim of this (batch, KV head)."""
    plan = PLAN + head * (R_ROWS * N)
    cg = plan + R_CG * N
    cl = plan + R_CL * N
    cs = plan + R_CS * N
    ordp = plan + R_ORD * N
    limp = plan + R_LIM * N
    n_g = tl.load(cg + N - 1)
    n_l = tl.load(cl + N - 1)
    g_hi = tl.load(cg + q_hi)  # (a) globals at positions <= q_hi
    p_m0 = tl.load(plan + R_P * N + m0)  # the last global before m0
    s_first = m0 - W + 1  # first position of the band
    if p_m0 + 1 >= s_first:
        # the non-globals at positions [s_first, q_hi]: counts of non-globals are (j + 1) - CG(j)
        b_lo = n_g + tl.where(s_first > 0, s_first - tl.load(cg + tl.maximum(s_first, 1) - 1), 0)
        b_hi = n_g + q_hi + 1 - g_hi
        b_ord = plan + R_ORD2 * N
        b_lim = plan + R_LIM2 * N
        c_lo = 0
        c_hi = 0
    else:
        # (b) locals after the last global before m0; (c) sliding tokens at positions >= s_first
        b_lo = n_g + tl.where(p_m0 >= 0, tl.load(cl + tl.maximum(p_m0, 0)), 0)
        b_hi = n_g + tl.load(cl + q_hi)
        b_ord = ordp
        b_lim = limp
        c_lo = n_g + n_l + tl.where(s_first > 0, tl.load(cs + tl.maximum(s_first, 1) - 1), 0)
        c_hi = n_g + n_l + tl.load(cs + q_hi)
    return g_hi, b_lo, b_hi, c_lo, c_hi, ordp, limp, b_ord, b_lim


@triton.jit
def load_compact(ORDp, LIMp, offs_c, hi, k_base, v_base, skn, svn, offs_d):
    """Compact entries offs_c (those from ``hi`` on are padding): positions (0 for padding), limits (-1 for
    padding: seen by no query) and their K and V rows."""
    ok = offs_c < hi
    pos = tl.load(ORDp + offs_c, mask=ok, other=0)
    lim = tl.load(LIMp + offs_c, mask=ok, other=-1)
    k = tl.load(k_base + pos[:, None] * skn + offs_d[None, :])
    v = tl.load(v_base + pos[:, None] * svn + offs_d[None, :])
    return pos, lim, k, v


def _fwd_configs():
    return _env.configs(
        [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [
                (128, 64, 8, 2),
                (128, 64, 8, 3),
                (128, 64, 4, 3),
                (64, 64, 4, 3),
                (64, 32, 4, 3),
                (128, 32, 4, 3),
                (128, 128, 8, 2),
                (128, 128, 8, 3),
                (64, 128, 4, 3),
            ]
        ],
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    )


@triton.jit
def _fwd_range(
    acc,
    m_i,
    l_i,
    q,
    offs_m,
    m0,
    q_hi,
    lo,
    hi,
    ORDp,
    LIMp,
    k_base,
    v_base,
    skn,
    svn,
    offs_d,
    qk_scale,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with the compact entries [lo, hi)."""
    for c0 in range(lo, hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        pos, lim, k, v = load_compact(ORDp, LIMp, offs_c, hi, k_base, v_base, skn, svn, offs_d)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        # a tile that every query of the block sees entirely needs no mask (no dot under this `if`: Triton
        # would stop pipelining the loop's loads)
        if (tl.max(pos, axis=0) <= m0) & (tl.min(lim, axis=0) >= q_hi):
            s = qk
        else:
            vis = (pos[None, :] <= offs_m[:, None]) & (offs_m[:, None] <= lim[None, :])
            s = tl.where(vis, qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    return acc, m_i, l_i


@_env.autotune(configs=_fwd_configs(), key=["HEAD_DIM", "GROUP", "STORE_LSE", "BLOCKS_FIRST"])
@triton.jit
def _nats_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    PLAN,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    son,
    N,
    W,
    qk_scale,
    H_Q,
    GROUP,  # qk_scale = sm_scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCKS_FIRST: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    pid_m, pid_bh, b, h, hk, head, m0, offs_m, offs_d, row_ok = query_program(
        N, H_Q, GROUP, BLOCK_M, HEAD_DIM, BLOCKS_FIRST
    )
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, row_ok)
    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1  # last real query of the block
    g_hi, b_lo, b_hi, c_lo, c_hi, ordp, limp, b_ord, b_lim = compact_ranges(PLAN, head, N, W, m0, q_hi)

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _fwd_range(
        acc,
        m_i,
        l_i,
        q,
        offs_m,
        m0,
        q_hi,
        0,
        g_hi,
        ordp,
        limp,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
    )
    acc, m_i, l_i = _fwd_range(
        acc,
        m_i,
        l_i,
        q,
        offs_m,
        m0,
        q_hi,
        b_lo,
        b_hi,
        b_ord,
        b_lim,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
    )
    acc, m_i, l_i = _fwd_range(
        acc,
        m_i,
        l_i,
        q,
        offs_m,
        m0,
        q_hi,
        c_lo,
        c_hi,
        ordp,
        limp,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
    )

    # Every real row sees its own key (M_ii = 1), so l_i > 0 there.
    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )
    if STORE_LSE:
        tl.store(LSE + pid_bh * N + offs_m, m_i + tl.math.log2(l_safe), mask=row_ok)


def forward_launch(heads: int, N: int, D: int, dtype, store_lse: bool):
    """(grid, constexprs) of ``_nats_fwd_kernel`` for ``heads`` = batch x query heads, N queries, head dim D."""
    bf = _env.blocks_first(heads)
    grid = lambda meta: _env.block_grid(heads, N, meta["BLOCK_M"], bf)  # noqa: E731
    return grid, dict(HEAD_DIM=D, DOT_PREC=dot_precision(dtype), BLOCKS_FIRST=bf, STORE_LSE=store_lse)


def nats_forward(q, k, v, plan, window: int, sm_scale: float | None = None, store_lse: bool = True):
    """o [B,Hq,N,D] (stored as [B,N,Hq,D]) and lse2 [B,Hq,N] fp32 (log2-sum-exp2 of sm_scale*log2(e)*q.k over
    the visible keys; None unless ``store_lse``), for the int32 ``plan`` [B,Hkv,PLAN_ROWS,N] of
    ``plan.compact_plan`` made with the same window."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    assert HQ % HKV == 0, "the number of query heads must be a multiple of the number of KV heads"
    check_head_dim(D)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if sm_scale is None:
        sm_scale = D**-0.5
    W = _env.clamp_window(window, N)
    o = _env.empty_bnhd(q.shape, q.dtype, q.device)
    lse = _env.empty((B, HQ, N), torch.float32, q.device) if store_lse else o
    grid, meta = forward_launch(B * HQ, N, D, q.dtype, store_lse)
    _nats_fwd_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        plan,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        N,
        W,
        sm_scale * 1.4426950408889634,
        HQ,
        HQ // HKV,
        **meta,
    )
    return o, (lse if store_lse else None)
