"""Causal (unmasked) row log-sum-exp: the normaliser of the ``"dense"`` type-gradient estimator.

NATS_SPEC.md section 3a: with ``mask_grad="dense"`` the type gradients use

    dM_ij = exp(s_ij - LSEc_i) (dO_i . v_j - D_i),     LSEc_i = log sum_{k <= i} exp(s_ik),

the log-sum-exp over *every* causal key, not only the kept ones, so that each term is bounded by
|dO_i . v_j - D_i|. The forward pass walks only the kept keys (``forward.py``), so LSEc needs a pass of its
own over the causal triangle: one QK^T tile and one exp2 per (query block, key block), no PV product, about
a seventh of a dense attention's fwd+bwd matrix work. It runs in the backward pass only (training), never in
evaluation or prefill. ``reference.causal_lse_reference`` is its PyTorch reference.

Output: ``lsec2 [B, Hq, N]`` fp32, base 2, of the scaled scores ``sm_scale * log2(e) * q.k`` (the units of
the forward's ``lse``).
"""

import torch

from . import _env
from ._env import dot_precision, tl, triton
from .forward import check_head_dim, load_rows, query_program


def _lse_configs():
    return _env.configs(
        [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [
                (128, 64, 4, 3),
                (128, 64, 8, 3),
                (128, 128, 8, 3),
                (64, 64, 4, 3),
                (128, 32, 4, 3),
                (64, 128, 4, 3),
            ]
        ],
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    )


@triton.jit
def _lse_step(m_i, l_i, s):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), axis=1)
    return m_new, l_i


@_env.autotune(configs=_lse_configs(), key=["HEAD_DIM", "GROUP", "BLOCKS_FIRST"])
@triton.jit
def _causal_lse_kernel(
    Q,
    K,
    LSEC,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    N,
    qk_scale,
    H_Q,
    GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCKS_FIRST: tl.constexpr,
):
    pid_m, pid_bh, b, h, hk, head, m0, offs_m, offs_d, row_ok = query_program(
        N, H_Q, GROUP, BLOCK_M, HEAD_DIM, BLOCKS_FIRST
    )
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, row_ok)
    k_base = K + b * skb + hk * skh
    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # key blocks entirely below the block's first query: no mask (two loops, no dot under an `if`)
    n_full = (m0 // BLOCK_N) * BLOCK_N
    for n0 in range(0, n_full, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        m_i, l_i = _lse_step(m_i, l_i, s)
    for n0 in range(n_full, q_hi + 1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=(offs_n < N)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_i, l_i = _lse_step(m_i, l_i, s)
    l_safe = tl.where(row_ok, l_i, 1.0)  # every real row sees its own key: l_i >= 1 there
    tl.store(LSEC + pid_bh * N + offs_m, m_i + tl.math.log2(l_safe), mask=row_ok)


def causal_lse(q: torch.Tensor, k: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """lsec2 [B, Hq, N] fp32: base-2 log-sum-exp of ``sm_scale * log2(e) * q_i . k_j`` over j <= i (GQA: query
    head h uses KV head h // (Hq // Hkv))."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    check_head_dim(D)
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    if sm_scale is None:
        sm_scale = D**-0.5
    lsec = _env.empty((B, HQ, N), torch.float32, q.device)
    bf = _env.blocks_first(B * HQ)
    grid = lambda meta: _env.block_grid(B * HQ, N, meta["BLOCK_M"], bf)
    _causal_lse_kernel[grid](
        q,
        k,
        lsec,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        N,
        sm_scale * 1.4426950408889634,
        HQ,
        HQ // HKV,
        HEAD_DIM=D,
        DOT_PREC=dot_precision(q.dtype),
        BLOCKS_FIRST=bf,
    )
    return lsec
