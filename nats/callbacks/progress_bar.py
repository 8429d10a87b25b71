"""`StepProgressBar`: the progress bar of a fit, in optimizer steps (conf/callbacks/progress_bar.yaml)."""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar

log = logging.getLogger(__name__)


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
        from nats.step_logging import logs_written_now

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
