"""The decode-step operations of the fixed-capacity caches as ``torch.library`` custom ops, so that a decode step
that calls them compiles with ``torch.compile`` (fullgraph) and replays as a CUDA graph.

* ``nats::pool_attention``: attention of one query token per KV row over the row's pool segment and ring
  (`nats.cache.attention.pool_attention`); the Triton split-K kernel on CUDA (each KV head read once for its GQA
  group), the PyTorch reference elsewhere.
* ``nats::nats_append`` / ``nats::nats_evict``: NAtS' per-step bookkeeping (type, ring write, segment append;
  dropping the locals of rows whose token was global), the fused Triton kernels of
  ``nats_kernels.nats_attention.decode`` on CUDA and their PyTorch form here elsewhere. Both mutate the cache's
  buffers in place (declared in ``mutates_args``), so the buffers keep their addresses across replays.

The PyTorch forms are the references the kernels are tested against (tests/test_hf_static_cache.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nats.cache.attention import torch_pool_attention

GLOBAL, LOCAL, SLIDING = 0, 1, 2


def _triton_ok(t: Tensor) -> bool:
    return t.is_cuda


@torch.library.custom_op("nats::pool_attention", mutates_args=())
def pool_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    ring_k: Tensor | None,
    ring_v: Tensor | None,
    ring_valid: Tensor | None,
    splits: int,
) -> Tensor:
    """q ``[R, G, D]`` over segment ``[start[r], start[r] + length[r])`` of ``k_pool``/``v_pool`` ``[P, D]`` and the
    valid ring slots (``ring_k``/``ring_v`` ``[R, W, D]``, ``ring_valid`` ``[R, W]``) -> ``[R, G, D]``."""
    if _triton_ok(q):
        from nats_kernels.nats_attention.decode import triton_pool_attention  # noqa: PLC0415

        return triton_pool_attention(
            q, k_pool, v_pool, start, length, 0, ring_k=ring_k, ring_v=ring_v, ring_valid=ring_valid, splits=splits
        )
    max_len = max(int(length.max()), 1)
    return torch_pool_attention(q, k_pool, v_pool, start, length, max_len, ring_k, ring_v, ring_valid)


@pool_attention.register_fake
def _(q, k_pool, v_pool, start, length, ring_k, ring_v, ring_valid, splits):
    return torch.empty_like(q)


@torch.library.custom_op(
    "nats::nats_append", mutates_args=("t_out", "ring_k", "ring_v", "ring_valid", "k_pool", "v_pool", "length")
)
def nats_append(
    z: Tensor,
    pos: Tensor,
    t_out: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    ring_k: Tensor,
    ring_v: Tensor,
    ring_valid: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    cap: Tensor,
) -> None:
    """One token per row r: type ``t = argmax z[r]`` (``[R, 3]``; global at position 0) written to ``t_out``; its
    key/value to ring slot ``pos % W`` (valid where sliding); global and local tokens appended to the row's
    segment. A row whose segment is full (``length == cap``) keeps the token as a sliding one instead."""
    if _triton_ok(k_new):
        from nats_kernels.nats_attention.decode import nats_append as kernel  # noqa: PLC0415

        kernel(z, None, pos, t_out, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, cap=cap)
        return
    t = z.argmax(-1)
    t = torch.where(pos == 0, torch.zeros_like(t), t)
    t = torch.where((t != SLIDING) & (length >= cap), torch.full_like(t, SLIDING), t)
    t_out.copy_(t)
    W = ring_k.shape[1]
    slot = pos % W
    ring_k.index_copy_(1, slot, k_new[:, None])
    ring_v.index_copy_(1, slot, v_new[:, None])
    ring_valid.index_copy_(1, slot, (t == SLIDING)[:, None])
    keep = t != SLIDING
    dest = torch.where(keep, start + length, torch.full_like(start, k_pool.shape[0] - 1))
    k_pool.index_copy_(0, dest, k_new)
    v_pool.index_copy_(0, dest, v_new)
    length.add_(keep.to(length.dtype))


@nats_append.register_fake
def _(z, pos, t_out, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, cap):
    return None


@torch.library.custom_op("nats::nats_evict", mutates_args=("k_pool", "v_pool", "length", "n_global", "ring_valid"))
def nats_evict(
    t: Tensor,
    pos: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    n_global: Tensor,
    ring_valid: Tensor,
) -> None:
    """After the query: in rows whose token was global its locals go (the token moves down over them); the ring
    slot of token ``pos - W + 1`` is cleared (its window ends)."""
    if _triton_ok(k_pool):
        from nats_kernels.nats_attention.decode import nats_evict as kernel  # noqa: PLC0415

        kernel(t, pos, k_pool, v_pool, start, length, n_global, ring_valid)
        return
    isg = t == GLOBAL
    scratch = torch.full_like(start, k_pool.shape[0] - 1)
    src = torch.where(isg, start + length - 1, scratch)
    dst = torch.where(isg, start + n_global, scratch)
    k_pool.index_copy_(0, dst, k_pool.index_select(0, src))
    v_pool.index_copy_(0, dst, v_pool.index_select(0, src))
    n_global.add_(isg.to(n_global.dtype))
    length.copy_(torch.where(isg, n_global, length))
    W = ring_valid.shape[1]
    ring_valid.index_fill_(1, (pos + 1) % W, False)


@nats_evict.register_fake
def _(t, pos, k_pool, v_pool, start, length, n_global, ring_valid):
    return None


@torch.library.custom_op(
    "nats::nats_step",
    mutates_args=("t", "ring_k", "ring_v", "ring_valid", "k_pool", "v_pool", "length", "n_global"),
)
def nats_step(
    x: Tensor,
    w_s: Tensor,
    bias: Tensor,
    pos: Tensor,
    t: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    ring_k: Tensor,
    ring_v: Tensor,
    ring_valid: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    n_global: Tensor,
    cap: Tensor,
) -> None:
    """`nats_append` and the previous step's `nats_evict` in one: first the eviction the previous token asked for
    (``t`` holds its type on entry; -1: none), then this token's type from the scorer (``x [B, C] . w_s[3 Hkv,
    C]``, rounded to x's dtype as the Linear's output, ``+ bias``; argmax), ring write and append. Its expired ring
    slot (``pos - W``'s) is the new token's, so the eviction needs no ring work. The Triton kernel on CUDA."""
    if _triton_ok(k_new):
        from nats_kernels.nats_attention.decode import nats_step as kernel  # noqa: PLC0415

        kernel(x, w_s, bias, pos, t, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length,
               n_global, cap)  # fmt: skip
        return
    isg = t == GLOBAL
    scratch = torch.full_like(start, k_pool.shape[0] - 1)
    src = torch.where(isg, start + length - 1, scratch)
    dst = torch.where(isg, start + n_global, scratch)
    k_pool.index_copy_(0, dst, k_pool.index_select(0, src))
    v_pool.index_copy_(0, dst, v_pool.index_select(0, src))
    n_global.add_(isg.to(n_global.dtype))
    length.copy_(torch.where(isg, n_global, length))
    B = x.shape[0]
    R = t.shape[0]
    z = (x @ w_s.t()).to(x.dtype).float().reshape(B, R // B, 3).reshape(R, 3) + bias
    nats_append(z, pos, t, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, cap)


@nats_step.register_fake
def _(x, w_s, bias, pos, t, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, n_global, cap):
    return None
