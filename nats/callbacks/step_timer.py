"""`StepTimer`: host wall-clock times of a fit's steps and validations (conf/callbacks/step_timer.yaml)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


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
