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

The PyTorch reference is ``nats.cache.policies.nats.nats_rows`` / ``nats.cache.engine.pool_fill``
(tests/test_hf_static_cache.py compares them, also through ``generate``). Rows r = b * Hkv + h; types
``[B, Hkv, N]`` with -1 on left padding.

`prefill_kernels` gives the whole NAtS layer of a prefill from a scorer's logits (plan, attention, rows and ring,
then the pool) as `PrefillKernels`, whose kernels are launched directly (`_launch.Bound`) once the first layer has
gone through Triton's launcher: the layers of a prefill share every shape, and at batch 1 the prefill waits for the
host's Python per layer, not for the GPU.
"""

from __future__ import annotations

import torch

from nats_kernels.nats_attention import _env
from nats_kernels.nats_attention._env import tl, triton
from nats_kernels.nats_attention._launch import Bound

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


@triton.jit(do_not_specialize=["P"])  # the pool's size differs per layer: one compiled kernel for all
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


def _rows_meta(window: int, D: int) -> dict:
    """The rows kernel's block sizes for a ring of ``window`` slots and head dim D."""
    return dict(BLOCK_N=BLOCK_N, BLOCK_W=min(32, triton.next_power_of_2(window)), BLOCK_D=triton.next_power_of_2(D))


def _pool_meta(R: int, D: int) -> dict:
    """The pool kernel's block sizes for R rows and head dim D."""
    return dict(BLOCK_N=BLOCK_N, BLOCK_R=min(1024, triton.next_power_of_2(R)), BLOCK_D=triton.next_power_of_2(D))


def _checked(types: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    B, H, N, D = k.shape
    if tuple(types.shape) != (B, H, N) or v.shape != k.shape:
        raise ValueError(f"expected types [B, Hkv, N], k / v [B, Hkv, N, D] alike; got {tuple(types.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if k.stride(-1) != 1 or k.stride() != v.stride():  # the kernels take one set of strides for both
        k, v = k.contiguous(), v.contiguous()  # (fused q/k/v projections: rotary makes k contiguous, v a view)
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
                       k.stride(0), k.stride(1), k.stride(2), int(max_new), W, D, **_rows_meta(W, D))  # fmt: skip
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
                       size, D, **_pool_meta(R, D))  # fmt: skip
    return pool


class PrefillKernels:
    """The NAtS prefill of a fixed-capacity cache for layers of one kind (`prefill_kernels`): `attend` (the plan
    from the scorer's logits, the attention, the rows and the ring: three launches) and `pool` (one), each launched
    directly after its first call (`_launch.Bound`), with the layer's shapes, strides and launch parameters worked
    out once here rather than at every layer. ``direct=False``: every launch through Triton's launcher (as with
    ``NATS_KERNELS_DIRECT_LAUNCH=0``; the benchmarks time both)."""

    def __init__(self, key: tuple, direct: bool | None = None):
        from nats_kernels.nats_attention.forward import _nats_fwd_kernel, forward_launch  # noqa: PLC0415
        from nats_kernels.nats_attention.plan import PLAN_ROWS, _plan_kernel, chunk  # noqa: PLC0415

        q_shape, q_stride, k_shape, k_stride, _, l_stride, dtype, _, _, window, max_new, device = key
        B, Hq, N, D = q_shape
        H = k_shape[1]
        R, W = B * H, _env.clamp_window(window, N)
        self.B, self.Hq, self.H, self.N, self.D, self.R = B, Hq, H, N, D, R
        self.dtype, self.device, self.ring_w, self.max_new = dtype, device, int(window), int(max_new)
        self.plan_shape = (B, H, PLAN_ROWS, N)
        # the launches' integer arguments, fixed for the kind: the plan's (logits' strides, N, Hkv, W), the
        # forward's (q, k, v, o strides, N, W, scale, Hq, group; o is stored [B, N, Hq, D]), the cache rows'
        self._plan_ints = (*l_stride, N, H, W)
        ks = k_stride[:3]
        self._fwd_ints = (*q_stride[:3], *ks, *ks, N * Hq * D, D, Hq * D, N, W, D**-0.5 * 1.4426950408889634, Hq,
                          Hq // H)  # fmt: skip
        self._rows_ints = (R, N, H, *ks, self.max_new, self.ring_w, D)
        self._pool_ints = (R, N, H, *ks)
        self._plan = Bound(_plan_kernel, (R,), direct=direct, CH=chunk(N), FROM_WEIGHTS=True, SCORED=True,
                           COMPACT=True, num_warps=4)  # fmt: skip
        grid, meta = forward_launch(B * Hq, N, D, dtype, store_lse=False)
        self._fwd = Bound(_nats_fwd_kernel, grid, direct=direct, **meta)
        self._rows = Bound(_rows_kernel, (R,), direct=direct, **_rows_meta(self.ring_w, D))
        self._pool = Bound(_pool_kernel, (R,), direct=direct, **_pool_meta(R, D))

    @property
    def launches(self) -> dict[str, str]:
        """How each kernel is launched after its first call: "direct", or "Triton's launcher" with the reason
        where a check or a direct call failed."""
        bounds = {"plan": self._plan, "attention": self._fwd, "rows": self._rows, "pool": self._pool}
        return {k: "direct" if b.direct else "Triton's launcher" + (f" ({b.reason})" if b.reason else "")
                for k, b in bounds.items()}  # fmt: skip

    @staticmethod
    def key(q, k, v, logits, bias, window: int, max_new: int) -> tuple | None:
        """What makes two layers' calls alike (shapes, strides, dtypes, window, device); None where the direct
        launches do not take the tensors as they are: a last stride other than 1, keys and values strided
        differently, or a tensor not 16-byte aligned (Triton specialises on the alignment)."""
        ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | logits.data_ptr() | bias.data_ptr()
        if ptrs % 16 or q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride() or v.shape != k.shape:
            return None
        if not bias.is_contiguous():
            return None
        return (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(logits.shape), logits.stride(), q.dtype,
                logits.dtype, bias.dtype, int(window), int(max_new), q.device)  # fmt: skip

    def attend(self, q, k, v, logits, bias):
        """(attention output ``[B, Hq, N, D]`` (stored as ``[B, N, Hq, D]``), int8 types ``[B, Hkv, N]``, rows
        ``[6, R]`` without the starts, end ``[1]``, ring ``[2, R, W, D]``, ring validity ``[R, W]``, last global
        ``[R]``): `nats_prefill_scored` and `prefill_rows` in one call."""
        B, Hq, N, D, H, R, W, dev = self.B, self.Hq, self.N, self.D, self.H, self.R, self.ring_w, self.device
        o = _env.empty((B, N, Hq, D), self.dtype, dev).transpose(1, 2)
        types = torch.empty((B, H, N), dtype=torch.int8, device=dev)
        plan = torch.empty(self.plan_shape, dtype=torch.int32, device=dev)
        self._plan(logits, bias, types, plan, *self._plan_ints)
        self._fwd(q, k, v, o, o, plan, *self._fwd_ints)
        ints = torch.zeros(7 * R + 1, dtype=torch.long, device=dev)  # rows [6, R], last global [R], end [1]
        rows, last_g, end = ints[: 6 * R].view(6, R), ints[6 * R : 7 * R], ints[7 * R :]
        ring = torch.empty(2, R, W, D, dtype=self.dtype, device=dev)
        ring_valid = torch.empty(R, W, dtype=torch.bool, device=dev)
        self._rows(types, k, v, rows, end, last_g, ring, ring_valid.view(torch.int8), *self._rows_ints)
        return o, types, rows, end, ring, ring_valid, last_g

    def pool(self, types, k, v, rows, last_g, size: int) -> torch.Tensor:
        """`prefill_pool` for the outputs of `attend`."""
        pool = torch.zeros(2, size, self.D, dtype=self.dtype, device=self.device)
        self._pool(types, k, v, rows, last_g, pool, *self._pool_ints, size, self.D)
        return pool


_KERNELS: dict[tuple, PrefillKernels] = {}


def prefill_kernels(q, k, v, logits, bias, window: int, max_new: int) -> PrefillKernels | None:
    """The `PrefillKernels` of a NAtS layer's prefill: q ``[B, Hq, N, D]``, k, v ``[B, Hkv, N, D]``, a scorer's
    logits ``[B, Hkv, N, 3]`` and offsets ``bias`` [3] (as `nats_prefill_scored`), ``window``, ``max_new`` (as
    `prefill_rows`); one per kind of layer, kept for later prefills. None where the tensors are not laid out as the
    direct launches take them (`PrefillKernels.key`): `nats_prefill_scored` and `prefill_rows` serve those."""
    key = PrefillKernels.key(q, k, v, logits, bias, window, max_new)
    if key is None:
        return None
    kernels = _KERNELS.get(key)
    if kernels is None:
        from nats_kernels.nats_attention.prefill import _check  # noqa: PLC0415

        _check(q, k, v, logits, "logits [B,Hkv,N,3]", 4)
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if len(_KERNELS) >= 64:  # prompt lengths come and go: keep the latest kinds
            _KERNELS.pop(next(iter(_KERNELS)))
        kernels = _KERNELS[key] = PrefillKernels(key)
    return kernels
