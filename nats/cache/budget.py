"""The budget of a budgeted KV-cache policy, written once: a whole number of tokens >= 1 (the KV entries each layer
and KV head keeps), or a fraction in (0, 1) of a sequence's tokens (rounded, at least 1). `nats-eval` (a fraction of
the evaluation window N), `nats-generate` (of prompt + new tokens) and `nats.hf.StaticPolicyCache` (of each row's
prompt) resolve it here; bad values fail with one message naming both forms."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_budget_value", "resolve_budget", "row_budgets"]


def check_budget_value(budget: Any, of: str = "the sequence's tokens") -> None:
    """Raise a ValueError naming both accepted forms unless `budget` is None, a whole number >= 1 or a fraction in
    (0, 1); `of` says what a fraction is taken of."""
    if budget is None:
        return
    ok = not isinstance(budget, bool) and isinstance(budget, (int, float))
    if ok and isinstance(budget, float) and 0 < budget < 1:
        return
    if ok and budget >= 1 and float(budget) == int(budget):
        return
    raise ValueError(
        f"budget={budget!r} must be a whole number of tokens >= 1 (the KV entries each layer and KV head keeps) or "
        f"a fraction in (0, 1) of {of}"
    )


def resolve_budget(budget: Any, total: int, of: str | None = None) -> int | None:
    """None, or the budget in tokens for a sequence of `total` tokens (a fraction of `total`, rounded, at least 1)."""
    check_budget_value(budget, of or f"the {total} tokens")
    if budget is None:
        return None
    if isinstance(budget, float) and budget < 1:
        return max(1, round(budget * total))
    return int(budget)


def row_budgets(budget: Any, lengths: Tensor) -> Tensor:
    """The budget in tokens of each sequence of `lengths` (LongTensor ``[B]``); a fraction is of each one's length
    (rounded half to even as `round`, at least 1)."""
    check_budget_value(budget, "each sequence's prompt")
    if isinstance(budget, float) and budget < 1:
        return (lengths.to(torch.float64) * budget).round().clamp(min=1).long()
    return torch.full_like(lengths, int(budget))
