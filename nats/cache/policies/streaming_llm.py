"""`streaming_llm`: attention sinks + a recent window, budget B (spec section 7).

Key j is visible to query i iff ``j <= i and (j < sinks or i - j < B - sinks)``. The cache holds the first
``sinks`` tokens and a ring of the last ``B - sinks`` ones; keys keep the RoPE of their original position (no
position shift; positions stay within the model's block_size). The mask is static, so the parallel prefill is a
masked forward and decoding equals it exactly.

``exact_prefill=True`` (not the default: not StreamingLLM's streaming model) is the variant that kvpress'
``StreamingLLMPress`` implements (docs/kvpress.md): the prompt's attention is exact (causal over all N tokens), then
the cache keeps the same sinks + last ``B - sinks`` prompt tokens and decoding goes on as above. The prompt queries
then read every key before them, which the area and peak fractions count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nats.cache.engine import attend, chunk_attention, plan_rows, pool_fill, segment_kv, write_kv
from nats.cache.registry import register_cache
from nats.cache.rule import AppendRule, Plan, PromptState


def streaming_mask(n: int, budget: int, sinks: int = 4, device=None) -> torch.Tensor:
    """The StreamingLLM mask ``[n, n]`` (query x key), spec section 7."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & ((j < sinks) | (i - j < budget - sinks))


def ring_slot(count: Tensor, sinks: int, capacity: Tensor | int) -> Tensor:
    """The slot of the token written as the ``count``-th (0-based) of a row holding ``capacity`` keys: the first
    ``sinks`` in order, the rest in a ring of ``capacity - sinks`` slots."""
    return torch.where(count < sinks, count, sinks + (count - sinks) % (capacity - sinks))


def prompt_keep(n: int, budget: int, sinks: int, device=None) -> Tensor:
    """Which of n prompt positions the cache holds after the prompt: the sinks and the last ``budget - sinks``."""
    pos = torch.arange(n, device=device)
    return (pos < sinks) | (pos > n - 1 - (budget - sinks))


@register_cache("streaming_llm")
class RingRule(AppendRule):
    """The fixed-capacity form (`nats.cache.engine`): a segment of ``budget`` slots per row, the sinks first, then a
    ring overwritten oldest first; the row's ``count`` (counter 5: the tokens written, counted from the kept length
    after the prompt) gives the slot. The prompt's
    attention is the StreamingLLM mask (exact: decoding continues the masked forward), or with ``exact_prefill`` the
    causal attention over the whole prompt (kvpress' press; the same keys kept, the prompt's sizes unclamped)."""

    name = "streaming_llm"
    budgeted = True
    grows = False  # a row holds its budget at most

    def __init__(self, *, sinks: int = 4, exact_prefill: bool = False, **unused):
        if int(sinks) != sinks or sinks < 0:
            raise ValueError(f"streaming_llm: sinks must be an integer >= 0, got {sinks!r}")
        self.sinks, self.exact_prefill = int(sinks), bool(exact_prefill)

    def check_budget(self, budget, n):
        super().check_budget(budget, n)
        sinks = self.sinks
        if budget <= sinks:
            raise ValueError(
                f"streaming_llm: budget B={budget} is too small for {sinks} attention sinks (B - sinks recent "
                f"tokens must be >= 1): use a budget >= {sinks + 1} or fewer sinks (sinks=...; in nats-eval "
                f"policies.streaming_llm.options.sinks=...)"
            )

    def prompt(self, ctx, core, q, k, v, hidden, budget, offset=0):
        sinks = int(self.sinks)
        if budget <= sinks:
            raise ValueError(f"StaticPolicyCache: streaming_llm budget {budget} must exceed sinks={sinks}")
        b_, Hq, n = q.shape[0], q.shape[1], q.shape[2]
        Hkv = k.shape[1]
        if self.exact_prefill:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
        else:
            mask = streaming_mask(n, budget, sinks, device=q.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)
        keep = prompt_keep(n, budget, sinks, q.device).expand(b_, Hkv, n).contiguous()  # strides as padded
        sizes = None
        if ctx.track:
            sizes = torch.arange(1, n + 1, device=q.device)
            sizes = (sizes if self.exact_prefill else sizes.clamp(max=budget)).expand(b_, Hkv, n)
        return PromptState(y, keep, sizes=sizes)

    def plan(self, ctx, core, state, k, v, budgets, real):
        # the kept prompt tokens lie in position order from the row's start (the sinks, then the oldest recent one):
        # the ring's next slot is its oldest when the count starts at the kept length (a full row: its capacity)
        keep, rank, rows, end = plan_rows(state.keep, budgets, None, torch.minimum(real, budgets))
        return Plan(rows, end, lambda size: pool_fill(keep, rank, rows, k, v, size))

    def setup(self, ctx, layer):
        layer.sinks = int(self.sinks)

    def extend(self, ctx, layer, core, q, k, v, hidden, first):
        # by each token's write index m (the count when it was written; positions differ from it by a constant per
        # row): query m_c sees key m_j iff m_j <= m_c and (m_j < sinks or m_c - m_j < cap - sinks), as the steps do
        keys, values, slot = segment_kv(layer)
        n, sinks = q.shape[2], layer.sinks
        count, cap = layer.count[:, None], layer.cap[:, None]
        recent = cap - sinks  # the ring's slots
        last = count - 1  # the newest held token's index; slot s of the ring holds the latest index written there
        held = last - torch.remainder(ring_slot(last, sinks, cap) - slot, recent.clamp(min=1))
        held = torch.where(slot < sinks, slot, held)  # [R, L] each held slot's index
        m = count + torch.arange(n, device=q.device)  # [R, n] the chunk's indices
        m_keys = torch.cat((held, m), dim=1)  # [R, L + n]
        valid = torch.cat((slot[None, :] < layer.length[:, None], torch.ones_like(m, dtype=torch.bool)), dim=1)
        qi, kj = m[:, :, None], m_keys[:, None, :]
        mask = valid[:, None, :] & (kj <= qi) & ((kj < sinks) | (qi - kj < recent[:, :, None]))
        y = chunk_attention(q, torch.cat((keys, k), 1), torch.cat((values, v), 1), mask)
        sizes = mask.sum(-1) if ctx.track else None
        # the writes the steps would leave: a chunk token stays unless a later one of the chunk takes its slot
        final = (m < sinks) | (m + recent > count + n - 1)
        dest = torch.where(final, layer.start[:, None] + ring_slot(m, sinks, cap), layer.kv_pool.shape[1] - 1)
        write_kv(layer.kv_pool, dest.reshape(-1), k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]))
        layer.count.add_(n)
        layer.length.copy_(torch.minimum(layer.count, layer.cap))
        return y, sizes

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        dest = layer.start + ring_slot(layer.count, layer.sinks, layer.cap)
        layer.count.add_(1)
        layer.length.copy_(torch.minimum(layer.count, layer.cap))
        write_kv(layer.kv_pool, dest, kr, vr)
        return attend(layer, qr, even=self.even_rows, backend=ctx.backend), layer.length
