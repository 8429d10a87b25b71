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
    """On CUDA one Triton program per row (``nats_kernels.nats_attention.density``); elsewhere, and for fp64 or
    rows longer than the kernel's limit, its PyTorch reference (``reference.density_terms_reference``)."""
    if type_weights.is_cuda:
        kernel = _density_kernel()
        if kernel is not None and kernel.supported(type_weights):
            return kernel.density_terms(type_weights, window)
    return _ref.density_terms_reference(type_weights, window)


_KERNEL: list = []


def _density_kernel():
    """The Triton density module, or None when Triton cannot be imported (cached)."""
    if not _KERNEL:
        try:
            from nats_kernels.nats_attention import density as kernel
        except Exception:  # noqa: BLE001 - no (working) triton: the reference
            kernel = None
        _KERNEL.append(kernel)
    return _KERNEL[0]


@torch.library.custom_op("nats::density_terms", mutates_args=())
def density_terms(type_weights: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rho [...], coef [..., N, 3], stats [..., 5]) of type weights [..., N, 3] (see the module docstring)."""
    return _terms(type_weights, window)


@density_terms.register_fake
def _(type_weights, window):
    cdt = _ref._compute_dtype(type_weights)
    return (
        type_weights.new_empty(type_weights.shape[:-2], dtype=cdt),
        type_weights.new_empty(type_weights.shape, dtype=cdt),
        type_weights.new_empty((*type_weights.shape[:-2], 5), dtype=torch.float32),
    )


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
