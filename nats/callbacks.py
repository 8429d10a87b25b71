"""Callbacks named by `conf/callbacks/`."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for (x [B, N], y [B, N]) batches: logs samples/s, tokens/s
    ("items_per_sec") and MFU (from `LitGPT.flops_per_batch` and the device's peak FLOP/s)."""

    def __init__(self, **kwargs: Any):
        super().__init__(batch_size_fn=_batch_size, length_fn=_tokens, **kwargs)
