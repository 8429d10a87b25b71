"""Callbacks that the SLURM tests add to jobs on the local cluster (``+callbacks.<name>._target_=...``; the jobs
import this module through ``PYTHONPATH``)."""

from __future__ import annotations

import os
import time

from lightning.pytorch.callbacks import Callback

from nats.lightning_compat import set_received_sigterm


class SlowSteps(Callback):
    """Sleeps ``seconds`` after every optimizer step: a run of a tiny model that lasts long enough to be signalled,
    requeued or timed out, without using the CPU (the arithmetic, and so the metrics, are unchanged). With
    ``first_attempt_only``, a requeued job (``SLURM_RESTART_COUNT`` > 0) runs at full speed."""

    def __init__(self, seconds: float, first_attempt_only: bool = False):
        restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
        self.seconds = 0.0 if first_attempt_only and restarted else seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.seconds:
            time.sleep(self.seconds)


class SigtermAt(Callback):
    """Raises the SIGTERM flag at the end of optimizer step ``step`` (once), as the signal would: the run stops
    there with its state saved (nats.callbacks.InterruptCheckpoint)."""

    def __init__(self, step: int):
        self.step, self.sent = int(step), False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.sent and trainer.global_step == self.step:
            self.sent = True
            set_received_sigterm(trainer)
