"""What a training step logs without synchronising the device (the LightningModules of `nats.lit` and
`nats.finetune.lit`, the callbacks): whether Lightning writes this step's logs (`logs_written_now`), a Python number
to log (`host_scalar`), and statistics copied to the host without blocking and written once there
(`StagedMetrics`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nats.lightning_compat import should_update_logs

__all__ = ["StagedMetrics", "host_scalar", "logs_written_now"]


def logs_written_now(trainer) -> bool:
    """Whether Lightning writes this optimizer step's logs (trainer.log_every_n_steps, fast_dev_run, a stopping
    trainer): the test of its own LearningRateMonitor and ThroughputMonitor. The same answer in every hook of a
    training batch (on_train_batch_start, training_step, on_before_optimizer_step, on_train_batch_end) and for
    every micro-batch of an accumulated optimizer step. No trainer (a bare module): False."""
    if trainer is None:
        return False
    if trainer.fast_dev_run:
        return True
    return should_update_logs(trainer)


def host_scalar(value: float) -> torch.Tensor:
    """A Python number for ``self.log`` without a device synchronisation. Lightning turns a float into a
    tensor on the module's device: a blocking host-to-device copy from pageable memory, which waits for every
    kernel queued before it, so the GPU then idles while the host queues the next work. A CPU tensor stays on the
    CPU (Lightning's metric follows its value's device) and is written as it is; float64, so that the number
    written is the float itself."""
    return torch.tensor(float(value), dtype=torch.float64)


class StagedMetrics:
    """Scalars on their way to the loggers without a device synchronisation: `stage` starts their copy into pinned
    host memory (non-blocking, an event recorded after it), `write` hands those whose copy has completed to the
    loggers at the step they were staged for (all of them, waiting, with ``wait``: at the end of training). Staging
    the same step again replaces it (Lightning writes a step's last value too)."""

    def __init__(self):
        self._staged: list[tuple] = []  # (step, names, host values, copy event or None)

    def stage(self, step: int, stats: Mapping[str, torch.Tensor]) -> None:
        values = torch.stack([v.detach().float().reshape(()) for v in stats.values()])
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._staged = [e for e in self._staged if e[0] != step] + [(step, list(stats), values, event)]

    def write(self, loggers, wait: bool = False) -> None:
        keep = []
        for step, names, values, event in self._staged:
            if event is not None and not event.query():
                if not wait:
                    keep.append((step, names, values, event))
                    continue
                event.synchronize()
            metrics = dict(zip(names, values.tolist()))
            for logger in loggers:
                logger.log_metrics(metrics, step=step)
        self._staged = keep

    def __len__(self) -> int:
        return len(self._staged)
