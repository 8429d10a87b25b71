"""Callbacks named by `conf/callbacks/`, one concern a module; the configs name them here (``nats.callbacks.X``), as
saved run configs do."""

from nats.callbacks.eval_after import CHECKPOINTS, EvalAfterTraining
from nats.callbacks.interrupt_checkpoint import InterruptCheckpoint
from nats.callbacks.last_checkpoint import LastCheckpoint
from nats.callbacks.progress_bar import StepProgressBar
from nats.callbacks.schedules import CompressionSchedule, NoiseSchedule, TemperatureSchedule
from nats.callbacks.step_timer import StepTimer
from nats.callbacks.throughput import TokenThroughput

__all__ = [
    "CHECKPOINTS",
    "CompressionSchedule",
    "EvalAfterTraining",
    "InterruptCheckpoint",
    "LastCheckpoint",
    "NoiseSchedule",
    "StepProgressBar",
    "StepTimer",
    "TemperatureSchedule",
    "TokenThroughput",
]
