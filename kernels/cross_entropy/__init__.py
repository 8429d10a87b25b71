"""Fused linear + cross-entropy (Triton) beside its PyTorch reference (``reference.py``).

- ``linear_cross_entropy(x, w, targets, ignore_index=-100)``: ``F.cross_entropy(x @ w.t(), targets)`` with
  the gradient of the logits made in the forward, in place of the logits (``op.py``, the custom op
  ``nats::linear_cross_entropy``): the [M, V] logits are read once and their gradient written once.
- ``kernel.cross_entropy_rows_(logits, targets)``: the Triton kernel behind it on CUDA (per-row loss, and
  softmax - onehot written over the logits).

Importing this package needs no Triton: ``op.py`` imports the kernel on its first CUDA call; on other devices
the op runs the same math in PyTorch. Without a CUDA GPU the kernel itself runs in Triton's CPU interpreter.
"""

from .op import fused_linear_cross_entropy, linear_cross_entropy
from .reference import cross_entropy_reference, cross_entropy_rows

__all__ = ["cross_entropy_reference", "cross_entropy_rows", "fused_linear_cross_entropy", "linear_cross_entropy"]
