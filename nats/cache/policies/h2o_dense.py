"""`h2o_dense`: a labelled *approximation* of H2O for fast parallel evaluation (not H2O), evaluation only.

Query i keeps the R = B // 2 most recent keys and the B - R older keys with the largest accumulated *dense* causal
softmax probability ``sum_{i' < i} P_dense[i', j]`` (summed over the group's query heads); keys may come back, and
probabilities are those of full attention, not of the kept set. One masked forward per layer; it cannot decode
(``decodable = False``: decode with `h2o`, h2o.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nats.cache.base import LayerCache
from nats.cache.policies.h2o import H2OCache
from nats.cache.registry import register_cache


def h2o_dense_mask(q: torch.Tensor, k: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """The dense-softmax H2O approximation's mask [B, Hkv, N, N] from q [B, Hq, N, D] and k [B, Hkv, N, D]."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.einsum("bhgid,bhjd->bhgij", q.to(cdt).view(B, Hkv, G, N, D), k.to(cdt)) / math.sqrt(D)
    i = torch.arange(N, device=q.device)[:, None]
    j = torch.arange(N, device=q.device)[None, :]
    causal = j <= i
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1).sum(2)  # [B, Hkv, N, N]
    acc = p.cumsum(2) - p  # acc[i, j] = sum_{i' < i} p[i', j]
    old = causal & (j <= i - recent)
    heavy = budget - recent
    score = acc.masked_fill(~old, float("-inf"))
    top = score.topk(min(heavy, N), dim=-1).indices
    mask = torch.zeros_like(causal).expand(B, Hkv, N, N).clone()
    mask.scatter_(-1, top, True)
    mask &= old
    mask |= causal & (i - j < recent)
    mask |= causal & (i < budget)  # the cache is not yet full: everything is kept
    return mask


@register_cache("h2o_dense")
class H2ODenseApproxCache(LayerCache):
    """Parallel dense-softmax H2O *approximation* (evaluation only, labelled as such)."""

    budgeted = True
    decodable = False
    graph_safe = False

    def __init__(self, *, budget: int, recent: int | None = None, **kwargs):
        super().__init__(budget=budget, **kwargs)
        H2OCache.check_budget(budget, 10**18, recent=recent)
        self.recent = budget // 2 if recent is None else int(recent)
        self._kept = torch.zeros(self.rows, dtype=torch.long, device=self.device)

    check_budget = H2OCache.check_budget

    def _prefill(self, q, k, v, x):
        N = q.shape[2]
        mask = h2o_dense_mask(q, k, self.budget, self.recent)  # [B, Hkv, N, N]
        G = self.group
        m = mask.repeat_interleave(G, dim=1) if G > 1 else mask
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=m)
        sizes = mask.sum(-1).reshape(self.rows, N)
        self._record_many(sizes)
        self._kept.copy_(sizes[:, -1])
        self.t = N
        return y

    def step(self, q, k, v, x, pos):
        raise NotImplementedError("h2o_dense is a parallel evaluation approximation; decode with `h2o`")

    def kept(self):
        return self._kept.view(self.batch, self.n_kv_head)

    def tensors(self):
        return [self._kept]

    def kv_tensors(self):
        return []
