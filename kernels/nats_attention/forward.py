"""Training forward kernel: FlashAttention-2 style attention under the NAtS mask, built on chip.

For query i and key j the kernel decides visibility from the key's hard type t_j (int8) and e_j (the
index of the next global token of its head, see ``indices.py``):

    visible(i, j) = j <= i and (t_j == global or (t_j == local and i <= e_j) or (t_j == sliding and i - j < W))

No N x N mask exists in memory. Key blocks that no query of the current query block can see are skipped
(exact at block granularity: a key block is skipped only if every one of its keys is invisible to every
query of the block): the launcher lists, per query block, the live key blocks (O(N^2 / (BLOCK_M BLOCK_N))
small integers, from O(N) per-key-block summaries), and the kernel walks only that list, so its loads stay
unconditional and pipelined. Key blocks that every query of the block sees entirely skip the masking. The
kernel also writes the row log-sum-exp (base 2, of the scaled scores) for the backward pass.
"""

import torch

from . import _env
from ._env import INTERPRET, dot_precision, tl, triton
from . import HEAD_DIMS
from .plan import block_lists


@triton.jit
def key_limit(ty, e, offs_n, W, N):
    """Per key j: the last query that sees it (key j is visible to the queries j..limit), -1 for padding.

    N-1 for a global, e_j for a local, j+W-1 for a sliding key; ``ty`` is 3 beyond the sequence.
    """
    return tl.where(ty == 0, N - 1, tl.where(ty == 1, e, tl.where(ty == 2, offs_n + W - 1, -1)))


@triton.jit
def query_program(N, H_Q, GROUP, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Who a program of a query-block kernel (grid: batch*query heads x query blocks) is.

    Returns its ids, batch b, query head h, KV head hk (GQA), ``head`` = the (batch, KV head) row of the
    per-head O(N) arrays, its first query m0, query rows offs_m, offs_d and the row mask.
    Query blocks run last first: under a causal mask the late blocks have the most keys, and the GPU starts
    programs in grid order (axis 0 fastest), so the long programs start first and the short ones fill the tail.
    """
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
def listed_below_diagonal(n_listed, m0, q_hi, BLOCK_N: tl.constexpr):
    """How many entries of a query block's key-block list lie wholly below its diagonal (every key before the
    block's first query m0). The list is ascending and ends with the blocks that cross the diagonal, those
    holding a key in [m0, q_hi] (q_hi: the block's last real query); each holds a query of the block, which
    sees itself, so all of them are listed."""
    return n_listed - (q_hi // BLOCK_N - m0 // BLOCK_N + 1)


@triton.jit
def load_rows(base, offs_m, offs_d, stride_n, row_ok):
    """Rows offs_m of a [N, D] slice as a [BLOCK_M, D] tile, 0 beyond N."""
    return tl.load(base + offs_m[:, None] * stride_n + offs_d[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def load_key_tile(t_base, e_base, k_base, v_base, offs_n, offs_d, skn, svn, N):
    """Types (3 beyond N), next-global indices (-1 beyond N), K and V rows (0 beyond N) of key block offs_n."""
    col_ok = offs_n < N
    ty = tl.load(t_base + offs_n, mask=col_ok, other=3).to(tl.int32)
    e = tl.load(e_base + offs_n, mask=col_ok, other=-1)
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    return ty, e, k, v


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


# Query/key block sizes of the forward are fixed per head dim (the live-block lists below depend on
# them); the autotuner picks warps and pipeline stages only.
def fwd_blocks(head_dim: int) -> tuple[int, int]:
    if INTERPRET:
        return 32, 16
    return _env.BLOCKS.get("fwd", (128, 64))


def _fwd_configs():
    return _env.configs([triton.Config({}, num_warps=w, num_stages=s)
                         for w, s in [(8, 3), (4, 3), (8, 2), (4, 4), (8, 4)]],
                        triton.Config({}, num_warps=4, num_stages=1))


def live_key_blocks(types: torch.Tensor, e: torch.Tensor, window: int, block_m: int, block_n: int):
    """Per (batch, KV head, query block): the key blocks holding a pair visible to the query block.

    A key block is visible to the queries [its start, last] with last = N-1 if it holds a global, else
    the largest of e_j over its locals and j+W-1 over its sliding keys; a query block [m0, m1] needs it
    iff start <= m1 and last >= m0 (exact at block granularity: no visible pair is skipped).
    PyTorch version (for tests) of ``plan.block_lists``, which the kernels use.

    Returns ``idx`` int32 [B, Hkv, NQB, NKB] (listed key-block indices first, ascending) and ``cnt``
    int32 [B, Hkv, NQB].
    """
    B, H, N = types.shape
    nkb, nqb = -(-N // block_n), -(-N // block_m)
    pad = nkb * block_n - N
    t = torch.nn.functional.pad(types.to(torch.int32), (0, pad), value=3).view(B, H, nkb, block_n)
    ee = torch.nn.functional.pad(e, (0, pad), value=-1).view(B, H, nkb, block_n)
    pos = torch.arange(nkb * block_n, device=types.device, dtype=torch.int32).view(nkb, block_n)
    has_g = (t == 0).any(-1)
    last_l = torch.where(t == 1, ee, -1).amax(-1)
    last_s = torch.where(t == 2, pos + (window - 1), -1).amax(-1)
    last = torch.where(has_g, N - 1, torch.maximum(last_l, last_s))  # [B, H, nkb]
    q_start = torch.arange(nqb, device=types.device) * block_m
    q_end = (q_start + block_m).clamp(max=N) - 1
    k_start = torch.arange(nkb, device=types.device) * block_n
    causal = k_start[None, :] <= q_end[:, None]  # [nqb, nkb]
    live = causal & (last[:, :, None, :] >= q_start[None, None, :, None])
    cnt = live.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~live).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return idx.contiguous(), cnt.contiguous()


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, n0, offs_m, offs_d, q_hi, k_base, v_base, t_base, e_base, skn, svn, N, W,
              qk_scale, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DIAG: tl.constexpr):
    """Online-softmax update of one query block with the key block starting at n0.

    DIAG: the key block crosses the query block's diagonal (causal and key-limit mask); otherwise only the
    key limits can hide a pair, and a block whose keys every query of the block sees needs no mask.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ty, e, k, v = load_key_tile(t_base, e_base, k_base, v_base, offs_n, offs_d, skn, svn, N)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    lim = key_limit(ty, e, offs_n, W, N)
    if DIAG:
        vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] <= lim[None, :])
        s = tl.where(vis, qk, float("-inf"))
    elif tl.min(lim, axis=0) >= q_hi:
        s = qk
    else:
        s = tl.where(offs_m[:, None] <= lim[None, :], qk, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC)


@triton.autotune(configs=_fwd_configs(), key=["HEAD_DIM", "BLOCK_M", "BLOCK_N"])
@triton.jit
def _nats_fwd_kernel(
    Q, K, V, T, E, O, LSE, KB_IDX, KB_CNT,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    N, W, qk_scale,  # qk_scale = sm_scale * log2(e)
    H_Q, GROUP, NQB, NKB,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m, pid_bh, b, h, hk, head, m0, offs_m, offs_d, row_ok = query_program(N, H_Q, GROUP, BLOCK_M, HEAD_DIM)
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, row_ok)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    t_base = T + head * N
    e_base = E + head * N
    list_base = KB_IDX + (head * NQB + pid_m) * NKB
    n_live = tl.load(KB_CNT + head * NQB + pid_m)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1  # last real query of the block
    # Two loops over the list, the first without the causal mask (see listed_below_diagonal).
    # (Walking the causal key blocks directly when all are live, to spare the index load, measured no faster:
    # the list walk pipelines well. docs/results/sweep_kernel_blocks_h200.md)
    n_below = listed_below_diagonal(n_live, m0, q_hi, BLOCK_N)
    for t in range(n_below):
        n0 = tl.load(list_base + t) * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, n0, offs_m, offs_d, q_hi, k_base, v_base,
                                  t_base, e_base, skn, svn, N, W, qk_scale, BLOCK_N, DOT_PREC, False)
    for t in range(n_below, n_live):
        n0 = tl.load(list_base + t) * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, n0, offs_m, offs_d, q_hi, k_base, v_base,
                                  t_base, e_base, skn, svn, N, W, qk_scale, BLOCK_N, DOT_PREC, True)

    # Every real row sees its own key (M_ii = 1), so l_i > 0 there.
    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + pid_bh * N + offs_m, m_i + tl.math.log2(l_safe), mask=row_ok)


def nats_forward(q, k, v, types, e, window: int, sm_scale: float | None = None):
    """o [B,Hq,N,D] and lse2 [B,Hq,N] fp32 (log2-sum-exp2 of sm_scale*log2(e)*q.k over visible keys).

    ``types`` int8 [B,Hkv,N] (contiguous), ``e`` int32 [B,Hkv,N] next-global indices.
    """
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    assert HQ % HKV == 0, "the number of query heads must be a multiple of the number of KV heads"
    check_head_dim(D)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if sm_scale is None:
        sm_scale = D ** -0.5
    W = int(min(max(int(window), 1), N + 1))
    o = _env.empty_bnhd(q.shape, q.dtype, q.device)
    lse = _env.empty((B, HQ, N), torch.float32, q.device)
    bm, bn = fwd_blocks(D)
    kb_idx, kb_cnt = block_lists(types, e, W, bm, bn)
    grid = (B * HQ, _env.grid_blocks(N, bm))
    _nats_fwd_kernel[grid](
        q, k, v, types, e, o, lse, kb_idx, kb_cnt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        N, W, sm_scale * 1.4426950408889634,
        HQ, HQ // HKV, kb_idx.shape[2], kb_idx.shape[3],
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=dot_precision(q.dtype),
    )
    return o, lse
