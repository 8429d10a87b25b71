"""`pyramidkv`: PyramidKV (Cai et al. 2024): SnapKV's selection with per-layer budgets that decrease linearly
from the lowest layer to the highest, their mean equal to the budget B.

With a prompt of N > B tokens, window w, prefix length p = N - w, base b = B - w and L layers, layer l keeps
the window and its ``b_l`` best prefix keys (SnapKV's votes, snapkv.py), where the real budgets

    x_l = max - l * (max - min) / (L - 1),   min = b / beta,  max = 2 b - min

(PyramidKV's pyramid; ``beta`` = 20 as in its code) are clipped as PyramidKV does when the lowest layer would
ask for more prefix keys than there are (``max = p``, ``min = 2 b - max``), and rounded to integers that are
non-increasing in l, within 1 of x_l and sum to exactly ``L * b`` (the original code floors the step
instead, so its mean can exceed b a little). So the layers' mean cache after the prefill is exactly B, the lower
layers keep more than B and the higher ones fewer. N <= B keeps everything in every layer; unlike the original,
a prompt below 2 (B - w) is not sent back to plain SnapKV (as in kvpress). One layer: SnapKV.

The policy needs the number of layers: the engine's `nats.cache.rule.RuleContext` gives it to `PyramidKVRule`.
The selection is a function, `pyramid_keep`. Storage, decoding (appends, no eviction) and budget accounting: as
`snapkv`.
"""

from __future__ import annotations

import math

from torch import Tensor

from nats.cache.policies.snapkv import SnapKVRule, snapkv_keep, top_mask
from nats.cache.registry import register_cache
from nats.cache.rule import RuleContext


def pyramid_budgets(base: int, prefix: int, n_layer: int, beta: float = 20) -> list[int]:
    """Prefix-key budgets of the layers (window excluded): non-increasing, summing to ``n_layer * base``, each
    at most `prefix` (needs 0 <= base <= prefix)."""
    if not 0 <= base <= prefix:
        raise ValueError(f"pyramid budgets need 0 <= base <= prefix, got base={base}, prefix={prefix}")
    if n_layer == 1:
        return [base]
    lo = base / beta
    hi = 2 * base - lo
    if hi > prefix:
        hi, lo = prefix, 2 * base - prefix
    x = [hi - layer * (hi - lo) / (n_layer - 1) for layer in range(n_layer)]
    out = [min(math.floor(v + 1e-9), prefix) for v in x]
    extra = n_layer * base - sum(out)
    for layer in range(n_layer):  # the remaining tokens to the lowest layers below the prefix length
        if extra == 0:
            break
        if out[layer] < prefix:
            out[layer] += 1
            extra -= 1
    return out


def pyramid_sizes(n: int, budget: int, window: int, n_layer: int, beta: float = 20) -> list[int]:
    """The cache size of every layer after a prefill of n tokens (window included)."""
    if n <= budget:
        return [n] * n_layer
    return [x + window for x in pyramid_budgets(budget - window, n - window, n_layer, beta)]


def pyramid_keep(q: Tensor, k: Tensor, budget: int, layer_idx: int, n_layer: int, window: int = 32, kernel: int = 7,
                 pooling: str = "max", beta: float = 20) -> Tensor:  # fmt: skip
    """The prompt tokens layer ``layer_idx`` of ``n_layer`` keeps, bool ``[B, Hkv, N]``: SnapKV's selection
    (`snapkv_keep`) with the layer's prefix budget (`pyramid_sizes`)."""

    def prefix(votes: Tensor, n: int) -> Tensor:
        return top_mask(votes, pyramid_sizes(n, budget, window, n_layer, beta)[layer_idx] - window)

    return snapkv_keep(q, k, budget, window, kernel, pooling, prefix)


@register_cache("pyramidkv")
class PyramidKVRule(SnapKVRule):
    """PyramidKV in the fixed-capacity engine: `SnapKVRule` with the layer's budget (`pyramid_keep`; the layers from
    the `RuleContext`)."""

    name = "pyramidkv"

    def __init__(self, *, beta: float = 20, **options):
        super().__init__(**options)
        if not beta >= 1:
            raise ValueError(f"pyramidkv: beta must be >= 1 (the pyramid's min = (B - window) / beta), got {beta!r}")
        self.beta = float(beta)

    def select(self, ctx: RuleContext, q: Tensor, k: Tensor, budget: int) -> Tensor:
        return pyramid_keep(q, k, budget, ctx.layer_idx, ctx.n_layer, self.window, self.kernel, self.pooling,
                            self.beta)  # fmt: skip
