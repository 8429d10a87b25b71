"""Callbacks named by `conf/callbacks/`."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback, ThroughputMonitor


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for (x [B, N], y [B, N]) batches: logs samples/s, tokens/s
    ("items_per_sec") and MFU (from `LitGPT.flops_per_batch` and the device's peak FLOP/s)."""

    def __init__(self, **kwargs: Any):
        super().__init__(batch_size_fn=_batch_size, length_fn=_tokens, **kwargs)


class TemperatureSchedule(Callback):
    """Anneal the Gumbel-softmax temperature of every NAtS core: exponentially from `start` to `end`
    over `steps` optimizer steps, then constant (`end`)."""

    def __init__(self, start: float = 1.0, end: float = 0.5, steps: int = 10000):
        super().__init__()
        if start <= 0 or end <= 0 or steps < 1:
            raise ValueError(f"TemperatureSchedule needs start, end > 0 and steps >= 1 (got {start}, {end}, {steps})")
        self.start, self.end, self.steps = start, end, steps

    def tau_at(self, step: int) -> float:
        frac = min(step, self.steps) / self.steps
        return self.start * (self.end / self.start) ** frac

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        tau = self.tau_at(trainer.global_step)
        for module in pl_module.modules():
            if hasattr(module, "tau") and hasattr(module, "scorer"):
                module.tau = tau
        pl_module.log("nats/tau", tau)
