"""`full`: dense causal attention; every key is kept (spec section 7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nats.cache.base import SlotCache
from nats.cache.engine import AppendRule
from nats.cache.registry import register_cache


@register_cache("full")
class FullCache(SlotCache):
    """Every key, slot = position; query i sees keys 0..i."""

    fixed_rule = AppendRule()  # the fixed-capacity engine: keep the whole prompt, append new tokens

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
        return self._store_and_attend(q, k, v, pos, pos + 1)
