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

from nats.cache.engine import plan_rows, pool_fill
from nats.cache.policies.h2o import H2ORule
from nats.cache.registry import register_cache
from nats.cache.rule import Plan, PromptState


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
class H2ODenseRule(H2ORule):
    """The approximation in the engine (`nats.cache.engine`), prefill only: the masked forward, then what the last
    query kept (its row's segment, for `kept` and the bytes); a decode step is refused. H2O's options and budget
    check."""

    decodable = False

    def prompt(self, ctx, core, q, k, v, hidden, budget, offset=0):
        self.check_budget(budget, 10**18)
        recent = budget // 2 if self.recent is None else int(self.recent)
        Hkv = k.shape[1]
        G = q.shape[1] // Hkv
        mask = h2o_dense_mask(q, k, budget, recent)  # [b, Hkv, N, N]
        m = mask.repeat_interleave(G, dim=1) if G > 1 else mask
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=m)
        return PromptState(y, keep=mask[..., -1, :].contiguous(), sizes=mask.sum(-1) if ctx.track else None)

    def plan(self, ctx, core, state, k, v, budgets, real):
        keep, rank, rows, end = plan_rows(state.keep, state.keep.sum(-1).reshape(-1))
        return Plan(rows, end, lambda size: pool_fill(keep, rank, rows, k, v, size))

    def setup(self, ctx, layer):
        pass  # H2O's slots and scores are not kept: nothing decodes from here

    def buffers(self, layer):
        return []

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        raise NotImplementedError("h2o_dense is a parallel evaluation approximation; decode with `h2o`")
