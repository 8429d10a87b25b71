"""The decode-step operations of the fixed-capacity caches as ``torch.library`` custom ops, so that a decode step
that calls them compiles with ``torch.compile`` (fullgraph) and replays as a CUDA graph.

* ``nats::pool_attention``: `nats.cache.attention.pool_attention` (attention of one query token per KV row over the
  row's pool segment and ring): the Triton split-K kernel on CUDA (each KV head read once for its GQA group), the
  PyTorch reference elsewhere.
* ``nats::nats_step``: NAtS' per-step bookkeeping before the attention (the previous token's eviction, the new
  token's type from the scorer, ring write, segment append), the fused Triton kernel of
  ``nats_kernels.nats_attention.decode`` on CUDA and, elsewhere, the PyTorch form of the NAtS cache's own step
  (`nats.cache.policies.nats.drop_locals` / `append_token`). It mutates the cache's buffers in place (declared in
  ``mutates_args``), so the buffers keep their addresses across replays.

The PyTorch forms are the references the kernels are tested against (tests/test_cache.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nats.cache import attention
from nats.cache.policies.nats import GLOBAL, SLIDING, append_token, drop_locals


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
    backend = attention.resolve_backend("auto", q.device)
    max_len = 0 if backend == "triton" else max(int(length.max()), 1)  # Triton reads the lengths on the device
    return attention.pool_attention(q, k_pool, v_pool, start, length, max_len, ring_k=ring_k, ring_v=ring_v,
                                    ring_valid=ring_valid, backend=backend, splits=splits)  # fmt: skip


@pool_attention.register_fake
def _(q, k_pool, v_pool, start, length, ring_k, ring_v, ring_valid, splits):
    return torch.empty_like(q)


@torch.library.custom_op("nats::nats_step", mutates_args=("rows", "ring_kv", "ring_valid", "kv_pool"))
def nats_step(
    x: Tensor,
    w_s: Tensor,
    bias: Tensor,
    pos: Tensor,
    rows: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    ring_kv: Tensor,
    ring_valid: Tensor,
    kv_pool: Tensor,
) -> None:
    """One step's bookkeeping before the attention: first the eviction the previous token asked for (the pending
    type ``t`` on entry; -1: none), then this token's type from the scorer (``x [B, C] . w_s[3 Hkv, C]``, rounded to
    x's dtype as the Linear's output, ``+ bias``; argmax), ring write and append. Its expired ring slot (``pos -
    W``'s) is the new token's, so the eviction needs no ring work. The Triton kernel on CUDA.

    The buffers come packed, as the cache holds them: ``rows`` ``[6, R]`` (segment start, length, capacity, global
    count, pending type, -), ``ring_kv`` ``[2, R, W, D]``, ``kv_pool`` ``[2, P, D]`` (keys, values). Each is one
    mutated argument: an op that mutated several views of one tensor would break the functionalization of a
    compiled step (inductor copies each mutated argument back, and the copies of aliasing views overwrite each
    other's writes)."""
    start, length, cap, n_global, t = rows[0], rows[1], rows[2], rows[3], rows[4]
    ring_k, ring_v, k_pool, v_pool = ring_kv[0], ring_kv[1], kv_pool[0], kv_pool[1]
    if attention.resolve_backend("auto", k_new.device) == "triton":
        from nats_kernels.nats_attention.decode import nats_step as kernel  # noqa: PLC0415

        kernel(x, w_s, bias, pos, t, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length,
               n_global, cap)  # fmt: skip
        return
    scratch = torch.full_like(start, k_pool.shape[0] - 1)  # the pool's last slot takes the skipped writes
    drop_locals(t == GLOBAL, k_pool, v_pool, start, length, n_global, scratch)
    z = (x @ w_s.t()).to(x.dtype).float().reshape(-1, 3) + bias  # [B, Hkv * 3] -> [R, 3]: row r = b * Hkv + h
    new = z.argmax(-1)
    new = torch.where(pos == 0, torch.full_like(new, GLOBAL), new)
    new = torch.where((new != SLIDING) & (length >= cap), torch.full_like(new, SLIDING), new)  # a full segment
    t.copy_(new)
    append_token(new, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, scratch)


@nats_step.register_fake
def _(x, w_s, bias, pos, rows, k_new, v_new, ring_kv, ring_valid, kv_pool):
    return None
