"""`dense`: ordinary softmax attention through torch SDPA (FlashAttention on GPUs)."""

from __future__ import annotations

import torch.nn.functional as F

from nats.attention.registry import AttentionCore, AttentionDims, AttentionOutput, register_attention


@register_attention("dense")
class DenseAttention(AttentionCore):
    """Causal (or bidirectional) softmax attention. Which SDPA kernel runs is torch's choice; to prefer one
    (e.g. cuDNN attention on Hopper), use `torch.nn.attention.sdpa_kernel` around training or
    `benchmarks/bench_train.py --sdpa cudnn` to measure it."""

    decode_policy = "full"  # every key kept: the full KV cache reproduces it

    def __init__(self, dims: AttentionDims):
        super().__init__(dims)

    def forward(self, q, k, v, x) -> AttentionOutput:
        # q: [B, Hq, N, D], k/v: [B, Hkv, N, D] -> y: [B, Hq, N, D]
        gqa = q.shape[1] != k.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.dims.causal, enable_gqa=gqa)
        return AttentionOutput(y)
