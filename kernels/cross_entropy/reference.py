"""Plain PyTorch definition of the cross-entropy that ``kernel.py`` and ``op.py`` fuse.

For logits l [M, V], targets t [M] and the valid rows R = {i : t_i != ignore_index}, n = |R|:

    loss = (1 / n) * sum_{i in R} (logsumexp(l_i) - l_i[t_i])          (0 when n = 0)
    d loss / d l_i = (softmax(l_i) - onehot(t_i)) / n   for i in R,   0 for ignored rows

computed in fp32 (fp64 for fp64 logits).
"""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy_rows(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """(row_loss [M], g [M, V]): per-row loss and the gradient not yet divided by n, both 0 on ignored rows.

    Computed in fp32 for bf16 / fp16 / fp32 logits, fp64 for fp64."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(acc)  # [M, V]
    valid = targets != ignore_index  # [M]
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(z, dim=1)  # [M]
    picked = z.gather(1, safe[:, None]).squeeze(1)  # [M]
    onehot = torch.zeros_like(z).scatter_(1, safe[:, None], 1.0)  # [M, V]
    g = (torch.exp(z - lse[:, None]) - onehot) * valid[:, None]
    return (lse - picked) * valid, g


def cross_entropy_reference(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """(mean loss, d loss / d logits [M, V]) as in the module docstring."""
    row_loss, g = cross_entropy_rows(logits, targets, ignore_index)
    n = (targets != ignore_index).sum().clamp(min=1)
    return row_loss.sum() / n, g / n
