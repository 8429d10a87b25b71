"""O(N) per-key index tensors that the kernels read instead of an N x N mask.

For hard types t_j in {0 global, 1 local, 2 sliding} of shape [..., N]:
- ``next_global(t)[j]`` = e_j, the first global index > j (N - 1 if there is none);
- ``prev_global(t)[j]`` = p_j, the last global index < j (-1 if there is none).
A local j is visible to queries j..e_j, a sliding j to queries j..j+W-1, a global j to all i >= j.
"""

import torch

TOKEN_GLOBAL, TOKEN_LOCAL, TOKEN_SLIDING = 0, 1, 2


def hard_types(type_weights: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis (g, l, s) of ``type_weights`` [..., N, 3], as contiguous int8 [..., N]."""
    return type_weights.detach().argmax(dim=-1).to(torch.int8).contiguous()


def next_global(types: torch.Tensor) -> torch.Tensor:
    n = types.shape[-1]
    pos = torch.arange(n, device=types.device, dtype=torch.int32).expand_as(types)
    idx = torch.where(types == TOKEN_GLOBAL, pos, torch.full_like(pos, n - 1))
    # e_j = min over k > j of idx_k: a reversed cumulative minimum, shifted by one.
    rev_min = torch.flip(torch.cummin(torch.flip(idx, [-1]), dim=-1).values, [-1])
    e = torch.cat([rev_min[..., 1:], torch.full_like(rev_min[..., :1], n - 1)], dim=-1)
    return e.to(torch.int32).contiguous()


def prev_global(types: torch.Tensor) -> torch.Tensor:
    n = types.shape[-1]
    pos = torch.arange(n, device=types.device, dtype=torch.int32).expand_as(types)
    idx = torch.where(types == TOKEN_GLOBAL, pos, torch.full_like(pos, -1))
    run_max = torch.cummax(idx, dim=-1).values
    p = torch.cat([torch.full_like(run_max[..., :1], -1), run_max[..., :-1]], dim=-1)
    return p.to(torch.int32).contiguous()


def compact_order(types: torch.Tensor, window: int):
    """PyTorch version of the compact part of ``plan.compact_plan`` (for tests).

    Returns ``order`` [..., N] (positions: globals, then locals, then sliding tokens, each by position),
    ``lim`` [..., N] (the last query that sees each compact entry: N-1, e_j or min(j+W-1, N-1)) and
    ``cum`` [..., 3, N] (inclusive counts of each type at positions <= j), all int32.
    """
    t = types.long()
    n = t.shape[-1]
    pos = torch.arange(n, device=t.device)
    onehot = t[..., None, :] == torch.arange(3, device=t.device)[:, None]  # [..., 3, N]
    cum = onehot.long().cumsum(-1)
    tot = cum[..., -1]  # [..., 3]
    base = torch.stack([torch.zeros_like(tot[..., 0]), tot[..., 0], tot[..., 0] + tot[..., 1]], dim=-1)
    dest = base.gather(-1, t) + cum.gather(-2, t[..., None, :]).squeeze(-2) - 1
    order = torch.empty_like(t).scatter_(-1, dest, pos.expand_as(t).contiguous())
    e = next_global(types).long()
    lim = torch.where(t == TOKEN_GLOBAL, n - 1, torch.where(t == TOKEN_LOCAL, e, (pos + window - 1).clamp(max=n - 1)))
    return order.int(), lim.gather(-1, order).int(), cum.int()
