"""Schedules of an attention core's attribute over the optimizer steps: `TemperatureSchedule` (NAtS' Gumbel-softmax
temperature, conf/callbacks/tau_schedule.yaml), `NoiseSchedule` (the scale of NAtS' Gumbel noise,
conf/callbacks/noise_schedule.yaml) and `CompressionSchedule` (the compression ratio DMS' loss asks for,
conf/callbacks/dms_schedule.yaml)."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback


class _CoreSchedule(Callback):
    """Set an attribute of every core of one kind (``core``: `nats.attention.nats.NAtSAttention` by default, found by
    type; other cores lack it) to ``value_at(trainer.global_step)`` before each training batch, where it differs (so
    once per optimizer step: the micro-batches of one step share it; the core's setter fills a buffer in place, so a
    compiled model does not recompile), and log it as ``nats/<attr>`` on the steps whose logs are written, as a CPU
    tensor (``nats.step_logging.host_scalar``: a Python float logged would be a blocking host-to-device copy). The value
    is a function of the step alone, so a resumed run continues the schedule where it stopped."""

    attr = ""
    core = "nats"  # the attention cores it sets (the registered name; the others lack the attribute)

    def value_at(self, step: int) -> float:
        raise NotImplementedError

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from nats.attention.registry import ATTENTIONS
        from nats.step_logging import host_scalar, logs_written_now

        value = self.value_at(trainer.global_step)
        if getattr(self, "_cores_of", None) is not pl_module:  # the cores are found once per module
            cls = ATTENTIONS.get(self.core)
            self._cores = [m for m in pl_module.modules() if isinstance(m, cls)]
            self._cores_of = pl_module
        for module in self._cores:
            if getattr(module, self.attr) != value:
                setattr(module, self.attr, value)
        if logs_written_now(trainer):
            pl_module.log(f"nats/{self.attr}", host_scalar(value))  # a float would sync the device


class _LinearSchedule(_CoreSchedule):
    """A value going linearly from `start` to `end` over `steps` optimizer steps, then `end`; both at least
    ``lowest``."""

    lowest = 0.0

    def __init__(self, start: float, end: float, steps: int):
        super().__init__()
        if not (start >= self.lowest and end >= self.lowest) or steps < 1:
            name, low = type(self).__name__, self.lowest
            raise ValueError(f"{name} needs start, end >= {low:g} and steps >= 1 (got {start}, {end}, {steps})")
        self.start, self.end, self.steps = float(start), float(end), int(steps)

    def value_at(self, step: int) -> float:
        frac = min(step, self.steps) / self.steps
        return self.start + (self.end - self.start) * frac


class TemperatureSchedule(_CoreSchedule):
    """Anneal the Gumbel-softmax temperature of every NAtS core: exponentially from `start` to `end` over
    `steps` optimizer steps, then constant (`end`). Logged as ``nats/tau``."""

    attr = "tau"

    def __init__(self, start: float = 1.0, end: float = 0.5, steps: int = 10000):
        super().__init__()
        if start <= 0 or end <= 0 or steps < 1:
            raise ValueError(f"TemperatureSchedule needs start, end > 0 and steps >= 1 (got {start}, {end}, {steps})")
        self.start, self.end, self.steps = start, end, steps

    def value_at(self, step: int) -> float:
        frac = min(step, self.steps) / self.steps
        return self.start * (self.end / self.start) ** frac


class NoiseSchedule(_LinearSchedule):
    """Scale the Gumbel noise of every NAtS core's training types, argmax(z + s G) (``noise_scale``; the spec's
    sampling is s = 1): linearly from `start` to `end` over `steps` optimizer steps, then constant (`end`).
    Logged as ``nats/noise_scale``.

    With ``end = 0`` the last steps train on the argmax types that inference uses (straight-through gradient
    through softmax(z / tau)), so the loss and the density penalty see the inference cache. Why: with the noise
    on, the sampled types can be much sparser than the argmax ones (docs/hf_finetune.md, "sampled against
    argmax"), and the penalty then shrinks a cache that inference never keeps. An option outside NATS_SPEC.md
    section 1 (which samples with s = 1); off unless this callback is added."""

    attr = "noise_scale"
    lowest = 0.0

    def __init__(self, start: float = 1.0, end: float = 0.0, steps: int = 1000):
        super().__init__(start, end, steps)


class CompressionSchedule(_LinearSchedule):
    """Anneal the compression ratio that every DMS core's auxiliary loss asks for (`nats.attention.dms`,
    ``target_cr``): linearly from `start` (1: no eviction asked) to `end` over `steps` optimizer steps, then `end`,
    as DMS' retrofitting does. Logged as ``nats/target_cr``."""

    attr = "target_cr"
    core = "dms"
    lowest = 1.0

    def __init__(self, start: float = 1.0, end: float = 4.0, steps: int = 1000):
        super().__init__(start, end, steps)
