"""Inference prefill with hard integer types: NAtS attention whose cost follows the kept entries, not N^2.

It is the training forward kernel (``forward.py``: keys walked in the compact order of ``plan.py``, so a
few global tokens in every block do not make the whole causal triangle live) without the log-sum-exp
output and without autograd.
"""

import torch

from ._env import clamp_window
from .forward import check_head_dim, nats_forward
from .plan import compact_plan


def nats_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor, window: int, sm_scale: float | None = None
) -> torch.Tensor:
    """NAtS attention output [B,Hq,N,D] for hard integer types [B,Hkv,N] (no gradient)."""
    _check(q, k, v, types, "types [B,Hkv,N]", 3)
    if types.is_floating_point():
        raise ValueError(
            "nats_prefill takes integer types (0 global, 1 local, 2 sliding); "
            "use triton_nats_attention for type weights"
        )
    return _attend(q, k, v, types, window, sm_scale)[0]


def nats_prefill_scored(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor,
    window: int,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NAtS attention output [B,Hq,N,D] and the types (int8 [B,Hkv,N]) of a scorer's logits: ``logits``
    [B,Hkv,N,3] (the Linear's output in the model's dtype, any strides: a view of [B, N, Hkv * 3]) and the
    offsets ``bias`` [3] (any float dtype, added in float32), the types being ``NAtSAttention.hard_types``'
    (argmax of the float32 logits plus ``bias``, token 0 global). The plan kernel takes the argmax itself: at
    batch 1 the prefill is bound by its launches, and the scorer's own float / add / argmax / token-0 operations
    were four more per layer."""
    _check(q, k, v, logits, "logits [B,Hkv,N,3]", 4)
    return _attend(q, k, v, logits, window, sm_scale, bias)


def _check(q, k, v, type_info, what: str, dims: int) -> None:
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    want = (B, HKV, N, 3)[:dims]
    if HQ % HKV != 0 or k.shape != v.shape or tuple(type_info.shape) != want:
        raise ValueError(
            f"expected q [B,Hq,N,D], k/v [B,Hkv,N,D], {what}; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(type_info.shape)}"
        )
    check_head_dim(D)


def _attend(q, k, v, type_info, window, sm_scale, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, int8 types) through the plan (``compact_plan``, with ``bias`` from a scorer's logits) and the
    forward kernel without its log-sum-exp."""
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    W = clamp_window(window, q.shape[2])
    types, plan = compact_plan(type_info, W, bias=bias)
    with torch.no_grad():
        o, _ = nats_forward(q, k, v, plan, W, sm_scale, store_lse=False)
    return o, types
