"""`adakv`: Ada-KV (Feng et al. 2024) on SnapKV's votes: the KV heads of a layer share one budget and each head
gets what its votes earn (Ada-SnapKV).

With a prompt of N > B tokens and window w, every KV head keeps the window, and the ``Hkv * (B - w)`` prefix
keys of a sequence are split between its KV heads: each head first keeps its own best ``floor(alpha * (B - w))``
prefix keys (the safeguard, ``alpha`` = 0.2 as Ada-KV's floor), the rest are the best remaining votes over all
heads of the layer together (SnapKV's pooled votes, snapkv.py; ties: lower head, then earlier position). So a
head keeps its top-n_h prefix keys, the n_h differ between heads and sum to ``Hkv * (B - w)``: the mean cache of
a layer's heads after the prefill is exactly B (kvpress' AdaKVPress allocates the same way; Ada-KV's own code
rounds the floor per head, so its total can differ by a few tokens). N <= B keeps everything.

The selection is a function, `ada_keep`, which the cache and its fixed-capacity rule (`AdaKVRule`) both call.
Storage, decoding (appends, no eviction) and budget accounting: as `snapkv` (rows have different lengths).
"""

from __future__ import annotations

import math

from torch import Tensor

from nats.cache.policies.snapkv import SnapKVRule, snapkv_keep, top_mask
from nats.cache.registry import register_cache
from nats.cache.rule import RuleContext


def ada_prefix(votes: Tensor, budget: int, window: int, alpha: float = 0.2) -> Tensor:
    """The prefix keys each KV head keeps, bool ``[B, Hkv, N - window]``, from SnapKV's votes ``[B, Hkv, N -
    window]``: its best ``floor(alpha * (budget - window))``, then the best remaining votes of all heads together."""
    B, H, p = votes.shape
    base = budget - window
    floor = math.floor(alpha * base)
    safe = top_mask(votes, floor)
    rest = votes.masked_fill(safe, float("-inf")).reshape(B, H * p)
    chosen = top_mask(rest, H * (base - floor)).reshape(B, H, p)
    return safe | chosen


def ada_keep(q: Tensor, k: Tensor, budget: int, window: int = 32, kernel: int = 7, pooling: str = "max",
             alpha: float = 0.2) -> Tensor:  # fmt: skip
    """The prompt tokens Ada-SnapKV keeps, bool ``[B, Hkv, N]``: SnapKV's selection (`snapkv_keep`) with the prefix
    keys shared out between the heads (`ada_prefix`)."""
    return snapkv_keep(q, k, budget, window, kernel, pooling, lambda votes, n: ada_prefix(votes, budget, window, alpha))


@register_cache("adakv")
class AdaKVRule(SnapKVRule):
    """Ada-SnapKV in the fixed-capacity engine: `SnapKVRule` with the heads' shares (`ada_keep`)."""

    name = "adakv"
    even_rows = False

    def __init__(self, *, alpha: float = 0.2, **options):
        super().__init__(**options)
        if not 0 <= alpha <= 1:
            raise ValueError(
                f"adakv: alpha (the share of B - window each head keeps first) must be in [0, 1], got {alpha!r}"
            )
        self.alpha = float(alpha)

    def select(self, ctx: RuleContext, q: Tensor, k: Tensor, budget: int) -> Tensor:
        return ada_keep(q, k, budget, self.window, self.kernel, self.pooling, self.alpha)
