"""Small Triton kernels that prepare the attention kernels' O(N) inputs, in two launches.

At N = 1024 the attention kernels take a fraction of a millisecond, so a dozen PyTorch ops of set-up
(argmax, cumulative min/max, block summaries, sorting) would cost as much in launch overhead as the
attention itself. These kernels do the same work as the PyTorch helpers of ``indices.py`` and
``forward.live_key_blocks`` (which the tests compare them with):

- ``_types_kernel``: per (batch, KV head): hard types t_j = argmax of (g, l, s) (or given integer types),
  e_j = next global after j (N-1 if none) and p_j = previous global before j (-1 if none), by chunked
  max/min scans with a carry.
- ``_block_list_kernel``: per (batch, KV head, query block): the key blocks that hold a pair visible to
  the query block, compacted with a prefix sum.
"""

import torch

from ._env import INTERPRET, cdiv, tl, triton


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit
def _load_type(TW, stw_n, stw_c, offs, ok, FROM_WEIGHTS: tl.constexpr):
    """Hard type at positions ``offs`` (3 where not ``ok``): argmax (first maximum) of (g, l, s)."""
    if FROM_WEIGHTS:
        g = tl.load(TW + offs * stw_n, mask=ok, other=0.0)
        lo = tl.load(TW + offs * stw_n + stw_c, mask=ok, other=0.0)
        s = tl.load(TW + offs * stw_n + 2 * stw_c, mask=ok, other=0.0)
        t = tl.where((g >= lo) & (g >= s), 0, tl.where(lo >= s, 1, 2))
    else:
        t = tl.load(TW + offs * stw_n, mask=ok, other=0).to(tl.int32)
    return tl.where(ok, t, 3)


@triton.jit
def _types_kernel(TW, T, E, P, stw_b, stw_h, stw_n, stw_c, N, H, CH: tl.constexpr, FROM_WEIGHTS: tl.constexpr):
    head = tl.program_id(0)
    b = (head // H).to(tl.int64)
    h = head % H
    tw = TW + b * stw_b + h * stw_h
    out = head.to(tl.int64) * N
    # forward sweep: types and p_j = max{k < j : t_k global}
    run = -1
    for c0 in range(0, N, CH):
        offs = c0 + tl.arange(0, CH)
        ok = offs < N
        t = _load_type(tw, stw_n, stw_c, offs, ok, FROM_WEIGHTS)
        tl.store(T + out + offs, t.to(tl.int8), mask=ok)
        t_prev = _load_type(tw, stw_n, stw_c, offs - 1, ok & (offs >= 1), FROM_WEIGHTS)
        cand = tl.where(t_prev == 0, offs - 1, -1)
        pv = tl.maximum(tl.associative_scan(cand, 0, _max_fn), run)
        tl.store(P + out + offs, pv, mask=ok)
        run = tl.maximum(run, tl.max(cand, axis=0))
    # backward sweep: e_j = min{k > j : t_k global}, N-1 if none
    run = N - 1
    for c0 in range(0, N, CH):
        offs = N - 1 - (c0 + tl.arange(0, CH))  # descending positions
        ok = offs >= 0
        t_next = _load_type(tw, stw_n, stw_c, offs + 1, ok & (offs + 1 < N), FROM_WEIGHTS)
        cand = tl.where(t_next == 0, offs + 1, N - 1)
        ev = tl.minimum(tl.associative_scan(cand, 0, _min_fn), run)
        tl.store(E + out + offs, ev, mask=ok)
        run = tl.minimum(run, tl.min(cand, axis=0))


def type_indices(type_info: torch.Tensor):
    """(types int8, e int32, p int32), each [B, H, N], from type weights [B, H, N, 3] or int types [B, H, N]."""
    from_weights = type_info.is_floating_point()
    if from_weights:
        B, H, N, _ = type_info.shape
        strides = type_info.stride()
    else:
        B, H, N = type_info.shape
        strides = (*type_info.stride(), 0)
    dev = type_info.device
    types = torch.empty((B, H, N), dtype=torch.int8, device=dev)
    e = torch.empty((B, H, N), dtype=torch.int32, device=dev)
    p = torch.empty((B, H, N), dtype=torch.int32, device=dev)
    ch = 64 if INTERPRET else min(2048, max(128, triton.next_power_of_2(N)))
    src = type_info.detach()
    _types_kernel[(B * H,)](src, types, e, p, *strides, N, H, CH=ch, FROM_WEIGHTS=from_weights,
                            num_warps=4)
    return types, e, p


@triton.jit
def _block_list_kernel(T, E, IDX, CNT, N, W, NQB, NKB,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    m0 = pid_m * BLOCK_M
    q_hi = tl.minimum(m0 + BLOCK_M, N) - 1
    n_kb = q_hi // BLOCK_N + 1  # causal key blocks
    row = (head * NQB + pid_m) * NKB
    cnt = 0
    for c in range(0, n_kb, KC):
        kbs = c + tl.arange(0, KC)
        offs = kbs[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ok = (offs < N) & (kbs[:, None] < n_kb)
        ty = tl.load(T + head * N + offs, mask=ok, other=3).to(tl.int32)
        e = tl.load(E + head * N + offs, mask=ok, other=-1)
        # the last query that sees some key of the block
        lim = tl.where(ty == 0, N - 1, tl.where(ty == 1, e, tl.where(ty == 2, offs + W - 1, -1)))
        live = (tl.max(lim, axis=1) >= m0) & (kbs < n_kb)
        live_i = live.to(tl.int32)
        pos = cnt + tl.cumsum(live_i, 0) - 1
        tl.store(IDX + row + pos, kbs, mask=live)
        cnt += tl.sum(live_i, axis=0)
    tl.store(CNT + head * NQB + pid_m, cnt)


def block_lists(types, e, window: int, block_m: int, block_n: int):
    """Triton version of ``forward.live_key_blocks`` (same outputs; unlisted tail entries are undefined)."""
    B, H, N = types.shape
    nqb, nkb = cdiv(N, block_m), cdiv(N, block_n)
    dev = types.device
    idx = torch.empty((B, H, nqb, nkb), dtype=torch.int32, device=dev)
    cnt = torch.empty((B, H, nqb), dtype=torch.int32, device=dev)
    kc = 16 if INTERPRET else max(1, min(64, 4096 // block_n))
    _block_list_kernel[(nqb, B * H)](types, e, idx, cnt, N, window, nqb, nkb,
                                     BLOCK_M=block_m, BLOCK_N=block_n, KC=kc, num_warps=4)
    return idx, cnt
