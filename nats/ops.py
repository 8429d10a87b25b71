"""Custom ops that keep NAtS' O(N) index scans out of ``torch.compile`` graphs.

The density (sparsity loss) and the KV statistics need, per head, the next and previous global token
of every position: cumulative min/max scans that inductor (torch 2.11) cannot generate code for. Rather
than a graph break per layer, these two ``torch.library`` custom ops run them eagerly as single opaque
nodes of the compiled graph (their fake implementations give the shapes):

* ``nats::density_terms(type_weights, window) -> (rho [...], coef [..., N, 3], stats [..., 5])``: the
  density of the hard types, its exact gradient with respect to the type weights (NATS_SPEC.md section 4,
  the segment term of the global weight included) and the KV statistics below, sharing one set of scans.
  ``density`` / ``nats.functional.nats_density`` combine rho and coef into a differentiable value:
  ``rho + sum((w - w.detach()) * coef)``, whose value is rho and whose gradient is coef.
* ``nats::kv_stats(types, window) -> [..., 5]``: density (area), peak, and the global / local / sliding
  fractions of integer types (no gradient).

Both are checked against the autograd reference (``reference.nats_density``) in ``tests/test_functional.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from nats_kernels.nats_attention import reference as _ref


def _terms(type_weights: Tensor, window: int):
    cdt = _ref._compute_dtype(type_weights)
    w = type_weights.detach()
    N = w.shape[-2]
    types = _ref.hard_types(w)
    g = types == _ref.TOKEN_GLOBAL
    is_l = types == _ref.TOKEN_LOCAL
    e = _ref.next_global_index(g)
    p = _ref.prev_global_index(g)
    k = torch.arange(N, device=w.device)
    col_g = (N - k).to(cdt).expand(types.shape)  # column counts of key k under each type
    col_l = (e - k + 1).to(cdt)
    col_s = (N - k).clamp(max=window).to(cdt).expand(types.shape)
    l_in = is_l.to(torch.int64).cumsum(-1)
    n_loc = (l_in - is_l.to(torch.int64)) - _ref._gather_prefix(l_in, p)  # locals strictly between p_k and k
    # d rho / d g_k carries the segment term: making k global ends the locals before it at k
    coef = torch.stack([col_g - (n_loc * (e - k)).to(cdt), col_l, col_s], dim=-1)
    area = N * (N + 1) / 2.0
    rho = torch.where(g, col_g, torch.where(is_l, col_l, col_s)).sum(-1) / area
    # KV-cache sizes c_i = globals in [0, i] + locals in (p_i, i] + sliding in [i-W+1, i] (spec section 6)
    s_in = (types == _ref.TOKEN_SLIDING).to(torch.int64).cumsum(-1)
    c = g.to(torch.int64).cumsum(-1) + (n_loc + is_l) + (s_in - _ref._gather_prefix(s_in, (k - window).expand_as(s_in)))
    frac = _ref.type_fractions(types)
    stats = torch.cat([rho.float()[..., None], (c.amax(-1).float() / N)[..., None], frac], dim=-1)
    return rho, coef / area, stats


@torch.library.custom_op("nats::density_terms", mutates_args=())
def density_terms(type_weights: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rho [...], coef [..., N, 3], stats [..., 5]) of type weights [..., N, 3] (see the module docstring)."""
    return _terms(type_weights, window)


@density_terms.register_fake
def _(type_weights, window):
    cdt = _ref._compute_dtype(type_weights)
    return (type_weights.new_empty(type_weights.shape[:-2], dtype=cdt),
            type_weights.new_empty(type_weights.shape, dtype=cdt),
            type_weights.new_empty((*type_weights.shape[:-2], 5), dtype=torch.float32))


def density(type_weights: Tensor, window: int) -> Tensor:
    """Differentiable density [...] of type weights [..., N, 3] (value and gradient of spec section 4)."""
    return density_and_stats(type_weights, window)[0]


def density_and_stats(type_weights: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """(differentiable density [...], KV statistics [..., 5] in the order of KV_STAT_NAMES), in one pass."""
    rho, coef, stats = density_terms(type_weights.detach(), int(window))
    w = type_weights.to(coef.dtype)
    return rho + ((w - w.detach()) * coef).sum((-2, -1)), stats


@torch.library.custom_op("nats::kv_stats", mutates_args=())
def kv_stats(types: Tensor, window: int) -> Tensor:
    N = types.shape[-1]
    sizes = _ref.kv_cache_sizes(types, window).float()  # [..., N]: c_i
    area = sizes.sum(-1) / (N * (N + 1) / 2)
    peak = sizes.amax(-1) / N
    return torch.cat([area[..., None], peak[..., None], _ref.type_fractions(types)], dim=-1)


@kv_stats.register_fake
def _(types, window):
    return types.new_empty((*types.shape[:-1], 5), dtype=torch.float32)


KV_STAT_NAMES = ("density", "peak", "frac_global", "frac_local", "frac_sliding")
