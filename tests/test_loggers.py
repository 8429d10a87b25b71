"""nats.loggers.ResumableCSVLogger: a run resumed in its folder keeps its earlier rows (Lightning's deletes them)."""

import csv

import pytest

from nats.loggers import ResumableCSVLogger


def rows(path):
    with open(path / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def test_resumed_logger_keeps_rows_before_its_first_step_and_adds_new_columns(tmp_path):
    first = ResumableCSVLogger(tmp_path, name="csv", version="")
    for step in range(6):
        first.log_metrics({"loss": float(step)}, step=step)
    first.save()
    # the interrupted run logged steps 0-5 but its checkpoint was at step 4: the resumed one logs 4, 5, 6 again,
    # with a column the first never had
    resumed = ResumableCSVLogger(tmp_path, name="csv", version="")
    resumed.resuming()
    # Lightning's ThroughputMonitor counts validation batches in `step`: such rows do not mark the resume
    resumed.log_metrics({"validate/samples": 2.0}, step=1)
    for step in (4, 5, 6):
        resumed.log_metrics({"loss": 10.0 + step, "val/loss": 1.0}, step=step)
    resumed.save()
    got = rows(tmp_path)
    assert [int(r["step"]) for r in got] == [0, 1, 2, 3, 1, 4, 5, 6]
    assert [float(r["loss"]) for r in got if "loss" in r] == [0, 1, 2, 3, 14, 15, 16]
    assert "val/loss" not in got[0] and got[-1]["val/loss"] == "1.0"
    assert not (tmp_path / "csv" / "metrics.csv.tmp").exists()
    # a later save of the same logger appends as Lightning's does
    resumed.log_metrics({"loss": 17.0}, step=7)
    resumed.save()
    assert [int(r["step"]) for r in rows(tmp_path) if "loss" in r] == list(range(8))


def test_a_run_that_does_not_resume_starts_a_new_file_as_lightning_does(tmp_path):
    old = ResumableCSVLogger(tmp_path, name="csv", version="")
    old.log_metrics({"loss": 1.0}, step=0)
    old.save()
    new = ResumableCSVLogger(tmp_path, name="csv", version="")  # no resuming(): a fresh run in this folder
    new.log_metrics({"loss": 2.0}, step=3)
    new.save()
    assert rows(tmp_path) == [{"loss": "2.0", "step": "3"}]
    with pytest.raises(RuntimeError, match="before anything is logged"):
        new.resuming()


def test_a_fresh_folder_behaves_like_lightning(tmp_path):
    log = ResumableCSVLogger(tmp_path, name="csv", version="")
    log.log_metrics({"a": 1.0}, step=0)
    log.save()
    log.log_metrics({"a": 2.0, "b": 3.0}, step=1)
    log.save()
    assert rows(tmp_path) == [{"a": "1.0", "step": "0"}, {"a": "2.0", "b": "3.0", "step": "1"}]
