"""``triton_nats_attention``: the fused NAtS attention as a differentiable function.

Same shapes and semantics as ``reference.nats_attention_reference``: q [B, Hq, N, D], k and v
[B, Hkv, N, D], type_weights [B, Hkv, N, 3] one-hot (g, l, s); returns [B, Hq, N, D] (stored as
[B, N, Hq, D], like torch's SDPA, so that merging the heads afterwards is free). The hard types are the
argmax of the (detached) type weights; the gradient with respect to ``type_weights`` is the exact
(dg, dl, ds) of NATS_SPEC.md section 3, returned as a plain tensor gradient so that a straight-through
estimator upstream passes it on to the scorer logits. ``mask_grad`` chooses the estimator of section 3a
("dense", the default: the causal normaliser; "exact": the masked one).

The kernels are wrapped as two ``torch.library`` custom ops, ``nats::attention_fwd`` and
``nats::attention_bwd``, with fake (meta) implementations and a registered autograd formula. To
``torch.compile`` they are opaque single nodes: a compiled NAtS model has no graph break at the attention
and inductor never tries to trace into the Triton launchers.
"""

import torch
from torch import Tensor

from . import _env
from .backward import nats_backward
from .forward import nats_forward
from .plan import PLAN_ROWS, compact_plan


@torch.library.custom_op("nats::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, type_weights: Tensor, window: int, mask_grad: str = "dense"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o [B,Hq,N,D], lse2 [B,Hq,N] fp32, types int8 [B,Hkv,N], plan int32 [B,Hkv,PLAN_ROWS,N]).

    ``mask_grad`` (spec section 3a) does not change the forward; it is an input so that the backward sees it."""
    types, plan = compact_plan(type_weights, window)
    o, lse = nats_forward(q, k, v, plan, window)
    return o, lse, types, plan


@attention_fwd.register_fake
def _(q, k, v, type_weights, window, mask_grad="dense"):
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    o = q.new_empty((B, N, HQ, D)).transpose(1, 2)
    return (
        o,
        q.new_empty((B, HQ, N), dtype=torch.float32),
        q.new_empty((B, HKV, N), dtype=torch.int8),
        q.new_empty((B, HKV, PLAN_ROWS, N), dtype=torch.int32),
    )


@torch.library.custom_op("nats::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    types: Tensor,
    plan: Tensor,
    window: int,
    mask_grad: str = "dense",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_type_weights fp32 [B,Hkv,N,3]); d_type_weights with the estimator ``mask_grad``."""
    return nats_backward(do, q, k, v, o, lse, types, plan, window, tw_dtype=torch.float32, mask_grad=mask_grad)


@attention_bwd.register_fake
def _(do, q, k, v, o, lse, types, plan, window, mask_grad="dense"):
    B, HKV, N, _ = k.shape
    return _env.grad_like(q), _env.grad_like(k), _env.grad_like(v), q.new_empty((B, HKV, N, 3), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, type_weights, window, mask_grad = inputs
    o, lse, types, plan = output
    ctx.save_for_backward(q, k, v, o, lse, types, plan)
    ctx.window = window
    ctx.mask_grad = mask_grad
    ctx.tw_dtype = type_weights.dtype


def _backward(ctx, do, _dlse, _dtypes, _dplan):
    q, k, v, o, lse, types, plan = ctx.saved_tensors
    dq, dk, dv, dtw = attention_bwd(do, q, k, v, o, lse, types, plan, ctx.window, ctx.mask_grad)
    return dq, dk, dv, dtw.to(ctx.tw_dtype), None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_nats_attention(q, k, v, type_weights, window: int, mask_grad: str = "dense"):
    """Fused NAtS attention (forward and backward in Triton); see the module docstring. ``mask_grad`` picks
    the type-gradient estimator of NATS_SPEC.md section 3a ("dense", the default, or "exact")."""
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if mask_grad not in ("dense", "exact"):
        raise ValueError(f"mask_grad must be 'dense' or 'exact', got {mask_grad!r}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"expected q [B,Hq,N,D], k/v [B,Hkv,N,D] with Hq % Hkv == 0, got {q.shape}, {k.shape}")
    if tuple(type_weights.shape) != (k.shape[0], k.shape[1], k.shape[2], 3):
        raise ValueError(f"type_weights must be [B, Hkv, N, 3], got {tuple(type_weights.shape)}")
    return attention_fwd(q, k, v, type_weights, int(window), mask_grad)[0]


__all__ = ["attention_bwd", "attention_fwd", "triton_nats_attention"]
