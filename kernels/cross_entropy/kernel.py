"""Triton kernel: per-row cross-entropy loss and, in place of the logits, their unscaled gradient.

One program per row of logits [M, V] walks the row twice in chunks of BLOCK_V columns:

1. online max m and sum s of exp(l - m) (fp32, by exp2) -> lse = m + log(s) and the loss lse - l[target];
2. re-reads the row (from L2: a 50304-column bf16 row is 100 KB) and overwrites it with
   g = exp(l - lse) - [col == target], in the logits' dtype.

Rows whose target is ``ignore_index`` get loss 0 and g = 0. A target outside [0, V) is not checked (no host
sync): its loss then misses the picked logit. Without a CUDA GPU the kernel runs in Triton's CPU
interpreter (small shapes only: tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

# one place chooses Triton's CPU interpreter when there is no GPU (before any @triton.jit runs)
from nats_kernels.nats_attention._env import INTERPRET, tl, triton

BLOCK_V = 256 if INTERPRET else 4096  # columns per chunk (a power of two)
NUM_WARPS = 8  # H200, 32768 x 50304 bf16: 2.3 ms (a copy takes 1.56); 4096-16384 x 4-16 warps within 5%

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, targets_ptr, loss_ptr, V, stride_row, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row  # int64 offset: M * V exceeds 2**31
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)

    # pass 1: running max m of the logits x and sum s of exp(x - m), in fp32 (exp(y) = 2^(y * log2(e)))
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        c = start + cols
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), axis=0)
        m = m_new
    log2s = tl.log2(s)  # lse = m + log(s)
    picked = tl.load(base + target, mask=valid & (target >= 0) & (target < V), other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, m + log2s * LN2 - picked, 0.0))

    # pass 2: overwrite the row with softmax - onehot; exp(x - lse) = 2^((x - m) * log2(e) - log2(s))
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        x = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp2((x - m) * LOG2E - log2s) - tl.where(c == target, 1.0, 0.0)
        g = tl.where(valid, g, 0.0)
        tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(
    logits: Tensor, targets: Tensor, ignore_index: int = -100, *, block_v: int | None = None, out: Tensor | None = None
) -> Tensor:
    """Overwrite logits [M, V] (unit column stride) with g = softmax - onehot (0 on ignored rows), in their
    dtype; return the per-row losses, fp32 [M] (written into ``out`` if given)."""
    M, V = logits.shape
    if logits.stride(1) != 1 or targets.shape != (M,):
        raise ValueError(
            f"expected logits [M, V] with unit column stride and targets [M], got "
            f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(targets.shape)}"
        )
    if out is None:
        out = torch.empty(M, dtype=torch.float32, device=logits.device)
    if M == 0:
        return out
    block = block_v or min(BLOCK_V, triton.next_power_of_2(V))
    _cross_entropy_rows_kernel[(M,)](
        logits, targets, out, V, logits.stride(0), ignore_index, BLOCK_V=block, num_warps=NUM_WARPS
    )
    return out
