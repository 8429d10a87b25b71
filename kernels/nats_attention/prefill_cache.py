"""The NAtS prefill's writes into a fixed-capacity cache (`nats.hf.StaticPolicyCache`), fused: from a layer's integer
types, what each row (sequence x KV head) keeps of the prompt (the globals, and the locals after the row's last
global), the rows' segments of one pool, the ring of the last W - 1 positions and the pool writes, in two launches
per layer instead of some thirty small PyTorch operations (the batch-1 prefill is bound by its launches).

* ``prefill_rows`` (grid ``(R,)``): per row, the last global and the counts (two passes over the types), the row's
  bookkeeping ``[6, R]`` (length, capacity = kept + ``max_new``, global count, -1, 0; the start is written by the
  second kernel), the ring (slot = position mod W, valid where sliding) and the sum of the capacities (one atomic
  add: the pool's size, which the host reads asynchronously before it allocates the pool).
* ``prefill_pool`` (grid ``(R,)``): per row, its start (the capacities of the rows before it) and the kept
  positions' keys and values written in order from it (a running rank: ``tl.cumsum`` per block).

The PyTorch reference is ``nats.hf.static_cache._nats_rows`` / ``_pool_fill`` (tests/test_hf_static_cache.py
compares them, also through ``generate``). Rows r = b * Hkv + h; types ``[B, Hkv, N]`` with -1 on left padding.
"""

from __future__ import annotations

import torch

from nats_kernels.nats_attention._env import tl, triton

BLOCK_N = 128


@triton.jit
def _rows_kernel(T, K, V, ROWS, END, LAST_G, RING, RING_VALID, R, N, HKV, skb, skh, skn, MAX_NEW, W, D,
                 BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b, h = r // HKV, r % HKV
    offs = tl.arange(0, BLOCK_N)
    last_g = tl.full((), -1, tl.int64)
    n_g = tl.zeros((), tl.int64)
    for n0 in range(0, N, BLOCK_N):
        pos = n0 + offs
        t = tl.load(T + r * N + pos, mask=pos < N, other=-1)
        isg = t == 0
        last_g = tl.maximum(last_g, tl.max(tl.where(isg, pos, -1), axis=0).to(tl.int64))
        n_g += tl.sum(isg.to(tl.int64), axis=0)
    n_keep = tl.zeros((), tl.int64)
    for n0 in range(0, N, BLOCK_N):
        pos = n0 + offs
        t = tl.load(T + r * N + pos, mask=pos < N, other=-1)
        keep = (t == 0) | ((t == 1) & (pos > last_g))  # the globals, and the locals after the last global
        n_keep += tl.sum(keep.to(tl.int64), axis=0)
    cap = n_keep + MAX_NEW
    tl.store(ROWS + 1 * R + r, n_keep)
    tl.store(ROWS + 2 * R + r, cap)
    tl.store(ROWS + 3 * R + r, n_g)
    tl.store(ROWS + 4 * R + r, tl.full((), -1, tl.int64))
    tl.store(ROWS + 5 * R + r, tl.zeros((), tl.int64))
    tl.store(LAST_G + r, last_g)
    tl.atomic_add(END, cap)
    # the ring: slot s holds the position p in [N - W + 1, N) with p mod W = s, if any (one slot, or more for a
    # prompt shorter than W - 1, holds none: zeros, not valid)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kv = K + b * skb + h * skh
    vv = V + b * skb + h * skh
    for w0 in range(0, W, BLOCK_W):
        s = w0 + tl.arange(0, BLOCK_W)
        smask = s < W
        p = (N - 1) - ((N - 1 - s) % W)
        has = smask & (p >= N - W + 1) & (p >= 0) & (p < N)  # (% keeps the sign: s > N - 1 gives p >= N)
        t = tl.load(T + r * N + p, mask=has, other=-1)
        m2 = has[:, None] & dmask[None, :]
        kk = tl.load(kv + p[:, None] * skn + offs_d[None, :], mask=m2, other=0.0)
        vk = tl.load(vv + p[:, None] * skn + offs_d[None, :], mask=m2, other=0.0)
        st = smask[:, None] & dmask[None, :]
        tl.store(RING + (r * W + s[:, None]) * D + offs_d[None, :], kk, mask=st)
        tl.store(RING + ((R + r) * W + s[:, None]) * D + offs_d[None, :], vk, mask=st)
        tl.store(RING_VALID + r * W + s, (t == 2).to(tl.int8), mask=smask)


@triton.jit
def _pool_kernel(T, K, V, ROWS, LAST_G, POOL, R, N, HKV, skb, skh, skn, P, D,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b, h = r // HKV, r % HKV
    start = tl.zeros((), tl.int64)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        start += tl.sum(tl.load(ROWS + 2 * R + rr, mask=rr < r, other=0), axis=0)
    tl.store(ROWS + r, start)
    last_g = tl.load(LAST_G + r)
    offs = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kv = K + b * skb + h * skh
    vv = V + b * skb + h * skh
    done = tl.zeros((), tl.int64)  # kept positions written so far
    for n0 in range(0, N, BLOCK_N):
        pos = n0 + offs
        t = tl.load(T + r * N + pos, mask=pos < N, other=-1)
        keep = (t == 0) | ((t == 1) & (pos > last_g))
        dest = start + done + tl.cumsum(keep.to(tl.int64), 0) - 1
        m2 = keep[:, None] & dmask[None, :]
        kk = tl.load(kv + pos[:, None] * skn + offs_d[None, :], mask=m2, other=0.0)
        vk = tl.load(vv + pos[:, None] * skn + offs_d[None, :], mask=m2, other=0.0)
        tl.store(POOL + dest[:, None] * D + offs_d[None, :], kk, mask=m2)
        tl.store(POOL + (P + dest[:, None]) * D + offs_d[None, :], vk, mask=m2)
        done += tl.sum(keep.to(tl.int64), axis=0)


def _checked(types: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    B, H, N, D = k.shape
    if tuple(types.shape) != (B, H, N) or v.shape != k.shape or k.stride() != v.stride():
        raise ValueError(f"expected types [B, Hkv, N], k / v [B, Hkv, N, D] alike; got {tuple(types.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    return types.reshape(B * H, N).contiguous(), k, v


def prefill_rows(types: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, max_new: int):
    """(rows ``[6, R]`` int64 without the starts, end ``[1]`` (the capacities' sum), ring ``[2, R, W, D]``,
    ring validity ``[R, W]`` bool, last global ``[R]``) of a layer's prompt: types ``[B, Hkv, N]`` (-1: padding),
    k, v ``[B, Hkv, N, D]``. The starts are written by `prefill_pool`."""
    t, k, v = _checked(types, k, v)
    R, N = t.shape
    D, W, dev = k.shape[-1], int(window), k.device
    rows = torch.empty(6, R, dtype=torch.long, device=dev)
    end = torch.zeros(1, dtype=torch.long, device=dev)
    last_g = torch.empty(R, dtype=torch.long, device=dev)
    ring = torch.empty(2, R, W, D, dtype=k.dtype, device=dev)
    ring_valid = torch.empty(R, W, dtype=torch.bool, device=dev)
    _rows_kernel[(R,)](t, k, v, rows, end, last_g, ring, ring_valid.view(torch.int8), R, N, types.shape[1],
                       k.stride(0), k.stride(1), k.stride(2), int(max_new), W, D, BLOCK_N=BLOCK_N,
                       BLOCK_W=min(32, triton.next_power_of_2(W)), BLOCK_D=triton.next_power_of_2(D))  # fmt: skip
    return rows, end, ring, ring_valid, last_g


def prefill_pool(types: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, last_g: torch.Tensor,
                 size: int) -> torch.Tensor:  # fmt: skip
    """The pool ``[2, size, D]`` (keys, values; zeros where nothing is kept) of the rows planned by `prefill_rows`,
    whose starts it writes into ``rows[0]``."""
    t, k, v = _checked(types, k, v)
    R, N = t.shape
    D = k.shape[-1]
    pool = torch.zeros(2, size, D, dtype=k.dtype, device=k.device)
    _pool_kernel[(R,)](t, k, v, rows, last_g, pool, R, N, types.shape[1], k.stride(0), k.stride(1), k.stride(2),
                       size, D, BLOCK_N=BLOCK_N, BLOCK_R=min(1024, triton.next_power_of_2(R)),
                       BLOCK_D=triton.next_power_of_2(D))  # fmt: skip
    return pool
