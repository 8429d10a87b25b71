"""`full`: dense causal attention; every key is kept (spec section 7)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nats.cache.base import SlotCache
from nats.cache.engine import AppendRule
from nats.cache.registry import register_cache


@register_cache("full")
class FullCache(SlotCache):
    """Every key, slot = position; query i sees keys 0..i."""

    fixed_rule = AppendRule  # the fixed-capacity engine: keep the whole prompt, append new tokens

    def __init__(self, **kwargs):
        super().__init__(capacity=kwargs["max_len"], **kwargs)

    def _prefill(self, q, k, v, x):
        N = q.shape[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        self.k[:, :, :N] = k
        self.v[:, :, :N] = v
        self.length.fill_(N)
        self._record_many(torch.arange(1, N + 1, device=self.device).expand(self.rows, N))
        self.t = N
        return y

    def step(self, q, k, v, x, pos):
        compiled = self.k.is_cuda and self.backend == "triton" and not torch.compiler.is_compiling()
        (_compiled_append() if compiled else append)(self.k, self.v, self.length, k, v, pos)
        return self._attend_written(q)


def append(k_buf, v_buf, length, k, v, pos):
    """A step's writes: the new key and value (``[B, Hkv, 1, D]``) into slot ``pos`` (LongTensor ``[1]``) of every
    row of ``k_buf``, ``v_buf`` (``[B, Hkv, capacity, D]``), and every row's length ``pos + 1``."""
    k_buf[:, :, pos] = k
    v_buf[:, :, pos] = v
    length.copy_((pos + 1).expand(length.shape[0]))


@functools.cache
def _compiled_append():
    """`append` compiled: one in-place kernel (inductor's combo kernels launch its three as one) where eager launches
    four, two index copies, the add and the lengths' copy (GPT-2-small, batch 8, 8k, one H200: 2.0 us a layer against
    7.4, the step 1.175 -> 1.107 ms; docs/results/bench_limit_h200.md). Made once per process and shared by every
    layer (the buffers are its inputs). On CUDA with the Triton backend, outside an enclosing compile (there `append`
    is traced into the caller's graph)."""
    return torch.compile(append, fullgraph=True, options={"combo_kernels": True})
