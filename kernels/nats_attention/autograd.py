"""``triton_nats_attention``: the fused NAtS attention as a differentiable function.

Same shapes and semantics as ``reference.nats_attention_reference``: q [B, Hq, N, D], k and v
[B, Hkv, N, D], type_weights [B, Hkv, N, 3] one-hot (g, l, s); returns [B, Hq, N, D]. The hard types
are the argmax of the (detached) type weights; the gradient with respect to ``type_weights`` is the
exact (dg, dl, ds) of NATS_SPEC.md section 3, returned as a plain tensor gradient so that a
straight-through estimator upstream passes it on to the scorer logits.
"""

import torch

from .backward import nats_backward
from .forward import nats_forward
from .plan import type_indices


class NatsAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, type_weights, window):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        types, e, _ = type_indices(type_weights)
        o, lse = nats_forward(q, k, v, types, e, window)
        ctx.save_for_backward(q, k, v, o, lse, types, e)
        ctx.window = window
        ctx.tw_dtype = type_weights.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, types, e = ctx.saved_tensors
        dq, dk, dv, dtw = nats_backward(do.contiguous(), q, k, v, o, lse, types, e, ctx.window,
                                        tw_dtype=ctx.tw_dtype)
        return dq, dk, dv, dtw, None


def triton_nats_attention(q, k, v, type_weights, window: int):
    """Fused NAtS attention (forward and backward in Triton); see the module docstring."""
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"expected q [B,Hq,N,D], k/v [B,Hkv,N,D] with Hq % Hkv == 0, got {q.shape}, {k.shape}")
    if tuple(type_weights.shape) != (k.shape[0], k.shape[1], k.shape[2], 3):
        raise ValueError(f"type_weights must be [B, Hkv, N, 3], got {tuple(type_weights.shape)}")
    return NatsAttentionFunction.apply(q, k, v, type_weights, int(window))
