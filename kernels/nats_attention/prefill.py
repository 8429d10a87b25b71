"""Inference prefill with hard types: attention whose cost follows the kept entries, not N^2.

Block skipping alone cannot make a sparse NAtS mask cheap: a few global tokens in every key block keep
every block alive. So the keys of each (batch, KV head) are first put in a compact order, grouped by type
and sorted by position inside each group (an O(N) counting scatter in PyTorch, no sort):

    order = [ globals by position | locals by position | sliding tokens by position ]

Each entry also gets ``lim``, the last query that sees it: N-1 for a global, e_j for a local (its next
global), j+W-1 for a sliding token. Key j is then visible to query i iff j <= i <= lim_j, and for a
query block [m0, m1] the keys it can see lie in three *contiguous* ranges of the compact order:

  (a) the globals with position <= m1;
  (b) the locals with position in (p, m1], p = the last global before m0 (older locals are dead);
  (c) the sliding tokens with position in [m0 - W + 1, m1].

The kernel (FlashAttention-2 style online softmax) walks these three ranges, loading K/V rows through
the index array (no copy of K/V: a variant reading K/V copied into the compact order measured 8% slower at
128k on an H100, the copy included), with the mask ``pos <= i <= lim`` only on tiles that need it. Each key
is in exactly one list, so nothing is counted twice. Work per query block is about (#globals so far +
#live locals + #sliding keys in the band), i.e. proportional to the kept entries of the mask.
"""

import torch

from . import _env
from ._env import dot_precision, tl, triton
from .forward import check_head_dim, load_rows, online_softmax_step, query_program
from .plan import type_indices


def _prefill_configs():
    return _env.configs(
        [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
         for bm, bn, w, s in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                              (128, 128, 8, 3), (128, 32, 4, 3), (64, 128, 4, 3)]],
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1))


@triton.jit
def _attend_range(acc, m_i, l_i, q, offs_m, m0, q_hi, lo, hi, ORD, LIM, k_base, v_base, skn, svn,
                  offs_d, qk_scale, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online-softmax update of (acc, m_i, l_i) with the compact entries [lo, hi)."""
    for c0 in range(lo, hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        ok = offs_c < hi
        pos = tl.load(ORD + offs_c, mask=ok, other=0)
        lim = tl.load(LIM + offs_c, mask=ok, other=-1)
        k = tl.load(k_base + pos[:, None] * skn + offs_d[None, :])
        v = tl.load(v_base + pos[:, None] * svn + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        full = (tl.max(tl.where(ok, pos, 0), axis=0) <= m0) & (tl.min(tl.where(ok, lim, q_hi), axis=0) >= q_hi)
        full = full & (c0 + BLOCK_N <= hi)
        if full:
            s = qk
        else:
            vis = (pos[None, :] <= offs_m[:, None]) & (offs_m[:, None] <= lim[None, :])
            s = tl.where(vis, qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    return acc, m_i, l_i


@triton.autotune(configs=_prefill_configs(), key=["HEAD_DIM", "GROUP"])
@triton.jit
def _nats_prefill_kernel(
    Q, K, V, O, ORD, LIM, CUM, PREV,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    N, W, qk_scale, H_Q, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    _, _, b, h, hk, head, m0, offs_m, offs_d, row_ok = query_program(N, H_Q, GROUP, BLOCK_M, HEAD_DIM)
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, row_ok)
    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1

    ordp = ORD + head * N
    limp = LIM + head * N
    cum = CUM + head * N * 3  # inclusive counts of (global, local, sliding) tokens at each position
    n_g = tl.load(cum + (N - 1) * 3 + 0)
    n_l = tl.load(cum + (N - 1) * 3 + 1)
    # (a) globals at positions <= q_hi
    g_hi = tl.load(cum + q_hi * 3 + 0)
    # (b) locals after the last global before m0
    p_m0 = tl.load(PREV + head * N + m0)
    l_lo = tl.load(cum + tl.maximum(p_m0, 0) * 3 + 1)
    l_lo = tl.where(p_m0 >= 0, l_lo, 0)
    l_hi = tl.load(cum + q_hi * 3 + 1)
    # (c) sliding tokens at positions >= m0 - W + 1
    s_first = m0 - W + 1
    s_lo = tl.load(cum + (tl.maximum(s_first, 1) - 1) * 3 + 2)
    s_lo = tl.where(s_first > 0, s_lo, 0)
    s_hi = tl.load(cum + q_hi * 3 + 2)

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, offs_m, m0, q_hi, 0, g_hi, ordp, limp,
                                  k_base, v_base, skn, svn, offs_d, qk_scale, BLOCK_N, DOT_PREC)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, offs_m, m0, q_hi, n_g + l_lo, n_g + l_hi, ordp, limp,
                                  k_base, v_base, skn, svn, offs_d, qk_scale, BLOCK_N, DOT_PREC)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, offs_m, m0, q_hi, n_g + n_l + s_lo, n_g + n_l + s_hi,
                                  ordp, limp, k_base, v_base, skn, svn, offs_d, qk_scale, BLOCK_N, DOT_PREC)

    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])


def prefill_plan(types: torch.Tensor, window: int):
    """Compact order, per-entry last query, inclusive type counts and previous-global index (all O(N)).

    Returns ``order`` int32 [B,H,N] (positions: globals, then locals, then sliding, each by position),
    ``lim`` int32 [B,H,N] (last query seeing each compact entry), ``cum`` int32 [B,H,N,3] and
    ``prev`` int32 [B,H,N].
    """
    t = types.long()
    B, H, N = t.shape
    pos = torch.arange(N, device=t.device)
    onehot = t[..., None] == torch.arange(3, device=t.device)
    cum = onehot.to(torch.int32).cumsum(2, dtype=torch.int32)  # [B,H,N,3]
    tot = cum[:, :, -1, :]
    base = torch.stack([torch.zeros_like(tot[..., 0]), tot[..., 0], tot[..., 0] + tot[..., 1]], dim=-1)
    dest = base.gather(2, t) + cum.gather(3, t[..., None]).squeeze(-1) - 1
    order = torch.empty((B, H, N), dtype=torch.int32, device=t.device)
    order.scatter_(2, dest, pos.to(torch.int32).expand(B, H, N).contiguous())
    _, e, prev = type_indices(types)
    lim = torch.where(t == 0, torch.full_like(e, N - 1),
                      torch.where(t == 1, e, (pos + (window - 1)).clamp(max=N - 1).to(torch.int32)))
    lim_c = lim.gather(2, order.long()).to(torch.int32).contiguous()
    return order.contiguous(), lim_c, cum.contiguous(), prev


def nats_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor, window: int,
                 sm_scale: float | None = None) -> torch.Tensor:
    """NAtS attention output [B,Hq,N,D] for hard integer types [B,Hkv,N] (no gradient), see module doc."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    if HQ % HKV != 0 or k.shape != v.shape or tuple(types.shape) != (B, HKV, N):
        raise ValueError(f"expected q [B,Hq,N,D], k/v [B,Hkv,N,D], types [B,Hkv,N]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(types.shape)}")
    check_head_dim(D)
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    W = min(window, N + 1)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if sm_scale is None:
        sm_scale = D ** -0.5
    order, lim, cum, prev = prefill_plan(types, W)
    o = _env.empty(q.shape, q.dtype, q.device)
    grid = lambda meta: (B * HQ, _env.grid_blocks(N, meta["BLOCK_M"]))
    _nats_prefill_kernel[grid](
        q, k, v, o, order, lim, cum, prev,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        N, W, sm_scale * 1.4426950408889634, HQ, HQ // HKV,
        HEAD_DIM=D, DOT_PREC=dot_precision(q.dtype),
    )
    return o
