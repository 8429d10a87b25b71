"""``nats::linear_cross_entropy``: lm-head matmul + cross-entropy whose logits gradient is made in the forward.

``linear_cross_entropy(x [M, C], w [V, C], targets [M])`` is ``F.cross_entropy(x @ w.t(), targets)`` (mean
over the rows whose target is not ``ignore_index``). The custom op computes ``logits = x @ w.t()`` and turns
them, in place, into g = softmax - onehot (the Triton kernel on CUDA, ``reference.cross_entropy_rows`` on
other devices), so the [M, V] logits are read once and their gradient written once, in the forward. The
backward only runs the two matmuls ``dx = (g @ w) * c`` and ``dw = (g.t() @ x) * c`` with
c = grad_loss / n_valid: the scalar lands on the small [M, C] and [V, C] results, never on [M, V].

To ``torch.compile`` the op is one opaque node (fake implementation and autograd formula registered). It
takes no part in autocast (it computes in its inputs' dtype): cast x and w to the compute dtype first
(``nats.models.gpt`` does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import cross_entropy_rows


def _check(x: Tensor, w: Tensor, targets: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, C] and w [V, C] with the same C, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
    if targets.dim() != 1 or targets.shape[0] != x.shape[0] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [M] with M = {x.shape[0]}, got {targets.dtype} {tuple(targets.shape)}")


def _no_autocast(x: Tensor):
    """The op computes in its inputs' dtype, also when called inside an autocast region."""
    return torch.autocast(x.device.type, enabled=False)


@torch.library.custom_op("nats::linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(
    x: Tensor, w: Tensor, targets: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss scalar fp32 (fp64 for fp64 inputs), g = softmax - onehot [M, V] in x.dtype, n_valid fp32 scalar)."""
    _check(x, w, targets)
    with _no_autocast(x):
        logits = torch.mm(x, w.t())  # [M, V]
    if logits.is_cuda and logits.dtype != torch.float64:
        from .kernel import cross_entropy_rows_

        row_loss = cross_entropy_rows_(logits, targets, ignore_index)  # logits now hold g
    else:
        row_loss, g = cross_entropy_rows(logits, targets, ignore_index)
        logits.copy_(g)
    n_valid = (targets != ignore_index).sum().to(torch.float32)
    loss = row_loss.sum() / n_valid.clamp(min=1)
    return loss.to(torch.promote_types(x.dtype, torch.float32)), logits, n_valid


@fused_linear_cross_entropy.register_fake
def _(x, w, targets, ignore_index):
    _check(x, w, targets)
    return (
        x.new_empty((), dtype=torch.promote_types(x.dtype, torch.float32)),
        x.new_empty((x.shape[0], w.shape[0])),
        x.new_empty((), dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    x, w, _, _ = inputs
    _, g, n_valid = output
    ctx.save_for_backward(x, w, g, n_valid)
    ctx.mark_non_differentiable(g, n_valid)
    ctx.set_materialize_grads(False)  # no zero [M, V] tangent for g


def _backward(ctx, grad_loss, _grad_g, _grad_n):
    x, w, g, n_valid = ctx.saved_tensors
    c = grad_loss / n_valid.clamp(min=1)
    with _no_autocast(x):
        dx = (g @ w) * c if ctx.needs_input_grad[0] else None  # [M, C]
        dw = (g.t() @ x) * c if ctx.needs_input_grad[1] else None  # [V, C]
    return dx, dw, None, None


fused_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x: Tensor, w: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of the logits x @ w.t() (x [M, C], w [V, C]) against int64 targets [M]."""
    return fused_linear_cross_entropy(x, w, targets, int(ignore_index))[0]


__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy"]
