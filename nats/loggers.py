"""Loggers for `nats-train` (conf/logger/).

`ResumableCSVLogger` is Lightning's ``CSVLogger`` except for a resumed run: Lightning's deletes the ``metrics.csv``
it finds in its folder (a run resumed in its own folder, ``nats-train resume=<run>``, then keeps only the curve
after the resume). This one keeps the rows logged before, and drops those from the step where the resumed run's
first new row starts on (the interrupted run may have logged past its last checkpoint; the resumed run logs those
steps again).
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


class _KeepingWriter(ExperimentWriter):
    """Lightning's writer, except that an existing ``metrics.csv`` is read, not deleted (see the module)."""

    def _check_log_dir_exists(self) -> None:
        self._earlier: list[dict[str, str]] | None = None
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                reader = csv.DictReader(f)
                self._earlier = list(reader)
                self.metrics_keys = sorted(reader.fieldnames or [])

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            steps = [s for s in (_step(m) for m in self.metrics) if s is not None]
            first = min(steps) if steps else None
            kept = [r for r in self._earlier if first is None or (_step(r) is not None and _step(r) < first)]
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

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return self._experiment
