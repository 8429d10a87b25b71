"""`full`: dense causal attention; every key is kept (spec section 7)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nats.cache.attention import pool_attention
from nats.cache.base import LayerCache
from nats.cache.registry import register_cache


class SlotCache(LayerCache):
    """Preallocated ``[B, Hkv, capacity, D]`` keys and values, every row holding the same number of keys in
    slots 0..length-1 (`full`: slot = position; `streaming_llm`: sinks, then a ring)."""

    def __init__(self, capacity: int, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        shape = (self.batch, self.n_kv_head, capacity, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.start = torch.arange(self.rows, device=self.device, dtype=torch.long) * capacity
        self.length = torch.zeros(self.rows, device=self.device, dtype=torch.long)

    def _store_and_attend(self, q, k, v, slot, length):
        """Write the new key/value at `slot`, set every row's length, attend over the held keys."""
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.length.copy_(length.expand(self.rows))
        self._record(self.length)
        self.t += 1
        D = self.head_dim
        max_len = self.capacity if self.backend == "triton" else min(self.t, self.capacity)
        y = pool_attention(self._q_rows(q), self.k.view(-1, D), self.v.view(-1, D), self.start, self.length, max_len,
                           row_stride=self.capacity, backend=self.backend)
        return self._out(y)

    def kept(self):
        return self.length.view(self.batch, self.n_kv_head).clone()

    def tensors(self):
        return [self.k, self.v, self.start, self.length]

    def kv_tensors(self):
        return [self.k, self.v]


@register_cache("full")
class FullCache(SlotCache):
    """Every key, slot = position; query i sees keys 0..i."""

    def __init__(self, **kwargs):
        super().__init__(capacity=kwargs["max_len"], **kwargs)

    def prefill(self, q, k, v, x):
        if self.t:
            raise RuntimeError("prefill() starts from an empty cache")
        N = q.shape[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        self.k[:, :, :N] = k
        self.v[:, :, :N] = v
        self.length.fill_(N)
        self._record_many(torch.arange(1, N + 1, device=self.device).expand(self.rows, N))
        self.t = N
        return y

    def step(self, q, k, v, x, pos):
        return self._store_and_attend(q, k, v, pos, pos + 1)
