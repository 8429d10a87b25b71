"""Loggers for `nats-train` (conf/logger/).

`ResumableCSVLogger` is Lightning's ``CSVLogger`` except for a resumed run. Lightning's deletes the ``metrics.csv``
it finds in its folder, so a run resumed in its own folder (``nats-train resume=<run>``) kept only the curve after
the resume. `nats.train` calls `ResumableCSVLogger.resuming` when it resumes from a checkpoint; the writer then
keeps the rows logged before and drops those from the step where the resumed run's first new row starts on (the
interrupted run may have logged past its last checkpoint; the resumed run logs those steps again). Rows of
Lightning's ThroughputMonitor for validation (only ``validate/*`` columns) count validation batches in their
``step`` column, not optimizer steps: they are kept and do not decide where the resumed run starts.
"""

from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


def _step(row: dict[str, Any]) -> int | None:
    value = row.get("step")
    if value in ("", None):
        return None
    return int(float(value))


def _is_validation_counter(row: dict[str, Any]) -> bool:
    keys = [k for k, v in row.items() if k not in ("step", "epoch") and v not in ("", None)]
    return bool(keys) and all(k.startswith("validate/") for k in keys)


class _KeepingWriter(ExperimentWriter):
    """Lightning's writer, except that an existing ``metrics.csv`` is read, not deleted (see the module)."""

    def __init__(self, log_dir: str, keep: bool) -> None:
        self._keep = keep
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        self._earlier: list[dict[str, str]] | None = None
        if not self._keep:
            return super()._check_log_dir_exists()
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                reader = csv.DictReader(f)
                self._earlier = list(reader)
                self.metrics_keys = sorted(reader.fieldnames or [])

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            steps = [_step(m) for m in self.metrics if not _is_validation_counter(m)]
            first = min((s for s in steps if s is not None), default=None)
            kept = [
                r
                for r in self._earlier
                if first is None or _is_validation_counter(r) or ((s := _step(r)) is not None and s < first)
            ]
            # the kept rows go to a new file that then replaces metrics.csv: a crash leaves the old file whole
            tmp = self.metrics_file_path + ".tmp"
            with self._fs.open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
            self._fs.mv(tmp, self.metrics_file_path)  # a rename on a local disk
            self._earlier = None
        super().save()


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that keeps a resumed run's earlier rows (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resuming = False

    def resuming(self) -> None:
        """This run resumes from a checkpoint: keep the rows of ``metrics.csv`` logged before it (call before
        the first log, i.e. before ``trainer.fit``)."""
        if self._experiment is not None:
            raise RuntimeError("ResumableCSVLogger.resuming() must be called before anything is logged")
        self._resuming = True

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _KeepingWriter(log_dir=self.log_dir, keep=self._resuming)
        return self._experiment
