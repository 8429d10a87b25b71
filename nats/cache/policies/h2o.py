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

The prefill is the base class' one: the same rule, one position at a time inside each layer. Its labelled
parallel approximation is `h2o_dense` (h2o_dense.py).
"""

from __future__ import annotations

import math

import torch

from nats.cache.attention import masked_attention
from nats.cache.base import LayerCache
from nats.cache.registry import register_cache


@register_cache("h2o")
class H2OCache(LayerCache):
    budgeted = True
    no_fixed_rule = (
        "its eviction reads each step's attention probabilities, which the split-K decode kernel does not return: it "
        "decodes through nats.hf.PolicyCache and the GPT path (CUDA graphs, PyTorch attention)"
    )

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
