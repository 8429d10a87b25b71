"""`h2o`: Heavy-Hitter Oracle with budget B and R = B // 2 recent tokens (spec section 7), exact and sequential.

Per layer and KV head the cache holds at most B keys. At step i:

1. token i is admitted (always);
2. if the cache now holds B + 1 keys, the *lowest-scoring non-recent* key is evicted: among the keys with
   position <= i - R (the R most recent positions, i included, are protected) the one with the smallest score,
   ties broken towards the oldest position;
3. query i attends over the kept keys (at most B);
4. each kept key's score grows by the probability query i gave it (over the keys kept at this step).

So the score of a key is the sum of the attention probabilities earlier queries actually gave it. GQA: the
cache is per KV head and the score sums the probabilities of the query heads of its group (for multi-head
attention this is the per-head rule). Scores accumulate in float32 (float64 for float64 models).

`h2o_dense` is a labelled *approximation* for fast parallel evaluation (not H2O): query i keeps the R most
recent keys and the B - R older keys with the largest accumulated *dense* causal softmax probability
``sum_{i' < i} P_dense[i', j]`` (summed over the group's query heads); keys may come back, and probabilities are
those of full attention, not of the kept set. It cannot decode.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nats.cache.attention import masked_attention
from nats.cache.base import LayerCache
from nats.cache.registry import register_cache


@register_cache("h2o")
class H2OCache(LayerCache):
    budgeted = True

    def __init__(self, *, budget: int, recent: int | None = None, **kwargs):
        super().__init__(budget=budget, **kwargs)
        type(self).check_budget(budget, 10**18, recent=recent)
        self.recent = budget // 2 if recent is None else int(recent)
        shape = (self.rows, budget, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slot_pos = torch.full((self.rows, budget), -1, device=self.device, dtype=torch.long)
        sdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.score = torch.zeros((self.rows, budget), device=self.device, dtype=sdt)
        self._big = torch.iinfo(torch.long).max
        # a device zero: assigning the Python scalar 0 would copy from the host, which CUDA-graph capture refuses
        self._zero = torch.zeros((), device=self.device, dtype=sdt)

    @classmethod
    def check_budget(cls, budget, n, recent: int | None = None, **options):
        super().check_budget(budget, n)
        if budget < 2:
            raise ValueError(f"h2o: budget B={budget} is too small: B must be >= 2 (B/2 recent + B/2 heavy hitters)")
        r = budget // 2 if recent is None else recent
        if not 1 <= r <= budget:
            raise ValueError(f"h2o: recent must be in [1, B={budget}], got {r}")

    def step(self, q, k, v, x, pos):
        kr, vr = self._kv_rows(k), self._kv_rows(v)
        filled = self.slot_pos >= 0
        n = filled.sum(1)  # [R]
        cand = filled & (self.slot_pos <= pos - self.recent)
        key = torch.where(cand, self.score, torch.full_like(self.score, math.inf))
        low = key.amin(1, keepdim=True)
        tie = cand & (key == low)
        victim = torch.where(tie, self.slot_pos, torch.full_like(self.slot_pos, self._big)).argmin(1)
        slot = torch.where(n >= self.budget, victim, n.clamp(max=self.budget - 1))  # [R]
        rows = torch.arange(self.rows, device=self.device)
        self.k[rows, slot] = kr
        self.v[rows, slot] = vr
        self.slot_pos[rows, slot] = pos.expand(self.rows)
        self.score[rows, slot] = self._zero
        valid = self.slot_pos >= 0
        self._record(valid.sum(1))
        self.t += 1
        y, p = masked_attention(self._q_rows(q), self.k, self.v, valid, return_probs=True)
        self.score += p.sum(1).to(self.score.dtype)
        return self._out(y)

    def visible_positions(self) -> torch.Tensor:
        """Positions held per row (-1 for empty slots), [R, B] (for tests and analysis)."""
        return self.slot_pos.clone()

    def kept(self):
        return (self.slot_pos >= 0).sum(1).view(self.batch, self.n_kv_head)

    def tensors(self):
        return [self.k, self.v, self.slot_pos, self.score]

    def kv_tensors(self):
        return [self.k, self.v]


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

    def prefill(self, q, k, v, x):
        if self.t:
            raise RuntimeError("prefill() starts from an empty cache")
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
