"""Triton decode attention over a KV pool with per-row segments and an optional ring (flash-decoding).

Grid ``(R * G, SPLITS)``: program (r*G + g, s) takes query head g of KV row r and the s-th of SPLITS equal
chunks of the row's segment ``[start[r], start[r] + length[r])`` (chunk = ceil(length / SPLITS) rounded up to
BLOCK_N; ``start``/``length`` are read on the device, so launches need no host synchronisation and can be
captured in CUDA graphs). Split 0 also takes the ring slots (NAtS' sliding tokens) whose valid flag is set.
Each program keeps an online softmax (max, sum, weighted V) in float32 and writes it to a partial buffer; a
second kernel combines the SPLITS partials of every (r, g). Scores use elementwise products and row sums
(no tensor cores: one query row per program), which is memory-bound like decoding itself.

Without a CUDA GPU the kernels run in Triton's CPU interpreter (set before triton is imported, as in
``nats_kernels.nats_attention._env``): slow, for tests only.
"""
from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_N = 64


@triton.jit
def _pool_decode_kernel(Q, KP, VP, START, LEN, RK, RV, RVALID, M_OUT, L_OUT, ACC_OUT, qk_scale,
                        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_RING: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    r = pid // G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + pid * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    start = tl.load(START + r).to(tl.int64)
    length = tl.load(LEN + r).to(tl.int64)
    per = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, length)

    m_i = tl.zeros([1], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        rows = start + offs_n
        kv_mask = ok[:, None] & dmask[None, :]
        k = tl.load(KP + rows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        v = tl.load(VP + rows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    if HAS_RING:
        if split == 0:
            offs_w = tl.arange(0, BLOCK_W)
            okw = offs_w < W
            valid = tl.load(RVALID + r * W + offs_w, mask=okw, other=0) != 0
            rrows = r * W + offs_w
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(RK + rrows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * qk_scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe)
            v = tl.load(RV + rrows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
    out = pid * SPLITS + split
    one = tl.arange(0, 1)
    tl.store(M_OUT + out + one, m_i)
    tl.store(L_OUT + out + one, l_i)
    tl.store(ACC_OUT + out * D + offs_d, acc, mask=dmask)


@triton.jit
def _combine_kernel(M, L, ACC, OUT, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    ok = offs_s < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    m = tl.load(M + pid * SPLITS + offs_s, mask=ok, other=float("-inf"))
    l = tl.load(L + pid * SPLITS + offs_s, mask=ok, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
    acc = tl.load(ACC + (pid * SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=ok[:, None] & dmask[None, :],
                  other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    tl.store(OUT + pid * D + offs_d, (num / den).to(OUT.dtype.element_ty), mask=dmask)


def default_splits(max_len: int, rows: int) -> int:
    """Split-K count: chunks of about 256 keys, at most 64 splits (rows x splits programs in all)."""
    return int(min(64, max(1, math.ceil(max(int(max_len), 1) / 256))))


def triton_pool_attention(q, k_pool, v_pool, start, length, max_len, ring_k=None, ring_v=None, ring_valid=None,
                          splits=None):
    """Triton backend of :func:`nats.cache.attention.pool_attention` (same arguments, no host sync)."""
    R, G, D = q.shape
    q = q.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or k_pool.stride(0) != D or v_pool.stride(0) != D:
        raise ValueError("k_pool and v_pool must be contiguous [P, D]")
    splits = int(splits or default_splits(max_len, R * G))
    dev = q.device
    m = torch.empty(R * G * splits, device=dev, dtype=torch.float32)
    l = torch.empty(R * G * splits, device=dev, dtype=torch.float32)
    acc = torch.empty(R * G * splits, D, device=dev, dtype=torch.float32)
    out = torch.empty(R, G, D, device=dev, dtype=q.dtype)
    has_ring = ring_k is not None
    if has_ring:
        W = ring_k.shape[1]
        rk, rv = ring_k.contiguous(), ring_v.contiguous()
        rvalid = ring_valid.contiguous().to(torch.int8) if ring_valid.dtype == torch.bool else ring_valid
    else:
        W, rk, rv, rvalid = 1, k_pool, v_pool, start  # unused placeholders
    block_d = triton.next_power_of_2(D)
    _pool_decode_kernel[(R * G, splits)](
        q, k_pool, v_pool, start, length, rk, rv, rvalid, m, l, acc, 1.0 / math.sqrt(D),
        G=G, D=D, BLOCK_D=block_d, SPLITS=splits, BLOCK_N=BLOCK_N, HAS_RING=has_ring, W=W,
        BLOCK_W=triton.next_power_of_2(W),
    )
    _combine_kernel[(R * G,)](m, l, acc, out, D=D, BLOCK_D=block_d, SPLITS=splits,
                              BLOCK_S=triton.next_power_of_2(splits))
    return out
