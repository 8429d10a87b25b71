"""`snapkv`: SnapKV (Li et al. 2024), a *prefill-time* compression with budget B per layer and KV head.

The prompt's attention is exact (causal SDPA over all N prompt tokens: SnapKV compresses only the cache). Then,
if N > B, the cache keeps per KV head

* the observation window: the last ``w = window`` prompt tokens (default 32), and
* the B - w prefix keys (positions < N - w) with the largest *votes*: the softmax probabilities that the window's
  queries give them (softmax over the causal keys, as the model computes it), summed over the w queries and,
  for GQA, over the query heads of the KV group, then smoothed along the key axis by a 1-D pooling
  (``pooling="max"`` or ``"avg"``, ``kernel`` 7, stride 1, zero-padded ``kernel // 2`` as SnapKV's ``pool1d``).
  Ties go to the earlier position.

If N <= B everything is kept (the cache equals `full`). Decoding appends every new token and evicts nothing, as
SnapKV does (its reference code and kvpress' press only act at prefill): after s decode steps a row holds
``min(N, B) + s`` keys. Budget accounting (spec section 6) counts what the queries actually read: prompt query i
reads i + 1 keys (the prefill is full attention, and the whole prompt's keys exist until the compression), decode
query i the kept keys plus the new ones; so the area and peak fractions include the prefill, and ``kept()`` is
the compressed cache.

Storage (allocated at prefill, so memory follows the compression): keys and values ``[B * Hkv, cap, D]`` with
``cap = (kept after prefill, largest row) + reserve`` decode slots (``reserve``: the tokens the caller will decode,
by default ``max_len - N``; more steps than that are refused), the position of each slot
(``slot_pos``, -1 empty) and the rows' lengths. A row's kept keys are slots ``0 .. length - 1`` in position
order, decode tokens are appended at ``length``: a step is one scatter and the pool attention of
`nats.cache.attention` (device tensors only, CUDA-graph capturable after the prefill). `step` on a cache that
was never prefilled starts from an empty prompt (nothing to compress: capacity max_len, all tokens kept).

The selection is a function, `snapkv_keep`, which the cache and its fixed-capacity rule (`SnapKVRule`: keep the
selection, append new tokens) both call. Subclasses change only which prefix keys a row keeps (`snapkv_keep`'s
``prefix``): `pyramidkv` (per-layer budgets) and `adakv` (per-head budgets).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from nats.cache.attention import compute_dtype
from nats.cache.registry import register_cache
from nats.cache.rule import AppendRule, RuleContext

POOLINGS = ("max", "avg")


def pool1d(x: Tensor, kernel: int, pooling: str) -> Tensor:
    """1-D pooling along the last axis, stride 1, zero padding ``kernel // 2`` (same length; odd kernel)."""
    if kernel == 1:
        return x
    shape = x.shape
    x = x.reshape(-1, 1, shape[-1])
    if pooling == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)
    return x.reshape(shape)


def snapkv_votes(q: Tensor, k: Tensor, window: int, kernel: int = 7, pooling: str = "max") -> Tensor:
    """SnapKV's pooled votes of the prefix keys, ``[B, Hkv, N - window]`` (compute dtype: float32, float64 for
    float64 inputs), from q ``[B, Hq, N, D]`` and k ``[B, Hkv, N, D]``: the causal softmax probabilities of the
    last `window` queries, summed over those queries and the group's query heads, pooled along the keys."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cdt = compute_dtype(q.dtype)
    qw = q[:, :, N - window :].to(cdt).reshape(B, Hkv, G, window, D)
    s = torch.einsum("bhgwd,bhnd->bhgwn", qw, k.to(cdt)) / math.sqrt(D)
    i = torch.arange(N - window, N, device=q.device)[:, None]
    j = torch.arange(N, device=q.device)[None, :]
    p = torch.softmax(s.masked_fill(j > i, float("-inf")), dim=-1)
    votes = p[..., : N - window].sum(dim=(2, 3))
    return pool1d(votes, kernel, pooling)


def top_mask(scores: Tensor, n: int | Tensor) -> Tensor:
    """Bool mask of the `n` largest scores along the last axis (n an int or a tensor broadcasting against
    ``scores[..., :1]``); ties go to the lower index."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return rank < n


def snapkv_keep(q: Tensor, k: Tensor, budget: int, window: int = 32, kernel: int = 7, pooling: str = "max",
                prefix=None) -> Tensor:  # fmt: skip
    """The prompt tokens SnapKV keeps after a prefill of q ``[B, Hq, N, D]`` / k ``[B, Hkv, N, D]``, bool ``[B, Hkv,
    N]``: everything if N <= budget, else the observation window and the prefix keys ``prefix(votes, N)`` chooses,
    bool ``[B, Hkv, N - window]`` from the pooled votes (`snapkv_votes`; default: the best ``budget - window``)."""
    B, Hkv, N = q.shape[0], k.shape[1], q.shape[2]
    if N <= budget:
        return torch.ones(B, Hkv, N, dtype=torch.bool, device=q.device)
    votes = snapkv_votes(q, k, window, kernel, pooling)
    chosen = top_mask(votes, budget - window) if prefix is None else prefix(votes, N)
    return torch.cat([chosen, torch.ones(B, Hkv, window, dtype=torch.bool, device=q.device)], dim=-1)


@register_cache("snapkv")
class SnapKVRule(AppendRule):
    """SnapKV in the fixed-capacity engine (`nats.cache.engine`): `AppendRule` keeping `snapkv_keep`'s selection of
    a prompt longer than the budget."""

    name = "snapkv"
    budgeted = True
    even_rows = True  # one budget for every row of a layer (PyramidKV's differ by layer only)
    prefill_time = True  # compresses once after an exact prefill; decoding appends without evicting

    def __init__(self, *, window: int = 32, kernel: int = 7, pooling: str = "max", **unused):
        name = self.name
        if int(window) != window or window < 1:
            raise ValueError(f"{name}: window must be a positive integer (observation window), got {window!r}")
        if int(kernel) != kernel or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"{name}: kernel must be an odd positive integer (pooling width), got {kernel!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"{name}: pooling must be one of {POOLINGS}, got {pooling!r}")
        self.window, self.kernel, self.pooling = int(window), int(kernel), pooling

    def check_budget(self, budget, n):
        super().check_budget(budget, n)
        name, window = self.name, self.window
        if window >= budget:
            raise ValueError(
                f"{name}: window={window} must be below the budget B={budget} (the cache keeps B - window prefix "
                f"keys and the window): use a budget > {window} or a smaller window ({name} option window=...)"
            )

    def select(self, ctx: RuleContext, q: Tensor, k: Tensor, budget: int) -> Tensor:
        return snapkv_keep(q, k, budget, self.window, self.kernel, self.pooling)
