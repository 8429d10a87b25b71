"""Callbacks named by `conf/callbacks/`."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ThroughputMonitor, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

from nats.lightning_compat import (
    batches_that_stepped_shifted,
    received_sigterm,
    set_received_sigterm,
    should_accumulate,
    should_update_logs,
)

log = logging.getLogger(__name__)


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


class _CoreSchedule(Callback):
    """Set an attribute of every NAtS core (`nats.attention.nats.NAtSAttention`, found by type; other cores lack
    it) to ``value_at(trainer.global_step)`` before each training batch, where it differs (so once per optimizer
    step: the micro-batches of one step share it; the core's setter fills a buffer in place, so a compiled model
    does not recompile), and log it as ``nats/<attr>`` on the steps whose logs are written, as a CPU tensor
    (``nats.lit.host_scalar``: a Python float logged would be a blocking host-to-device copy). The value is a
    function of the step alone, so a resumed run continues the schedule where it stopped."""

    attr = ""

    def value_at(self, step: int) -> float:
        raise NotImplementedError

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from nats.attention.nats import NAtSAttention
        from nats.lit import host_scalar, logs_written_now

        value = self.value_at(trainer.global_step)
        if getattr(self, "_cores_of", None) is not pl_module:  # the cores are found once per module
            self._cores = [m for m in pl_module.modules() if isinstance(m, NAtSAttention)]
            self._cores_of = pl_module
        for module in self._cores:
            if getattr(module, self.attr) != value:
                setattr(module, self.attr, value)
        if logs_written_now(trainer):
            pl_module.log(f"nats/{self.attr}", host_scalar(value))  # a float would sync the device


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


class NoiseSchedule(_CoreSchedule):
    """Scale the Gumbel noise of every NAtS core's training types, argmax(z + s G) (``noise_scale``; the spec's
    sampling is s = 1): linearly from `start` to `end` over `steps` optimizer steps, then constant (`end`).
    Logged as ``nats/noise_scale``.

    With ``end = 0`` the last steps train on the argmax types that inference uses (straight-through gradient
    through softmax(z / tau)), so the loss and the density penalty see the inference cache. Why: with the noise
    on, the sampled types can be much sparser than the argmax ones (docs/hf_finetune.md, "sampled against
    argmax"), and the penalty then shrinks a cache that inference never keeps. An option outside NATS_SPEC.md
    section 1 (which samples with s = 1); off unless this callback is added."""

    attr = "noise_scale"

    def __init__(self, start: float = 1.0, end: float = 0.0, steps: int = 1000):
        super().__init__()
        if not (start >= 0 and end >= 0) or steps < 1:
            raise ValueError(f"NoiseSchedule needs start, end >= 0 and steps >= 1 (got {start}, {end}, {steps})")
        self.start, self.end, self.steps = float(start), float(end), int(steps)

    def value_at(self, step: int) -> float:
        frac = min(step, self.steps) / self.steps
        return self.start + (self.end - self.start) * frac


class StepTimer(Callback):
    """Host wall-clock times of a fit, written as JSON to ``path`` (default: ``<trainer.default_root_dir>/
    step_times.json``, the run folder) when the fit ends (conf/callbacks/step_timer.yaml).

    Recorded, in seconds since ``on_fit_start`` (``fit_start_unix`` is its ``time.time()``): ``train_start``, the
    end of every optimizer step (``step_end``, one entry per ``trainer.global_step`` reached, with ``steps``
    the global steps), each validation during the fit (``val`` as [start, end] pairs) and ``train_end``. The
    device is synchronised only at ``train_end`` (and at every recorded point with ``sync=True``), so a step's
    entry is when the host finished queueing it: differences over many steps, ended at ``train_end``, are the
    device's rate; the first entry (minus ``train_start``) is dominated by compilation."""

    def __init__(self, path: str | None = None, sync: bool = False):
        super().__init__()
        self.path, self.sync = path, sync
        self.record: dict[str, Any] = {}

    def _now(self, trainer) -> float:
        import time

        if self.sync and trainer.strategy.root_device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        return time.perf_counter() - self._t0

    def on_fit_start(self, trainer, pl_module) -> None:
        import time

        self._t0 = time.perf_counter()
        self.record = {
            "fit_start_unix": time.time(),
            "train_start": None,
            "steps": [],
            "step_end": [],
            "val": [],
            "train_end": None,
            "sync": self.sync,
        }

    def on_train_start(self, trainer, pl_module) -> None:
        self.record["train_start"] = self._now(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        steps = self.record["steps"]
        if not steps or trainer.global_step != steps[-1]:  # an optimizer step was taken
            self.record["step_end"].append(self._now(trainer))
            steps.append(trainer.global_step)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.record:
            self.record["val"].append([self._now(trainer), None])

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.record and self.record["val"]:
            self.record["val"][-1][1] = self._now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.record["train_end"] = self._now(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        import json
        from pathlib import Path

        if not trainer.is_global_zero or not self.record:
            return
        path = Path(self.path) if self.path else Path(trainer.default_root_dir) / "step_times.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=1) + "\n")


class StepProgressBar(TQDMProgressBar):
    """The one progress bar of a fit: Lightning's TQDM bar counting optimizer steps (``trainer.global_step``) out
    of ``trainer.max_steps`` instead of micro-batches (with gradient accumulation the stock bar shows ``600/?``
    when ``max_steps=300`` is reached), with the time left, steps/s and tokens/s. A resumed run starts the bar
    at its step, so the total stays true and the rate and the time left count only the steps this process ran.
    ``refresh_rate`` is in optimizer steps. Validation draws no bar of its own: the bar says ``validating`` while
    it runs, and each validation of the fit prints one line (``step N: val_loss ..., val_ppl ...``), also into
    the run's log.

    The training loss and the learning rate are read here (``train/loss`` from the callback metrics, the lr from
    the optimizer), rather than logged with ``prog_bar=True``: Lightning converts every progress-bar metric to a
    Python number after every batch, a host-device synchronisation per micro-batch that stalls the GPU pipeline.
    They are read only on the optimizer steps whose logs are written (and the last step), where the
    device is synchronised anyway (the throughput monitor, Lightning's loggers): reading the loss is a
    synchronisation too, which at another step (refresh_rate 10, log_every_n_steps 25) would drain the GPU's
    queue once more. Between them the bar shows the last values read."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._step_tokens = 0  # tokens per optimizer step (all micro-batches and processes)

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        bar.unit = "step"
        bar.set_description("train", refresh=False)
        return bar

    def init_validation_tqdm(self):
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        return Tqdm(disable=True)  # no second bar; see the class docstring

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        for key in [k for k in metrics if k == "v_num" or k.startswith("val/")]:
            metrics.pop(key)  # validation results get a line of their own (on_validation_end)
        if trainer.training:
            loss = trainer.callback_metrics.get("train/loss")
            if loss is not None:
                metrics["train/loss"] = f"{float(loss):.3f}"
            if trainer.optimizers:
                metrics["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.3g}"
        bar = self._train_progress_bar
        elapsed = bar.format_dict.get("elapsed") if bar is not None and not bar.disable else None
        if elapsed and self._step_tokens and trainer.training:  # this process's steps (bar.n may lag behind)
            steps = trainer.global_step - bar.initial
            if steps > 0:
                metrics["tok/s"] = _si(steps * self._step_tokens / elapsed)
        return metrics

    def on_train_start(self, trainer, *_: Any) -> None:
        super().on_train_start(trainer, *_)
        self._start_bar(trainer)  # a run resumed in mid-epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        if self._leave:  # a bar per epoch (leave=True); else the one bar goes on (the stock bar's reset: _start_bar)
            self.train_progress_bar = self.init_train_tqdm()
        self._start_bar(trainer)

    def _start_bar(self, trainer) -> None:
        """The bar at the run's step out of the true total: rate and time left count this process's steps."""
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if max_steps is None:  # no step limit: the steps of this epoch
            batches = self.total_train_batches
            max_steps = (
                None
                if math.isinf(batches)
                else trainer.global_step + math.ceil(batches / max(1, trainer.accumulate_grad_batches))
            )
        bar.reset(total=max_steps)
        bar.initial = bar.n = trainer.global_step
        bar.set_description("train" if trainer.current_epoch == 0 else f"train (epoch {trainer.current_epoch})", False)
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        from nats.lit import logs_written_now

        if not self._step_tokens:
            tokens = batch[0].numel() if isinstance(batch, (list, tuple)) and hasattr(batch[0], "numel") else 0
            self._step_tokens = tokens * max(1, trainer.accumulate_grad_batches) * max(1, trainer.world_size)
        step = trainer.global_step
        if step != bar.n and (logs_written_now(trainer) or step == bar.total):
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        if step != bar.n and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.refresh()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """An interrupt or error closes the bar (its line cleared) before nats-train says why the run stopped, so
        no stale frame is drawn again after that line."""
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.leave = False
            bar.close()

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        bar = self._train_progress_bar
        if bar is not None and not bar.disable and trainer.state.fn == "fit" and not trainer.sanity_checking:
            bar.set_postfix_str("validating", refresh=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn != "fit" or trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        parts = [f"{name.replace('/', '_')} {float(metrics[name]):{fmt}}" for name, fmt in (("val/loss", ".4f"),
                 ("val/ppl", ".2f")) if name in metrics]  # fmt: skip
        if not parts:
            return
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stdout):  # the line above the bar, which is drawn again below
            log.info(f"step {trainer.global_step}: {', '.join(parts)}")


def _si(value: float) -> str:
    """1234 -> '1.23k', 2.5e6 -> '2.5M' (tokens/s on the progress bar)."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


class LastCheckpoint(Checkpoint):
    """``<dirpath>/<filename>.ckpt`` (default ``checkpoints/last.ckpt``), the newest state of the fit whatever the
    validation loss does: what ``ckpt_path=auto`` and ``nats-train resume=<run>`` continue from, and the final
    weights that nats-eval of a finished run reads. Saved at the end of every ``every_n_train_steps``-th optimizer
    step, of the fit's final step (``trainer.max_steps``, a multiple or not) and, where a fit ends otherwise (an
    epoch limit, an early stop), at its end; always under the same name, whoever wrote the file before
    (`InterruptCheckpoint` saves it when a run is interrupted). The saves are made at the end of the optimizer step
    (``on_train_batch_end``, before the step's validation) as Lightning's periodic ones are, so a run resumes from
    any of them exactly.

    In place of Lightning's ``ModelCheckpoint(save_last=True, every_n_train_steps=N, save_top_k=0)``, which wrote
    ``last-v1.ckpt`` where it found a ``last.ckpt`` it had not written itself (a run interrupted before its first
    interval, then resumed: ``ckpt_path=auto`` went on resuming from the interrupted state), saved the final step
    only where it had saved nothing before in the process (``max_steps=60``, N=50: ``last.ckpt`` at step 50), and,
    resumed at a multiple of N with gradient accumulation, saved again in the middle of the first step."""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, filename: str = "last") -> None:
        super().__init__()
        if not filename:
            raise ValueError("LastCheckpoint: filename must not be empty")
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"LastCheckpoint: every_n_train_steps must be >= 0 (got {every_n_train_steps})")
        self.dirpath, self.filename = str(dirpath), filename
        self.every_n_train_steps = int(every_n_train_steps or 0)
        self._saved: int | None = None  # the optimizer step whose state is saved (or resumed from) in this fit

    @property
    def ckpt_path(self) -> str:
        import os

        return os.path.join(self.dirpath, self.filename + ".ckpt")

    @property
    def state_key(self) -> str:
        # the key of the ModelCheckpoint this callback replaces (it has no state of its own): a run checkpointed by
        # it resumes without Lightning's warning that a callback which wrote the checkpoint is missing
        return "ModelCheckpoint" + repr(
            {
                "monitor": None,
                "mode": "min",
                "every_n_train_steps": self.every_n_train_steps,
                "every_n_epochs": 0,
                "train_time_interval": None,
            }
        )

    def on_train_start(self, trainer, pl_module) -> None:
        self._saved = trainer.global_step  # the state the fit starts from: step 0, or the checkpoint resumed from

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._saved:  # saved already, or no optimizer step ended here (the rest of an accumulation)
            return
        final = 0 < trainer.max_steps <= step
        if final or (self.every_n_train_steps and step % self.every_n_train_steps == 0):
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._saved:  # a fit that stopped before trainer.max_steps
            self.save(trainer)

    def save(self, trainer) -> None:
        if trainer.fast_dev_run:  # as Lightning's checkpoints: none in a fast_dev_run
            return
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # every rank takes part; rank 0 writes
        self._saved = trainer.global_step


class InterruptCheckpoint(Callback):
    """Lightning's :class:`~lightning.pytorch.callbacks.OnExceptionCheckpoint`, for SIGTERM and Ctrl-C only: a fit
    that gets SIGTERM or a first Ctrl-C (Lightning's signal handler, or ours for SIGINT, sets
    ``trainer.received_sigterm`` and the loop raises ``SIGTERMException``) ends its current optimizer step (the rest
    of a gradient accumulation, so that the saved state resumes exactly), stops, and the state is saved to
    ``<dirpath>/<filename>.ckpt`` (default ``checkpoints/last.ckpt``, what ``ckpt_path=auto`` and ``nats-train
    resume=<run>`` continue from); nats-train then says where it stopped and exits non-zero. Other exceptions
    (errors) save nothing. (A plain Callback, not an OnExceptionCheckpoint: with one of those Lightning turns every
    ``fit(ckpt_path=None)`` into ``ckpt_path="last"`` and warns when there is none; nor a Checkpoint, which
    ``enable_checkpointing=false`` forbids.)

    Under SLURM (``slurm_requeue``, on by default) SLURM's requeue signal (USR2 before a pre-emption or the time
    limit, `nats.runs.requeue_signal`) is handled the same way, and once the state is saved the job is requeued
    (`nats.runs.requeue_job`, rank 0): it restarts in the same run folder from that checkpoint."""

    def __init__(self, dirpath: str, filename: str = "last", slurm_requeue: bool = True) -> None:
        super().__init__()
        if not filename:
            raise ValueError("InterruptCheckpoint: filename must not be empty")
        self.dirpath, self.filename = str(dirpath), filename
        self.slurm_requeue = bool(slurm_requeue)
        self._deferred = False
        self._requeue: str | None = None  # the SLURM job to requeue once the state is saved

    @property
    def ckpt_path(self) -> str:
        import os

        return os.path.join(self.dirpath, self.filename + ".ckpt")

    def on_train_start(self, trainer, pl_module) -> None:
        """Ctrl-C (SIGINT) in the main thread stops the fit as SIGTERM does: at the end of the current optimizer
        step, with the state saved (``reason`` says which signal); a second Ctrl-C stops at once."""
        import signal
        import threading

        from nats.runs import requeue_signal, slurm_job_to_requeue

        self.reason, self._restore = "SIGTERM", []
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(reason: str) -> None:  # as SIGTERM: at the end of the current optimizer step
            self.reason = reason
            set_received_sigterm(trainer)

        def on_sigint(signum, frame) -> None:
            signal.signal(signal.SIGINT, previous)  # the next Ctrl-C interrupts at once
            stop("Ctrl-C")

        previous = self._handle(signal.SIGINT, on_sigint)
        job = slurm_job_to_requeue() if self.slurm_requeue else None
        if job is not None:  # SLURM's requeue signal: save at the end of the step, then requeue

            def on_requeue(signum, frame) -> None:
                self._requeue = job
                stop(f"SLURM's {signal.Signals(signum).name}: requeued")

            self._handle(requeue_signal(), on_requeue)

    def _handle(self, sig, handler):
        """Install ``handler`` for ``sig`` until teardown; returns the handler it replaces."""
        import signal

        previous = signal.getsignal(sig)
        self._restore.append((sig, previous))
        signal.signal(sig, handler)
        return previous

    def teardown(self, trainer, pl_module, stage: str) -> None:
        import signal

        for sig, previous in reversed(getattr(self, "_restore", [])):
            signal.signal(sig, previous)
        self._restore = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if received_sigterm(trainer) and should_accumulate(trainer):
            set_received_sigterm(trainer, False)  # Lightning would stop in mid-step
            self._deferred = True
        elif self._deferred:
            set_received_sigterm(trainer)  # the step is complete: stop now
            self._deferred = False

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated_step = trainer.global_step

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException):
            # The loop stops after the step's validation and its count of stepped batches. Lightning restarts a
            # checkpoint of a step that validated by skipping that validation and counting the step once more
            # (it expects the count from before, as a checkpoint saved at the validation's end has it), which
            # would shift the logged steps of the resumed run by one: save the count it expects.
            shift = int(getattr(self, "_validated_step", None) == trainer.global_step and trainer.global_step > 0)
            with batches_that_stepped_shifted(trainer, shift):
                trainer.save_checkpoint(self.ckpt_path, weights_only=False)
            if self._requeue is not None and trainer.is_global_zero:
                from nats.runs import requeue_job

                requeue_job(self._requeue)


#: what an EvalAfterTraining entry evaluates (its ``checkpoint`` key)
CHECKPOINTS = ("last", "best")


class EvalAfterTraining(Callback):
    """``nats-eval`` of the run's final checkpoint at the end of training, the same code (``nats.evaluation.run``), once
    per entry of ``evals``, each into ``<run_dir>/eval_<name>/`` (results.json / .md / .csv, kv_fractions.json, the
    plots). A study's training runs thus leave their evaluations in their own folders, whatever launcher ran them
    (conf/callbacks/eval_after.yaml; docs/figure3.md).

    evals: name -> nats-eval settings (keys of conf/eval.yaml: split, methods, budgets, max_windows, batch_size,
        device, precision, ...); ``common`` holds settings for every entry (an entry's own keys win). One more
        key, ``checkpoint``: ``last`` (default, the final state) or ``best`` (the run's best checkpoint by
        validation loss, kept by the ``model_checkpoint`` callback: the point to compare at where a long training
        overfits).
    data: the run's data config (the windows come from the data the model was trained on).
    block_size, attention: the model's N and attention core, to check the evaluations' plans (methods, budgets)
    before the training starts rather than after it.
    The final checkpoint is the run's ``checkpoints/last.ckpt`` (`LastCheckpoint` saves the final step), saved
    first when it does not hold the final step (a run without that callback). An entry whose results.json is newer
    than its checkpoint is skipped (a finished run that is started again does not evaluate again). Only rank 0
    evaluates."""

    def __init__(
        self,
        evals: dict,
        data: dict,
        run_dir: str,
        common: dict | None = None,
        block_size: int | None = None,
        attention: str | None = None,
    ):
        super().__init__()
        self.evals = {str(k): dict(v or {}) for k, v in (evals or {}).items()}
        self.common = dict(common or {})
        self.checkpoints = {}
        for name in self.evals:
            which = {**self.common, **self.evals[name]}.get("checkpoint", "last")
            if which not in CHECKPOINTS:
                raise ValueError(
                    f"callbacks.eval_after.evals.{name}.checkpoint={which!r}: choose {' or '.join(CHECKPOINTS)}"
                )
            self.checkpoints[name] = which
        self.data = dict(data)
        self.run_dir = Path(run_dir)
        from nats.evaluation import compose_eval, plan_runs

        for name in self.evals:  # a mistyped key or an unusable budget fails now, not after the training
            cfg = compose_eval(self.settings(name))
            if block_size is not None:
                n = int(cfg.block_size) if cfg.get("block_size") else int(block_size)
                try:
                    plan_runs(cfg, n, attention == "nats")
                except ValueError as err:
                    raise ValueError(f"callbacks.eval_after.evals.{name}: {err}") from None

    def settings(self, name: str) -> dict:
        """The nats-eval settings of entry ``name`` (its ``checkpoint`` choice is the callback's, not nats-eval's)."""
        merged = {**self.common, **self.evals[name]}
        merged.pop("checkpoint", None)
        return merged

    def checkpoint_for(self, name: str, trainer, final: Path) -> Path:
        """The checkpoint entry ``name`` evaluates: ``final`` (`final_checkpoint`), or the best by validation loss."""
        if self.checkpoints[name] == "last":
            return final
        from lightning.pytorch.callbacks import ModelCheckpoint

        mc = trainer.checkpoint_callback
        best = getattr(mc, "best_model_path", "") if isinstance(mc, ModelCheckpoint) else ""
        if not best or not Path(best).is_file():
            raise ValueError(
                f"callbacks.eval_after.evals.{name}: checkpoint=best needs the run's best checkpoint by validation "
                f"loss, and there is none (keep the model_checkpoint callback, callbacks=[default,eval_after], and "
                f"validate at least once: trainer.val_check_interval); or evaluate checkpoint=last"
            )
        return Path(best)

    def final_checkpoint(self, trainer) -> Path:
        from nats.runs import checkpoint_step

        last = self.run_dir / "checkpoints" / "last.ckpt"
        if not last.is_file() or checkpoint_step(last) != trainer.global_step:
            trainer.save_checkpoint(last)  # every rank takes part; rank 0 writes
        return last

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.evals:
            return
        final = self.final_checkpoint(trainer)  # every rank takes part in saving it
        if not trainer.is_global_zero:
            return
        from nats.evaluation import compose_eval, run

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the training's cached blocks, for the evaluation's batches
        for name in self.evals:
            ckpt = self.checkpoint_for(name, trainer, final)
            out = self.run_dir / f"eval_{name}"
            done = out / "results.json"
            if done.is_file() and done.stat().st_mtime > ckpt.stat().st_mtime:
                log.info(f"eval_after {name}: {done} is newer than {ckpt}, skipped")
                continue
            cfg = compose_eval(self.settings(name), data=self.data, ckpt_path=str(ckpt), output_dir=str(out))
            log.info(f"eval_after {name}: nats-eval of {ckpt} into {out}")
            run(cfg)
