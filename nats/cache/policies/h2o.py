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

The prefill is the same rule, one position at a time inside each layer (`h2o_prefill`, which the cache and its
fixed-capacity rule `H2ORule` both run). Its labelled parallel approximation is `h2o_dense` (h2o_dense.py).
"""

from __future__ import annotations

import math

import torch

from nats.cache.attention import masked_attention
from nats.cache.engine import write_kv
from nats.cache.registry import register_cache
from nats.cache.rule import FixedRule, Plan, PromptState

_BIG = torch.iinfo(torch.long).max


def h2o_step(k, v, slot_pos, score, kr, vr, qr, pos, budget: int, recent: int, zero, write=None):
    """One H2O step on a row's B slots (module docstring): k, v ``[R, B, D]``, ``slot_pos`` ``[R, B]`` (-1: empty),
    ``score`` ``[R, B]`` are updated in place; the new token kr, vr ``[R, D]`` at position ``pos`` ``[1]`` is
    admitted (evicting the lowest-scoring non-recent key of a full row), query qr ``[R, G, D]`` attends over the
    held keys and their scores grow by its probabilities. ``zero``: a device zero of the scores' dtype (CUDA-graph
    capture refuses host scalars). ``write(flat, kr, vr)``: writes the new key and value at the flat slots
    ``row * B + slot`` where k and v are views of a buffer (one in-place write to the buffer itself: a compiled
    step copies a view it writes through whole); by default into k and v. Returns the output ``[R, G, D]`` and the
    keys each row holds ``[R]``."""
    R = slot_pos.shape[0]
    filled = slot_pos >= 0
    n = filled.sum(1)  # [R]
    cand = filled & (slot_pos <= pos - recent)
    key = torch.where(cand, score, torch.full_like(score, math.inf))
    low = key.amin(1, keepdim=True)
    tie = cand & (key == low)
    victim = torch.where(tie, slot_pos, torch.full_like(slot_pos, _BIG)).argmin(1)
    slot = torch.where(n >= budget, victim, n.clamp(max=budget - 1))  # [R]
    rows = torch.arange(R, device=slot_pos.device)
    if write is None:
        k[rows, slot] = kr
        v[rows, slot] = vr
    else:
        write(rows * slot_pos.shape[1] + slot, kr, vr)
    slot_pos[rows, slot] = pos.expand(R)
    score[rows, slot] = zero
    valid = slot_pos >= 0
    y, p = masked_attention(qr, k, v, valid, return_probs=True)
    score += p.sum(1).to(score.dtype)
    return y, valid.sum(1)


def h2o_buffers(rows: int, budget: int, head_dim: int, device, dtype: torch.dtype):
    """An empty H2O state of ``rows`` rows of B = ``budget`` slots: keys and values ``[R, B, D]`` (zeros), the slots'
    positions ``[R, B]`` (-1: empty), their scores ``[R, B]`` (float32; float64 for float64 models) and a device zero
    of the scores' dtype (assigning the Python scalar 0 would copy from the host, which CUDA-graph capture refuses)."""
    shape = (rows, budget, head_dim)
    k = torch.zeros(shape, device=device, dtype=dtype)
    v = torch.zeros(shape, device=device, dtype=dtype)
    slot_pos = torch.full((rows, budget), -1, device=device, dtype=torch.long)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    score = torch.zeros((rows, budget), device=device, dtype=sdt)
    return k, v, slot_pos, score, torch.zeros((), device=device, dtype=sdt)


def h2o_prefill(q, k, v, state, budget: int, recent: int, record=None):
    """H2O's exact rule over a prompt, one position at a time (`h2o_step`): q ``[B, Hq, N, D]``, k, v ``[B, Hkv, N,
    D]`` into ``state`` (`h2o_buffers`, updated in place), ``record(held)`` called after each position with the keys
    each row held ``[R]``. Returns the attention output ``[B, Hq, N, D]``."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    R = B * Hkv
    ys = []
    for i in range(N):
        pos = torch.full((1,), i, dtype=torch.long, device=q.device)
        kr, vr, qr = k[:, :, i].reshape(R, D), v[:, :, i].reshape(R, D), q[:, :, i].reshape(R, Hq // Hkv, D)
        y, held = h2o_step(*state[:4], kr, vr, qr, pos, budget, recent, state[4])
        if record is not None:
            record(held)
        ys.append(y.reshape(B, Hq, 1, D))
    return torch.cat(ys, dim=2)


@register_cache("h2o")
class H2ORule(FixedRule):
    """H2O in the fixed-capacity engine (`nats.cache.engine`): a segment of B slots per row (B: the budget, one for
    all rows), the slots' positions and scores beside it; the prompt runs H2O's exact sequential rule
    (`h2o_prefill`), a decode step `h2o_step` with PyTorch attention (it needs the probabilities, which the split-K
    kernel does not return). A fraction budget is resolved per sequence; rows of one batch take the largest."""

    name = "h2o"
    budgeted = True
    shared_budget = True

    def __init__(self, *, recent: int | None = None, **unused):
        self.recent = recent  # as given: checked with the budget (check_budget)

    def check_budget(self, budget, n):
        super().check_budget(budget, n)
        if budget < 2:
            raise ValueError(f"h2o: budget B={budget} is too small: B must be >= 2 (B/2 recent + B/2 heavy hitters)")
        r = budget // 2 if self.recent is None else self.recent
        if not 1 <= r <= budget:
            raise ValueError(f"h2o: recent must be in [1, B={budget}], got {r}")

    def prompt(self, ctx, core, q, k, v, hidden, budget, offset=0):
        b_, Hq, n, D = q.shape
        Hkv = k.shape[1]
        self.check_budget(budget, 10**18)  # a prompt within the budget is kept whole
        recent = budget // 2 if self.recent is None else int(self.recent)
        state = h2o_buffers(b_ * Hkv, budget, D, q.device, q.dtype)
        y = h2o_prefill(q, k, v, state, budget, recent)
        slot_pos = state[2]
        if offset:  # left padding: the decode steps count positions with the padding
            slot_pos.add_(torch.where(slot_pos >= 0, offset, 0))
        sizes = torch.arange(1, n + 1, device=q.device).clamp(max=budget).expand(b_, Hkv, n) if ctx.track else None
        return PromptState(y, sizes=sizes, extra=dict(zip(("k", "v", "slot_pos", "score"), state[:4])))

    def plan(self, ctx, core, state, k, v, budgets, real):
        h, R = state.extra, state.extra["slot_pos"].shape[0]
        B = h["slot_pos"].shape[1]
        length = (h["slot_pos"] >= 0).sum(1)
        start = torch.arange(R, device=length.device) * B
        zero = torch.zeros_like(length)
        rows = torch.stack((start, length, torch.full_like(length, B), zero, zero - 1, zero))

        def fill(size):
            pool = h["k"].new_zeros(2, size, h["k"].shape[-1])
            pool[0, : R * B] = h["k"].reshape(R * B, -1)
            pool[1, : R * B] = h["v"].reshape(R * B, -1)
            return pool

        extra = {"slot_pos": h["slot_pos"], "score": h["score"], "h2o_zero": h["score"].new_zeros(())}
        return Plan(rows, start[-1:] + B, fill, extra=extra)

    def setup(self, ctx, layer):
        layer.h2o_budget = layer.slot_pos.shape[1]
        layer.h2o_recent = layer.h2o_budget // 2 if self.recent is None else int(self.recent)

    def buffers(self, layer):
        return [layer.slot_pos, layer.score, layer.h2o_zero]

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        R, B = layer.slot_pos.shape
        kv = layer.kv_pool[:, : R * B].view(2, R, B, -1)
        kr, vr = kr.reshape(R, -1), vr.reshape(R, -1)  # rows (the engine passes [B, Hkv, D] views)
        y, held = h2o_step(kv[0], kv[1], layer.slot_pos, layer.score, kr, vr, qr, pos, B, layer.h2o_recent,
                           layer.h2o_zero, write=lambda flat, k, v: write_kv(layer.kv_pool, flat, k, v))  # fmt: skip
        layer.length.copy_(held)
        return y, held
