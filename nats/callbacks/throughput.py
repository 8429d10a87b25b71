"""`TokenThroughput`: tokens/s, samples/s and MFU of a fit, timed only where its logs are written
(conf/callbacks/throughput.yaml)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only

from nats.lightning_compat import should_accumulate, should_update_logs


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for (x [B, N], y [B, N]) batches: logs samples/s, tokens/s
    ("items_per_sec") and MFU (from `LitGPT.flops_per_batch` and the device's peak FLOP/s).

    Lightning's monitor synchronises the device after every training batch to time it, which stops the host
    from queueing the next step while the device works. Here, by default (``sync_every_batch=False``),
    training batches are only counted on the host, and the device is synchronised and timed on the steps whose
    logs are written (every ``trainer.log_every_n_steps``), at the start of training and before each validation:
    the rates are exact over those intervals. ``window_size`` then counts these timing points, so the default
    ``window_size: 2`` (conf/callbacks/throughput.yaml) logs the rate over the last logging interval; the first
    interval includes compilation and warm-up. ``sync_every_batch=True`` is Lightning's behaviour (window in
    batches). Validation batches are timed as Lightning does."""

    def __init__(self, sync_every_batch: bool = False, **kwargs: Any):
        super().__init__(batch_size_fn=_batch_size, length_fn=_tokens, **kwargs)
        self.sync_every_batch = sync_every_batch
        self._flops_since = 0.0  # FLOPs of the training batches counted since the last timing point

    def _timing_point(self, trainer) -> None:
        """Synchronise, and add the training counters and the time to the training Throughput."""
        import time

        import torch
        from lightning.pytorch.trainer.states import RunningStage

        stage = RunningStage.TRAINING
        if stage not in self._throughputs or stage not in self._t0s:
            return
        batches = self._throughputs[stage]._batches
        if batches and batches[-1] == self._batches[stage]:
            return  # no batch since the last point (validation right after a logged step): the window must grow
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage],
            flops=self._flops_since if self._module_has_flops else None,
        )
        self._flops_since = 0.0

    def _update(self, trainer, pl_module, batch, iter_num) -> None:
        from lightning.pytorch.trainer.states import RunningStage

        stage = trainer.state.stage
        if self.sync_every_batch or stage != RunningStage.TRAINING:
            return super()._update(trainer, pl_module, batch, iter_num)
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
        if self._module_has_flops:
            self._flops_since += pl_module.flops_per_batch
        self._lengths[stage] += _tokens(batch)
        self._samples[stage] += _batch_size(batch)
        self._batches[stage] += 1
        # a timing point exactly where Lightning's `_compute` writes the rates (the end of a logged optimizer step)
        if not should_accumulate(trainer) and should_update_logs(trainer):
            self._timing_point(trainer)

    @rank_zero_only
    def on_train_start(self, trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        if not self.sync_every_batch:
            self._flops_since = 0.0
            self._module_has_flops = None
            self._timing_point(trainer)  # time 0: the first logged rate is over the steps before it

    @rank_zero_only
    def on_validation_start(self, trainer, *args: Any) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        # the last training timing point must be where training paused: `on_validation_end` moves the training
        # clock by the time from it to the end of validation
        if not self.sync_every_batch and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._timing_point(trainer)
        super().on_validation_start(trainer, *args)
