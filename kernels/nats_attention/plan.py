"""The O(N) plan that the attention kernels read instead of an N x N mask: one launch per call.

At N = 1024 the attention kernels take a fraction of a millisecond, so a dozen PyTorch ops of set-up
(argmax, cumulative min/max, counting, scattering) would cost as much in launch overhead as the attention
itself. ``_plan_kernel`` (one program per batch and KV head, chunked scans with a carry) does it in one
launch; ``reference.py`` holds the PyTorch versions that the tests compare it with
(``next_global_index``, ``prev_global_index``, ``compact_order``).

Outputs per (batch, KV head): the hard types ``t`` (int8 [B, H, N]: argmax of (g, l, s), first maximum on
ties like ``torch.argmax``, or the given integer types) and the int32 ``plan`` [B, H, PLAN_ROWS, N] with rows

- ``E``: e_j, the first global after j (N-1 if none); ``P``: p_j, the last global before j (-1 if none);
- ``ORD``: the *compact order* of the keys, [globals | locals | sliding tokens], each group by position;
- ``LIM``: for each compact entry, the last query that sees it (N-1, e_j or min(j+W-1, N-1));
- ``CG``, ``CL``, ``CS``: inclusive counts of globals, locals and sliding tokens at positions <= j;
- ``ORD2``, ``LIM2``: a second compact order, [globals | all other tokens], each group by position, and its
  limits.

Key j is visible to query i iff j <= i <= LIM, and the keys a query block [m0, m1] can see lie in three
contiguous ranges of ORD (``forward.compact_ranges``): the globals at positions <= m1, the locals after the
last global before m0, the sliding tokens at positions >= m0 - W + 1. When that last global lies in the band
[m0 - W, m1], the last two ranges are one range of ORD2 instead: the non-globals at positions >= m0 - W + 1.
"""

import torch

from ._env import INTERPRET, clamp_window, tl, triton

PLAN_ROWS = 9
E_ROW, P_ROW, ORD_ROW, LIM_ROW, CG_ROW, CL_ROW, CS_ROW, ORD2_ROW, LIM2_ROW = range(PLAN_ROWS)


# the same rows as compile-time constants, for the kernels
R_ROWS, R_E, R_P, R_ORD, R_LIM = (tl.constexpr(x) for x in (PLAN_ROWS, E_ROW, P_ROW, ORD_ROW, LIM_ROW))
R_CG, R_CL, R_CS, R_ORD2, R_LIM2 = (tl.constexpr(x) for x in (CG_ROW, CL_ROW, CS_ROW, ORD2_ROW, LIM2_ROW))


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit
def first_max(a, b, c):
    """0, 1 or 2: the first maximum of (a, b, c), as ``torch.argmax`` breaks ties: the hard type of a token's
    (global, local, sliding) weights or logits, for the plan here and NAtS' decode step (``nats_step.py``)."""
    return tl.where((a >= b) & (a >= c), 0, tl.where(b >= c, 1, 2))


@triton.jit
def _load_type(TW, BIAS, stw_n, stw_c, offs, ok, FROM_WEIGHTS: tl.constexpr, SCORED: tl.constexpr):
    """Hard type at positions ``offs`` (3 where not ``ok``): argmax (first maximum) of (g, l, s); from a scorer's
    logits (``SCORED``): of the logits in float32 plus the offsets ``BIAS`` [3], token 0 global."""
    if FROM_WEIGHTS:
        g = tl.load(TW + offs * stw_n, mask=ok, other=0.0)
        lo = tl.load(TW + offs * stw_n + stw_c, mask=ok, other=0.0)
        s = tl.load(TW + offs * stw_n + 2 * stw_c, mask=ok, other=0.0)
        if SCORED:  # as NAtSAttention.type_logits in eval: the Linear's output in float32, plus the offsets
            g = g.to(tl.float32) + tl.load(BIAS).to(tl.float32)
            lo = lo.to(tl.float32) + tl.load(BIAS + 1).to(tl.float32)
            s = s.to(tl.float32) + tl.load(BIAS + 2).to(tl.float32)
        t = first_max(g, lo, s)
        if SCORED:
            t = tl.where(offs == 0, 0, t)
    else:
        t = tl.load(TW + offs * stw_n, mask=ok, other=0).to(tl.int32)
    return tl.where(ok, t, 3)


@triton.jit
def _plan_kernel(
    TW,
    BIAS,
    T,
    PLAN,
    stw_b,
    stw_h,
    stw_n,
    stw_c,
    N,
    H,
    W,
    CH: tl.constexpr,
    FROM_WEIGHTS: tl.constexpr,
    SCORED: tl.constexpr,
    COMPACT: tl.constexpr,
):
    head = tl.program_id(0)
    b = (head // H).to(tl.int64)
    h = head % H
    tw = TW + b * stw_b + h * stw_h
    t_out = T + head.to(tl.int64) * N
    plan = PLAN + head.to(tl.int64) * (R_ROWS * N)
    E = plan + R_E * N
    P = plan + R_P * N
    ORD = plan + R_ORD * N
    LIM = plan + R_LIM * N
    ORD2 = plan + R_ORD2 * N
    LIM2 = plan + R_LIM2 * N
    # forward sweep: types, p_j = max{k < j : t_k global}, the counts, and the globals' compact entries
    run = -1
    n_g = 0
    n_l = 0
    n_s = 0
    for c0 in range(0, N, CH):
        offs = c0 + tl.arange(0, CH)
        ok = offs < N
        t = _load_type(tw, BIAS, stw_n, stw_c, offs, ok, FROM_WEIGHTS, SCORED)
        tl.store(t_out + offs, t.to(tl.int8), mask=ok)
        t_prev = _load_type(tw, BIAS, stw_n, stw_c, offs - 1, ok & (offs >= 1), FROM_WEIGHTS, SCORED)
        cand = tl.where(t_prev == 0, offs - 1, -1)
        pv = tl.maximum(tl.associative_scan(cand, 0, _max_fn), run)
        tl.store(P + offs, pv, mask=ok)
        run = tl.maximum(run, tl.max(cand, axis=0))
        if COMPACT:
            is_g = (t == 0).to(tl.int32)
            is_l = (t == 1).to(tl.int32)
            is_s = (t == 2).to(tl.int32)
            cg = n_g + tl.cumsum(is_g, 0)
            tl.store(plan + R_CG * N + offs, cg, mask=ok)
            tl.store(plan + R_CL * N + offs, n_l + tl.cumsum(is_l, 0), mask=ok)
            tl.store(plan + R_CS * N + offs, n_s + tl.cumsum(is_s, 0), mask=ok)
            tl.store(ORD + cg - 1, offs, mask=ok & (t == 0))
            tl.store(ORD2 + cg - 1, offs, mask=ok & (t == 0))
            tl.store(LIM2 + cg - 1, tl.zeros_like(offs) + (N - 1), mask=ok & (t == 0))
            tl.store(LIM + cg - 1, tl.zeros_like(offs) + (N - 1), mask=ok & (t == 0))
            n_g += tl.sum(is_g, axis=0)
            n_l += tl.sum(is_l, axis=0)
            n_s += tl.sum(is_s, axis=0)
    # backward sweep: e_j = min{k > j : t_k global} (N-1 if none), and the compact entries of the locals and
    # sliding tokens (their places count from the end of their group: the sweep runs down the positions)
    run = N - 1
    r_l = 0
    r_s = 0
    r_o = 0
    for c0 in range(0, N, CH):
        offs = N - 1 - (c0 + tl.arange(0, CH))  # descending positions
        ok = offs >= 0
        t_next = _load_type(tw, BIAS, stw_n, stw_c, offs + 1, ok & (offs + 1 < N), FROM_WEIGHTS, SCORED)
        cand = tl.where(t_next == 0, offs + 1, N - 1)
        ev = tl.minimum(tl.associative_scan(cand, 0, _min_fn), run)
        tl.store(E + offs, ev, mask=ok)
        run = tl.minimum(run, tl.min(cand, axis=0))
        if COMPACT:
            t = _load_type(tw, BIAS, stw_n, stw_c, offs, ok, FROM_WEIGHTS, SCORED)
            is_l = (t == 1).to(tl.int32)
            is_s = (t == 2).to(tl.int32)
            dest_l = n_g + n_l - (r_l + tl.cumsum(is_l, 0))
            dest_s = n_g + n_l + n_s - (r_s + tl.cumsum(is_s, 0))
            tl.store(ORD + dest_l, offs, mask=ok & (t == 1))
            tl.store(LIM + dest_l, ev, mask=ok & (t == 1))
            tl.store(ORD + dest_s, offs, mask=ok & (t == 2))
            lim_s = tl.minimum(offs + W - 1, N - 1)
            tl.store(LIM + dest_s, lim_s, mask=ok & (t == 2))
            is_o = ((t == 1) | (t == 2)).to(tl.int32)
            dest_o = N - (r_o + tl.cumsum(is_o, 0))
            tl.store(ORD2 + dest_o, offs, mask=ok & (is_o != 0))
            tl.store(LIM2 + dest_o, tl.where(t == 1, ev, lim_s), mask=ok & (is_o != 0))
            r_l += tl.sum(is_l, axis=0)
            r_s += tl.sum(is_s, axis=0)
            r_o += tl.sum(is_o, axis=0)


def chunk(n: int) -> int:
    """The plan kernel's chunk CH for a sequence of n (64 in the interpreter)."""
    return 64 if INTERPRET else min(2048, max(128, triton.next_power_of_2(n)))


def _launch(type_info: torch.Tensor, window: int, compact: bool, bias: torch.Tensor | None = None):
    from_weights = type_info.is_floating_point()
    if from_weights:
        B, H, N, _ = type_info.shape
        strides = type_info.stride()
    else:
        B, H, N = type_info.shape
        strides = (*type_info.stride(), 0)
    dev = type_info.device
    window = clamp_window(window, N)
    types = torch.empty((B, H, N), dtype=torch.int8, device=dev)
    plan = torch.empty((B, H, PLAN_ROWS, N), dtype=torch.int32, device=dev)
    _plan_kernel[(B * H,)](
        type_info.detach(),
        types if bias is None else bias.contiguous(),
        types,
        plan,
        *strides,
        N,
        H,
        window,
        CH=chunk(N),
        FROM_WEIGHTS=from_weights,
        SCORED=bias is not None,
        COMPACT=compact,
        num_warps=4,
    )
    return types, plan


def type_indices(type_info: torch.Tensor):
    """(types int8, e int32, p int32), each [B, H, N], from type weights [B, H, N, 3] or int types [B, H, N]."""
    types, plan = _launch(type_info, 1, compact=False)
    return types, plan[:, :, E_ROW].contiguous(), plan[:, :, P_ROW].contiguous()


def compact_plan(type_info: torch.Tensor, window: int, bias: torch.Tensor | None = None):
    """(types int8 [B, H, N], plan int32 [B, H, PLAN_ROWS, N]) for the attention kernels (module doc).

    ``window`` is the sliding window W >= 1 (it sets the LIM of the sliding tokens). With ``bias`` (float [3]: a
    model's ``type_bias`` buffer, in the model's dtype),
    ``type_info`` [B, H, N, 3] holds a NAtS scorer's logits (any float dtype and strides, e.g. a view of the
    Linear's output [B, N, H * 3]) and the types are those of ``NAtSAttention.hard_types``: the argmax of the
    logits in float32 plus ``bias``, token 0 global."""
    if bias is not None and (not type_info.is_floating_point() or not bias.is_floating_point() or bias.numel() != 3):
        raise ValueError("compact_plan: bias= takes float [3] offsets (added in float32) for float logits [B, H, N, 3]")
    return _launch(type_info, window, compact=True, bias=bias)
