"""Fused backward of NAtS attention: dQ, dK, dV and the type-weight gradient (NATS_SPEC.md section 3).

With p_ij = exp(s_ij - LSE_i) (the *unmasked* normalised exponential), D_i = dO_i . O_i and

    dM_ij = p_ij (dO_i . v_j - D_i)            for every j <= i, masked pairs included,

the score gradient is dS_ij = M_ij dM_ij. The type gradients take dM with the estimator of spec section 3a:
``"exact"`` as written, ``"dense"`` (the default) with LSE_i replaced by the causal, unmasked LSEc_i
(``causal_lse.py``, a pass of its own before the kernels below), i.e. dM_ij scaled by
r_i = exp(LSE_i - LSEc_i) in (0, 1]; dS, and so dQ, dK and dV, are exact either way. The type gradients are

    d s_k = sum_{i=k}^{k+W-1} dM_ik,   d l_k = sum_{i=k}^{e_k} dM_ik,
    d g_k = sum_{i>=k} dM_ik - S(k),   S(k) = sum_{local j, p_k<j<k} sum_{i=k+1}^{e_k} dM_ij.

The segment term S reduces to O(N) quantities. Write C_j(m) = sum_{i<=m} dM_ij (column prefix) and
note d l_j = C_j(e_j). All locals j in (p_k, k) share e_j = e_k if k is not global, and e_j = k if k is:

    k not global:  S(k) = sum_{local j in (p_k,k)} [C_j(e_k) - C_j(k)] = sum_{local j in (p_k,k)} dl_j - T(k)
    k global:      S(k) = sum_{local j in (p_k,k)} [C_j(e_{e_j}) - C_j(e_j)] = sum_{local j in (p_k,k)} (dl2_j - dl_j)

with dl2_j = C_j(e_{e_j}) (column sum up to the global after the next one) and
T(k) = sum_{local j in (p_k,k)} C_j(k), a triangle of *visible* pairs inside k's segment; by rows,

    T(k) = sum_{m in (p_k,k)} ([m local] dM_mm + Rd_m) + Rd_k,    Rd_i = sum_{local j in (p_i,i)} dM_ij

(Rd_i: row i's dM over its visible local keys before i). So S needs four column sums of dM (all rows,
rows <= e_k, rows < k+W, rows <= e_{e_k}), two row sums (Rd_i, dM_ii) and segmented prefix sums.

Three kernels, run in this order:

1. ``_bwd_dq_kernel``, one program per (batch, query head, query block), walks only the keys the block can
   see, in the compact order of the forward (``forward.compact_ranges``): stores D_i, computes dQ and the
   row sums Rd_i and dM_ii.
2. ``_bwd_dkdv_kernel``, one program per (batch, KV head, key block), loops over the query heads of the
   group and over *all* query blocks from the diagonal on (d g_k sums dM over every later query); it
   accumulates dK and dV (on the query blocks that see the key block) and the four column sums, as
   reductions along the query axis of key-major tiles (inside a warp), without atomics.
   (Computing dQ here too, adding each tile's dS K into an fp32 buffer with atomics so that every score tile
   is computed once, was slower on an H200: 0.75 against 0.66 ms fwd+bwd at B=16, H=12, N=1024, D=64;
   docs/kernels.md.)
3. ``_type_grad_kernel``, one program per (batch, KV head), sums the row quantities over the query heads
   of the group, runs the segmented prefix sums (restarting after every global, chunked with a carry)
   and writes (dg, dl, ds) in the dtype of ``type_weights``.
"""

import torch

from . import _env
from ._env import INTERPRET, dot_precision, tl, triton
from .causal_lse import causal_lse
from .forward import compact_ranges, key_limit, load_compact, load_rows, query_program
from .plan import R_E, R_ROWS

# Largest exponent (base 2) of exp(s_ij - LSE_i) at masked pairs: half the float32 range, as in the reference.
EXP2_MAX = tl.constexpr(64.0)


def _dq_configs():
    return _env.configs(
        [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [
                (64, 32, 4, 2),
                (64, 32, 4, 3),
                (64, 64, 4, 2),
                (64, 64, 8, 2),
                (128, 32, 8, 2),
                (64, 32, 8, 2),
                (128, 64, 8, 2),
                (32, 64, 4, 3),
            ]
        ],
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    )


def _dkdv_configs():
    return _env.configs(
        [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [
                (32, 64, 4, 2),
                (64, 128, 8, 2),
                (64, 64, 4, 3),
                (32, 128, 8, 2),
                (64, 128, 8, 3),
                (32, 128, 4, 3),
                (64, 64, 8, 2),
                (16, 128, 4, 2),
            ]
        ],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    )


@triton.jit
def _dq_range(
    dq,
    rd,
    dd,
    q,
    do,
    lse,
    delta,
    offs_m,
    m0,
    q_hi,
    lo,
    hi,
    ORDp,
    LIMp,
    t_base,
    k_base,
    v_base,
    skn,
    svn,
    offs_d,
    qk_scale,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """dQ and the row sums Rd (visible locals before i; LOCAL: the range may hold locals, read their
    types) and dM_ii over the compact entries [lo, hi) (see forward.py)."""
    i2 = offs_m[:, None]
    for c0 in range(lo, hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        pos, lim, k, v = load_compact(ORDp, LIMp, offs_c, hi, k_base, v_base, skn, svn, offs_d)
        if LOCAL:
            is_l = tl.load(t_base + pos) == 1
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        # Rows beyond N give dM = 0 (q = dO = 0, LSE = D = 0).
        dm = tl.math.exp2(tl.minimum(qk - lse[:, None], EXP2_MAX)) * (dp - delta[:, None])
        # Scalar branches choose the ALU work per tile; the dots stay unconditional (a dot under an `if`
        # stops Triton from pipelining the loads).
        if (tl.max(pos, axis=0) < m0) & (tl.min(lim, axis=0) >= q_hi):  # all visible, none on the diagonal
            ds = dm
            if LOCAL:
                rd += tl.sum(tl.where(is_l[None, :], ds, 0.0), axis=1)
        else:
            p2 = pos[None, :]
            ds = tl.where((p2 <= i2) & (i2 <= lim[None, :]), dm, 0.0)
            dd += tl.sum(tl.where(p2 == i2, ds, 0.0), axis=1)  # M_ii = 1: the diagonal is visible
            if LOCAL:
                rd += tl.sum(tl.where(is_l[None, :] & (p2 < i2), ds, 0.0), axis=1)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    return dq, rd, dd


@_env.autotune(configs=_dq_configs(), key=["HEAD_DIM", "GROUP", "DENSE", "BLOCKS_FIRST"])
@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    LSEC,
    DELTA,
    T,
    PLAN,
    DQ,
    RD,
    DD,
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
    sdob,
    sdoh,
    sdon,
    sdqb,
    sdqh,
    sdqn,
    N,
    W,
    sm_scale,
    qk_scale,
    H_Q,
    GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCKS_FIRST: tl.constexpr,
    DENSE: tl.constexpr,
):
    pid_m, pid_bh, b, h, hk, head, m0, offs_m, offs_d, row_ok = query_program(
        N, H_Q, GROUP, BLOCK_M, HEAD_DIM, BLOCKS_FIRST
    )
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, row_ok)
    do = load_rows(DO + b * sdob + h * sdoh, offs_m, offs_d, sdon, row_ok)
    o = load_rows(O + b * sob + h * soh, offs_m, offs_d, son, row_ok)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh * N + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + pid_bh * N + offs_m, mask=row_ok, other=0.0)
    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1
    g_hi, b_lo, b_hi, c_lo, c_hi, ordp, limp, b_ord, b_lim = compact_ranges(PLAN, head, N, W, m0, q_hi)

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    t_base = T + head * N
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rd = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum of dM over the row's visible locals before it
    dd = tl.zeros([BLOCK_M], dtype=tl.float32)  # dM on the diagonal
    # (a) globals, (b) locals or the band's non-globals (the only range with locals), (c) sliding or nothing
    dq, rd, dd = _dq_range(
        dq,
        rd,
        dd,
        q,
        do,
        lse,
        delta,
        offs_m,
        m0,
        q_hi,
        0,
        g_hi,
        ordp,
        limp,
        t_base,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
        False,
    )
    dq, rd, dd = _dq_range(
        dq,
        rd,
        dd,
        q,
        do,
        lse,
        delta,
        offs_m,
        m0,
        q_hi,
        b_lo,
        b_hi,
        b_ord,
        b_lim,
        t_base,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
        True,
    )
    dq, rd, dd = _dq_range(
        dq,
        rd,
        dd,
        q,
        do,
        lse,
        delta,
        offs_m,
        m0,
        q_hi,
        c_lo,
        c_hi,
        ordp,
        limp,
        t_base,
        k_base,
        v_base,
        skn,
        svn,
        offs_d,
        qk_scale,
        BLOCK_N,
        DOT_PREC,
        False,
    )

    if DENSE:
        # the row sums feed the type gradients only: weight row i by r_i = exp(LSE_i - LSEc_i) in (0, 1]
        lsec = tl.load(LSEC + pid_bh * N + offs_m, mask=row_ok, other=0.0)
        r = tl.math.exp2(tl.minimum(lse - lsec, 0.0))
        rd = rd * r
        dd = dd * r
    dq = dq * sm_scale
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(RD + pid_bh * N + offs_m, rd, mask=row_ok)
    tl.store(DD + pid_bh * N + offs_m, dd, mask=row_ok)


@triton.jit
def _dkdv_step(
    dk,
    dv,
    col_all,
    col_l,
    col_s,
    col_l2,
    k,
    v,
    e,
    e2,
    lim,
    offs_n,
    n_lo,
    n_hi,
    l_end,
    l2_end,
    s_end,
    e_min,
    e2_min,
    lim_min,
    m0,
    q_base,
    do_base,
    lse_base,
    lsec_base,
    delta_base,
    sqn,
    sdon,
    offs_d,
    N,
    W,
    qk_scale,
    BLOCK_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    WITH_DKDV: tl.constexpr,
    DENSE: tl.constexpr,
):
    """One query block of the dK/dV kernel (key-major tiles [BLOCK_N, BLOCK_M]).

    The masked column sums are the plain column sum ``cs`` of the tile for every key whose row limit lies
    beyond the tile, zero for those whose limit lies before it; only tiles that hold some key's limit
    (a few per key block) pay for a masked reduction. Scalar branches choose the ALU work per tile; the
    dots stay unconditional (a dot under an `if` stops Triton from pipelining the loads).
    The column sums take dM with the masked normaliser LSE (``"exact"``) or, under DENSE, the causal one
    LSEc (spec section 3a); dK and dV are exact either way.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_hi = m0 + BLOCK_M - 1
    row_ok = offs_m < N
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdon + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    i2 = offs_m[None, :]
    j2 = offs_n[:, None]
    qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    # exp(s - LSE) is unbounded at masked pairs: clamp the exponent (as the reference does) so that dM
    # stays finite; visible pairs have s - LSE <= 0 and are unaffected.
    pT = tl.math.exp2(tl.minimum(qkT - lse[None, :], EXP2_MAX))
    dpdT = dpT - delta[None, :]
    dmT = pT * dpdT  # 0 in rows beyond N
    if DENSE:
        # exp(s_ij - LSEc_i) <= 1 at every causal pair (the min only trims rounding); under DENSE the exact
        # pT above feeds dK/dV alone and is not computed in the tiles past every key's limit
        lsec = tl.load(lsec_base + offs_m, mask=row_ok, other=0.0)
        cT = tl.math.exp2(tl.minimum(qkT - lsec[None, :], 0.0)) * dpdT
    else:
        cT = dmT
    crossing = m0 < n_hi  # some key of the block lies after some query of the tile
    if crossing:
        cT = tl.where(j2 <= i2, cT, 0.0)  # (dK's dmT is masked by `vis` below)
    if WITH_DKDV:
        if crossing | (lim_min < m_hi):
            vis = (j2 <= i2) & (i2 <= lim[:, None])
            dv += tl.dot(tl.where(vis, pT, 0.0).to(do.dtype), do, input_precision=DOT_PREC)
            dk += tl.dot(tl.where(vis, dmT, 0.0).to(q.dtype), q, input_precision=DOT_PREC)
        else:  # every key of the block is visible to every query of the tile
            dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
            dk += tl.dot(dmT.to(q.dtype), q, input_precision=DOT_PREC)
    cs = tl.sum(cT, axis=1)
    col_all += cs
    if m0 <= l_end:
        if e_min >= m_hi:
            col_l += cs
        else:
            col_l += tl.sum(tl.where(i2 <= e[:, None], cT, 0.0), axis=1)
    if m0 <= s_end:
        if n_lo + W - 1 >= m_hi:  # the first key's window (the shortest) covers the tile
            col_s += cs
        else:
            col_s += tl.sum(tl.where(i2 - j2 < W, cT, 0.0), axis=1)
    if m0 <= l2_end:
        if e2_min >= m_hi:
            col_l2 += cs
        else:
            col_l2 += tl.sum(tl.where(i2 <= e2[:, None], cT, 0.0), axis=1)
    return dk, dv, col_all, col_l, col_s, col_l2


@_env.autotune(configs=_dkdv_configs(), key=["HEAD_DIM", "GROUP", "DENSE", "BLOCKS_FIRST"])
@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    LSEC,
    DELTA,
    T,
    PLAN,
    DK,
    DV,
    COLS,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdob,
    sdoh,
    sdon,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    N,
    W,
    sm_scale,
    qk_scale,
    H_Q,
    GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCKS_FIRST: tl.constexpr,
    DENSE: tl.constexpr,
):
    # key blocks start first to last (the early ones see the most queries); under BLOCKS_FIRST the key blocks of
    # one head run side by side and share its Q and dO rows in L2
    if BLOCKS_FIRST:
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * H_KV + hk
    else:
        pid_bh = tl.program_id(0)
        pid_n = tl.program_id(1)
    H_KV = H_Q // GROUP
    b = (pid_bh // H_KV).to(tl.int64)
    hk = pid_bh % H_KV
    e_row = PLAN + (pid_bh.to(tl.int64) * R_ROWS + R_E) * N  # e_j of this (batch, KV head)

    # Key blocks by position. (Two variants that spare dK/dV matmuls measured slower on an H100, see
    # docs/kernels.md: blocks of the compact order, which hold keys of one type, and the globals' dK/dV in
    # blocks of their own.)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    ty = tl.load(T + pid_bh * N + offs_n, mask=col_ok, other=3).to(tl.int32)
    e = tl.load(e_row + offs_n, mask=col_ok, other=-1)
    e2 = tl.load(e_row + tl.maximum(e, 0), mask=col_ok, other=-1)  # global after the next one
    lim = key_limit(ty, e, offs_n, W, N)

    # Query blocks [m_start, live_end] see some key of the block (dK, dV); the masked column sums reach
    # queries l_end, l2_end and s_end at most; the plain one needs every query block from the first key.
    n_lo = tl.min(tl.where(col_ok, offs_n, N), axis=0)  # first and last key of the block
    n_hi = tl.max(tl.where(col_ok, offs_n, -1), axis=0)
    m_start = (n_lo // BLOCK_M) * BLOCK_M
    live_end = tl.max(lim, axis=0)
    l_end = tl.max(e, axis=0)
    l2_end = tl.max(e2, axis=0)
    s_end = n_hi + W - 1
    # (padding keys have e = lim = -1: the tile fast paths below are then never taken in the last block)
    e_min = tl.min(e, axis=0)
    e2_min = tl.min(e2, axis=0)
    lim_min = tl.min(lim, axis=0)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    col_all = tl.zeros([BLOCK_N], dtype=tl.float32)
    col_l = tl.zeros([BLOCK_N], dtype=tl.float32)
    col_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    col_l2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * H_Q + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        # two loops, so that neither holds a dot under an `if` (which would stop load pipelining)
        for m0 in range(m_start, live_end + 1, BLOCK_M):
            dk, dv, col_all, col_l, col_s, col_l2 = _dkdv_step(
                dk,
                dv,
                col_all,
                col_l,
                col_s,
                col_l2,
                k,
                v,
                e,
                e2,
                lim,
                offs_n,
                n_lo,
                n_hi,
                l_end,
                l2_end,
                s_end,
                e_min,
                e2_min,
                lim_min,
                m0,
                q_base,
                do_base,
                LSE + bh * N,
                LSEC + bh * N,
                DELTA + bh * N,
                sqn,
                sdon,
                offs_d,
                N,
                W,
                qk_scale,
                BLOCK_M,
                DOT_PREC,
                True,
                DENSE,
            )
        m_dead = tl.maximum(m_start, (live_end + 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        for m0 in range(m_dead, N, BLOCK_M):
            dk, dv, col_all, col_l, col_s, col_l2 = _dkdv_step(
                dk,
                dv,
                col_all,
                col_l,
                col_s,
                col_l2,
                k,
                v,
                e,
                e2,
                lim,
                offs_n,
                n_lo,
                n_hi,
                l_end,
                l2_end,
                s_end,
                e_min,
                e2_min,
                lim_min,
                m0,
                q_base,
                do_base,
                LSE + bh * N,
                LSEC + bh * N,
                DELTA + bh * N,
                sqn,
                sdon,
                offs_d,
                N,
                W,
                qk_scale,
                BLOCK_M,
                DOT_PREC,
                False,
                DENSE,
            )

    dk = dk * sm_scale
    tl.store(
        DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=col_ok[:, None],
    )
    tl.store(
        DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=col_ok[:, None],
    )
    cols = COLS + (pid_bh * N + offs_n) * 4
    tl.store(cols, col_all, mask=col_ok)
    tl.store(cols + 1, col_l, mask=col_ok)
    tl.store(cols + 2, col_s, mask=col_ok)
    tl.store(cols + 3, col_l2, mask=col_ok)


@triton.jit
def _seg_add(a1, b1, c1, f1, a2, b2, c2, f2):
    """Segmented-sum combine: a flag marks the first element of a segment."""
    keep = f2 != 0
    return tl.where(keep, a2, a1 + a2), tl.where(keep, b2, b1 + b2), tl.where(keep, c2, c1 + c2), f1 | f2


@triton.jit
def _type_grad_kernel(T, COLS, RD, DD, DTW, N, GROUP, stb, sth, stn, stc, H_KV, CH: tl.constexpr):
    head = tl.program_id(0)
    b = (head // H_KV).to(tl.int64)
    hk = head % H_KV
    base = head.to(tl.int64) * N
    ca = 0.0  # carries: segment sums of x_a, x_b, x_t up to the end of the previous chunk
    cb = 0.0
    ct = 0.0
    for c0 in range(0, N, CH):
        offs = c0 + tl.arange(0, CH)
        ok = offs < N
        ty = tl.load(T + base + offs, mask=ok, other=3).to(tl.int32)
        ty_prev = tl.load(T + base + offs - 1, mask=ok & (offs >= 1), other=0).to(tl.int32)
        col_all = tl.load(COLS + (base + offs) * 4, mask=ok, other=0.0)
        dl = tl.load(COLS + (base + offs) * 4 + 1, mask=ok, other=0.0)
        ds = tl.load(COLS + (base + offs) * 4 + 2, mask=ok, other=0.0)
        dl2 = tl.load(COLS + (base + offs) * 4 + 3, mask=ok, other=0.0)
        rd = tl.zeros([CH], dtype=tl.float32)
        dd = tl.zeros([CH], dtype=tl.float32)
        for g in range(GROUP):
            row = (head.to(tl.int64) * GROUP + g) * N
            rd += tl.load(RD + row + offs, mask=ok, other=0.0)
            dd += tl.load(DD + row + offs, mask=ok, other=0.0)
        is_l = ty == 1
        xa = tl.where(is_l, dl, 0.0)
        xb = tl.where(is_l, dl2 - dl, 0.0)
        xt = tl.where(is_l, dd, 0.0) + rd
        # a new segment starts after every global (and at position 0)
        flag = ((ty_prev == 0) | (offs == 0)).to(tl.int32)
        za, zb, zt, started = tl.associative_scan((xa, xb, xt, flag), 0, _seg_add)
        fresh = started == 0  # still in the segment that continues from the previous chunk
        za = tl.where(fresh, za + ca, za)
        zb = tl.where(fresh, zb + cb, zb)
        zt = tl.where(fresh, zt + ct, zt)
        last = offs == c0 + CH - 1
        ca = tl.sum(tl.where(last, za, 0.0), axis=0)
        cb = tl.sum(tl.where(last, zb, 0.0), axis=0)
        ct = tl.sum(tl.where(last, zt, 0.0), axis=0)
        # exclusive sums over (p_k, k)
        sa = za - xa
        sb = zb - xb
        st = zt - xt
        seg = tl.where(ty == 0, sb, sa - (st + rd))
        dg = col_all - seg
        out = DTW + b * stb + hk * sth + offs * stn
        tl.store(out, dg.to(DTW.dtype.element_ty), mask=ok)
        tl.store(out + stc, dl.to(DTW.dtype.element_ty), mask=ok)
        tl.store(out + 2 * stc, ds.to(DTW.dtype.element_ty), mask=ok)


def nats_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    types,
    plan,
    window: int,
    sm_scale: float | None = None,
    tw_dtype: torch.dtype = torch.float32,
    mask_grad: str = "dense",
):
    """Gradients (dq, dk, dv, d_type_weights) of NAtS attention.

    ``lse`` is the forward's base-2 log-sum-exp; ``types`` int8 [B, Hkv, N] and ``plan`` int32
    [B, Hkv, PLAN_ROWS, N] come from ``plan.compact_plan`` with the same window. ``d_type_weights`` is
    [B, Hkv, N, 3] in ``tw_dtype`` holding (dg, dl, ds), summed over the query heads of each GQA group,
    with the estimator ``mask_grad`` of spec section 3a ("dense": first a causal log-sum-exp pass,
    ``causal_lse.py``; "exact").
    """
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    if sm_scale is None:
        sm_scale = D**-0.5
    W = _env.clamp_window(window, N)
    q, k, v, do, o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, do, o))
    dev = q.device
    dq, dk, dv = (_env.grad_like(x) for x in (q, k, v))
    delta = _env.empty((B, HQ, N), torch.float32, dev)
    rd = _env.empty((B, HQ, N), torch.float32, dev)
    dd = _env.empty((B, HQ, N), torch.float32, dev)
    cols = _env.empty((B, HKV, N, 4), torch.float32, dev)
    dtw = _env.empty((B, HKV, N, 3), tw_dtype, dev)
    qk_scale = sm_scale * 1.4426950408889634
    group = HQ // HKV
    prec = dot_precision(q.dtype)
    dense = mask_grad == "dense"
    if not dense and mask_grad != "exact":
        raise ValueError(f"mask_grad must be 'dense' or 'exact', got {mask_grad!r}")
    lsec = causal_lse(q, k, sm_scale) if dense else lse  # (unused by the kernels under "exact")

    bf = _env.blocks_first(B * HQ)
    grid_q = lambda meta: _env.block_grid(B * HQ, N, meta["BLOCK_M"], bf)
    _bwd_dq_kernel[grid_q](
        q,
        k,
        v,
        o,
        do,
        lse,
        lsec,
        delta,
        types,
        plan,
        dq,
        rd,
        dd,
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
        do.stride(0),
        do.stride(1),
        do.stride(2),
        dq.stride(0),
        dq.stride(1),
        dq.stride(2),
        N,
        W,
        sm_scale,
        qk_scale,
        HQ,
        group,
        HEAD_DIM=D,
        DOT_PREC=prec,
        DENSE=dense,
        BLOCKS_FIRST=bf,
    )
    grid_k = lambda meta: _env.block_grid(B * HKV, N, meta["BLOCK_N"], bf)
    _bwd_dkdv_kernel[grid_k](
        q,
        k,
        v,
        do,
        lse,
        lsec,
        delta,
        types,
        plan,
        dk,
        dv,
        cols,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dv.stride(0),
        dv.stride(1),
        dv.stride(2),
        N,
        W,
        sm_scale,
        qk_scale,
        HQ,
        group,
        HEAD_DIM=D,
        DOT_PREC=prec,
        DENSE=dense,
        BLOCKS_FIRST=bf,
    )
    ch = 64 if INTERPRET else min(1024, max(64, triton.next_power_of_2(N)))
    _type_grad_kernel[(B * HKV,)](types, cols, rd, dd, dtw, N, group, *dtw.stride(), HKV, CH=ch, num_warps=4)
    return dq, dk, dv, dtw
