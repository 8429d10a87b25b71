"""Exact PyTorch reference of the decode attention kernel (``pool_decode.py``): one query token per (KV row,
group head) over its pool segment and, optionally, the valid slots of a ring. Also the ``"torch"`` backend of
``nats.cache.attention.pool_attention`` (any device; CPU, tests).

    out[r, g] = softmax(q[r, g] . K_r / sqrt(D)) V_r    over the segment of r and its valid ring slots

Imports no Triton.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["compute_dtype", "masked_attention", "torch_pool_attention"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, return_probs: bool = False):
    """q [R, G, D], k/v [R, L, D], valid [R, L] bool (at least one True per row) -> out [R, G, D] (q's dtype).

    With ``return_probs`` also the probabilities [R, G, L] (compute dtype; 0 at invalid slots).
    """
    cdt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("rgd,rld->rgl", q.to(cdt), k.to(cdt)) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("rgl,rld->rgd", p, v.to(cdt)).to(q.dtype)
    return (out, p) if return_probs else out


def _gather_segments(pool: Tensor, start: Tensor, width: int, row_stride: int | None) -> Tensor:
    R = start.shape[0]
    if row_stride is not None:  # evenly strided segments: a view
        return pool[: R * row_stride].view(R, row_stride, pool.shape[-1])[:, :width]
    idx = start[:, None] + torch.arange(width, device=pool.device)[None, :]
    return pool[idx.clamp(max=pool.shape[0] - 1)]


def torch_pool_attention(
    q, k_pool, v_pool, start, length, max_len, ring_k=None, ring_v=None, ring_valid=None, row_stride=None
):
    """The reference: gathers the segments into a padded ``[R, max_len, D]`` tensor (a slice when they are
    evenly strided: ``row_stride``) and runs :func:`masked_attention`."""
    width = max(int(max_len), 0)
    ks = _gather_segments(k_pool, start, width, row_stride)
    vs = _gather_segments(v_pool, start, width, row_stride)
    valid = torch.arange(width, device=q.device)[None, :] < length[:, None]
    if ring_k is not None:
        ks = torch.cat([ks, ring_k], dim=1)
        vs = torch.cat([vs, ring_v], dim=1)
        valid = torch.cat([valid, ring_valid], dim=1)
    return masked_attention(q, ks, vs, valid)
