"""`adakv`: Ada-KV (Feng et al. 2024) on SnapKV's votes: the KV heads of a layer share one budget and each head
gets what its votes earn (Ada-SnapKV).

With a prompt of N > B tokens and window w, every KV head keeps the window, and the ``Hkv * (B - w)`` prefix
keys of a sequence are split between its KV heads: each head first keeps its own best ``floor(alpha * (B - w))``
prefix keys (the safeguard, ``alpha`` = 0.2 as Ada-KV's floor), the rest are the best remaining votes over all
heads of the layer together (SnapKV's pooled votes, snapkv.py; ties: lower head, then earlier position). So a
head keeps its top-n_h prefix keys, the n_h differ between heads and sum to ``Hkv * (B - w)``: the mean cache of
a layer's heads after the prefill is exactly B (kvpress' AdaKVPress allocates the same way; Ada-KV's own code
rounds the floor per head, so its total can differ by a few tokens). N <= B keeps everything.

Storage, decoding (appends, no eviction) and budget accounting: as `snapkv` (rows have different lengths).
"""

from __future__ import annotations

import math

from nats.cache.policies.snapkv import SnapKVCache, top_mask
from nats.cache.registry import register_cache


@register_cache("adakv")
class AdaKVCache(SnapKVCache):
    even_rows = False  # each head takes its own share of the budget

    def __init__(self, *, budget: int, alpha: float = 0.2, **kwargs):
        type(self).check_budget(budget, 10**18, alpha=alpha, **kwargs)
        super().__init__(budget=budget, **kwargs)
        self.alpha = float(alpha)

    @classmethod
    def check_budget(cls, budget, n, alpha: float = 0.2, **options):
        super().check_budget(budget, n, **options)
        if not 0 <= alpha <= 1:
            raise ValueError(
                f"adakv: alpha (the share of B - window each head keeps first) must be in [0, 1], got {alpha!r}"
            )

    def _keep_prefix(self, votes, n):
        B, H, p = votes.shape
        base = self.budget - self.window
        floor = math.floor(self.alpha * base)
        safe = top_mask(votes, floor)
        rest = votes.masked_fill(safe, float("-inf")).reshape(B, H * p)
        chosen = top_mask(rest, H * (base - floor)).reshape(B, H, p)
        return safe | chosen
