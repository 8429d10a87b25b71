"""The run folder as a user meets it through `nats-train`: one folder per run whatever the launch timing,
`resume=<run folder>` / `resume=latest` continuing an interrupted run in its folder, a corrupt checkpoint stopping
with the project's own message and a `failed.json`, the run's log in `train.log`, the progress bar counting
optimizer steps, and a mistyped option naming the valid ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import DATA_DIR, REPO, compose
from helpers import NATS_TRAIN, TINY_GPT, nats_train
from nats.runs import CheckpointError, checkpoint_step, latest_run, resume_argv
from nats.train import build

sys.path.insert(0, str(REPO / "experiments"))
import collect  # noqa: E402  (experiments/collect.py)

SMALL = [
    *TINY_GPT,
    "data.max_eval_windows=4",
    "data.micro_batch_size=2",
    "global_batch_size=4",
    "eval_every=2",
    "logger=none",
    "callbacks.throughput=null",
    "final_validation=false",
    f"paths.data_dir={DATA_DIR}",
]


def test_runs_started_together_get_their_own_folders(tmp_path):
    """Two `nats-train` processes started at the same moment (a sweep script) must not share a run folder: the
    name is <date>_<time>_<id>, the id random per process. Both runs train one step; each folder holds its own."""
    env = dict(os.environ, PROJECT_ROOT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [NATS_TRAIN, *SMALL, "trainer.max_steps=1"]
    procs = [
        subprocess.Popen(
            [*cmd, f"seed={s}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
        )
        for s in (1, 2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    runs = sorted((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 2
    seeds = sorted((r / ".hydra" / "overrides.yaml").read_text().split("seed=")[1].strip() for r in runs)
    assert seeds == ["1", "2"]
    assert all(json.loads((r / "metrics.json").read_text())["global_step"] == 1 for r in runs)


def test_resume_latest_continues_in_the_run_folder_and_a_corrupt_checkpoint_fails_clearly(tmp_path):
    first = nats_train([*SMALL, "trainer.max_steps=2", "seed=7"], tmp_path)
    assert "starting fresh" in first.stdout
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert "val_ppl" in log and "starting fresh" in log and "max_steps=2" in log  # ours and Lightning's messages

    # resume=latest: the run's own overrides (seed=7 ...), a larger max_steps, the same folder
    second = nats_train(["resume=latest", "trainer.max_steps=4"], tmp_path)
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} at step 2" in second.stdout
    assert list((tmp_path / "logs" / "train" / "runs").iterdir()) == [run_dir]
    info = json.loads((run_dir / "metrics.json").read_text())
    assert info["global_step"] == 4 and info["resumed_from"].endswith("last.ckpt")
    assert "seed=7" in (run_dir / ".hydra" / "overrides.yaml").read_text()

    # a truncated last.ckpt: the project's message (file, what, what to do), no torch advice, failed.json
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:5000])
    third = nats_train([f"resume={run_dir}", "trainer.max_steps=6"], tmp_path, check=False)
    err = third.stdout + third.stderr
    assert third.returncode != 0
    assert f"cannot resume from {ckpt}" in err and "truncated or corrupt" in err and "ckpt_path=null" in err
    assert "weights_only" not in err
    failed = json.loads((run_dir / "failed.json").read_text())
    assert failed["type"] == "CheckpointError" and "Traceback" in failed["traceback"]
    (row,) = collect.collect([run_dir])
    assert row["status"].startswith("failed: cannot resume from")


def test_resume_argv_merges_the_saved_overrides(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- model/attention=nats\n- trainer.max_steps=100\n- seed=3\n")
    argv = resume_argv([f"resume={run_dir}", "trainer.max_steps=200"], tmp_path)
    assert argv == [
        "model/attention=nats",
        "seed=3",
        "trainer.max_steps=200",
        "ckpt_path=auto",
        f"hydra.run.dir={run_dir}",
    ]
    assert resume_argv(["seed=1"], tmp_path) == ["seed=1"]  # no resume=: unchanged
    with pytest.raises(FileNotFoundError, match="not the folder of a nats-train run"):
        resume_argv([f"resume={tmp_path / 'nope'}"], tmp_path)
    with pytest.raises(FileNotFoundError, match="no run folder with a checkpoint"):
        resume_argv(["resume=latest"], tmp_path / "runs")
    with pytest.raises(ValueError, match="multirun"):
        resume_argv([f"resume={run_dir}", "-m"], tmp_path)


def test_checkpoint_step_reports_garbage_with_the_fix(tmp_path):
    bad = tmp_path / "checkpoints" / "last.ckpt"
    bad.parent.mkdir()
    bad.write_bytes(b"not a checkpoint")
    (tmp_path / "checkpoints" / "best-step2.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"last.ckpt \(16 bytes\).*best-step2.ckpt.*ckpt_path=null"):
        checkpoint_step(bad)


def test_progress_bar_counts_optimizer_steps(tmp_path):
    """4 micro-batches per optimizer step: the stock TQDM bar would end at 12 micro-batches (of a total of 3)."""
    cfg = compose(
        [
            *SMALL,
            "global_batch_size=8",
            "trainer.max_steps=3",
            "eval_every=3",
            "callbacks.progress_bar.refresh_rate=1",
            "ckpt_path=null",
        ],
        tmp_path,
    )
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    (bar,) = [c for c in trainer.callbacks if type(c).__name__ == "StepProgressBar"]
    assert trainer.accumulate_grad_batches == 4 and trainer.global_step == 3
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    # the bar reads the loss and lr itself when it refreshes: no training metric is a Lightning progress-bar
    # metric, which Lightning would turn into a Python number (a device sync) after every micro-batch
    assert not any(k.startswith("train/") or k == "lr" for k in trainer.progress_bar_metrics)
    assert "train/loss=" in str(bar.train_progress_bar.postfix) and "lr=" in str(bar.train_progress_bar.postfix)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+trainer.max_step=4",
            r"trainer \(lightning.*Trainer\) has no option 'max_step' \(did you mean trainer.max_steps\?\)",
        ),
        (
            "+callbacks.progress_bar.refresh=4",
            r"callbacks.progress_bar \(nats.callbacks.StepProgressBar\) has no option 'refresh' \(did you mean "
            r"callbacks.progress_bar.refresh_rate\?\)",
        ),
    ],
)
def test_mistyped_option_names_the_valid_ones(override, message, tmp_path):
    with pytest.raises(TypeError, match=message):
        build(compose([*SMALL, override], tmp_path))


def test_resume_latest_searches_every_task(tmp_path):
    """resume=latest from the logs root: the newest checkpoint of any task's runs/ (e.g. a fine-tuning run)."""
    import os
    import time

    older = tmp_path / "train" / "runs" / "2026-01-01_00-00-00_aaaa"
    newer = tmp_path / "finetune_smollm2_nats" / "runs" / "2026-01-02_00-00-00_bbbb"
    for run in (older, newer):
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
        time.sleep(0.01)
    os.utime(older / "checkpoints" / "last.ckpt", (time.time() - 100, time.time() - 100))
    assert latest_run(tmp_path) == newer
    os.utime(older / "checkpoints" / "last.ckpt", None)  # now the train run's checkpoint is the newest
    assert latest_run(tmp_path) == older


def test_last_checkpoint_is_rewritten_at_every_interval_without_validation(tmp_path):
    """checkpoints/last.ckpt holds the newest state at every `checkpoint_every` steps, whatever validation does
    (here none runs before the end): a run killed at any point loses less than one interval."""
    import lightning as L

    seen = {}

    class ReadLast(L.Callback):
        def on_train_batch_start(self, trainer, *_):
            last = tmp_path / "checkpoints" / "last.ckpt"
            seen[trainer.global_step] = checkpoint_step(last) if last.is_file() else None

    cfg = compose([*SMALL, "trainer.max_steps=5", "eval_every=100", "checkpoint_every=2", "ckpt_path=null"], tmp_path)
    datamodule, module, trainer = build(cfg)
    trainer.callbacks.append(ReadLast())
    trainer.fit(module, datamodule=datamodule)
    assert seen == {0: None, 1: None, 2: 2, 3: 2, 4: 4}
    assert not list((tmp_path / "checkpoints").glob("best-*"))  # no validation ran: the best one is not written


def test_progress_bar_of_a_resumed_run_shows_the_true_total(tmp_path):
    """Resumed at step 2 of 4: the bar counts 2 -> 4 of 4 (not '2/?'), and its rate counts only these 2 steps."""
    first = compose([*SMALL, "trainer.max_steps=2", "checkpoint_every=2", "ckpt_path=null"], tmp_path)
    datamodule, module, trainer = build(first)
    trainer.fit(module, datamodule=datamodule)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(ckpt) == 2
    datamodule, module, trainer = build(compose([*SMALL, "trainer.max_steps=4", f"ckpt_path={ckpt}"], tmp_path))
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt))
    (bar,) = [c for c in trainer.callbacks if type(c).__name__ == "StepProgressBar"]
    tqdm_bar = bar.train_progress_bar
    assert (tqdm_bar.initial, tqdm_bar.n, tqdm_bar.total) == (2, 4, 4)
    assert tqdm_bar.desc.startswith("train") and tqdm_bar.unit == "step"
    assert "tok/s=" in str(tqdm_bar.postfix) and bar._step_tokens == 4 * 32  # global batch x block_size


def test_resume_latest_takes_the_run_active_last_and_says_why(tmp_path):
    import time

    from nats.runs import pick_latest_run

    now = time.time()
    runs = tmp_path / "train" / "runs"
    stopped, newer, newest = (runs / name for name in ("2026-01-01_00-00-00_aaaa", "2026-01-02_b", "2026-01-03_c"))
    for run, ckpt_age, log_age in ((stopped, 50, 50), (newer, 300, 10), (newest, None, 5)):
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text("- seed=3\n")
        os.utime(run / ".hydra" / "overrides.yaml", (now - 1000, now - 1000))
        (run / "train.log").write_text("x")
        os.utime(run / "train.log", (now - log_age, now - log_age))
        if ckpt_age is not None:
            (run / "checkpoints").mkdir()
            (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
            os.utime(run / "checkpoints" / "last.ckpt", (now - ckpt_age, now - ckpt_age))
    # `newer` has the older checkpoint, but it was active after `stopped` (its log): it is the one to continue
    folder, why = pick_latest_run(tmp_path)
    assert folder == newer
    assert "written to last" in why and time.strftime("%H:%M", time.localtime(now - 10)) in why
    assert f"newer runs without a checkpoint to resume from: {newest.name}" in why
    notes = []
    argv = resume_argv(["resume=latest"], tmp_path, notes)
    assert argv[-1] == f"hydra.run.dir={newer}" and notes == [f"resume=latest: {newer}, {why}"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_says_how_to_resume_and_fails(tmp_path):
    """SIGTERM in mid-run: the current optimizer step ends, checkpoints/last.ckpt holds it, the run says
    'interrupted at step N ...; resume with nats-train resume=<run>' and exits 143; the resumed run continues
    from step N. The console carries none of the libraries' noise."""
    import signal
    import time

    env = dict(os.environ, PROJECT_ROOT=str(tmp_path), OMP_NUM_THREADS="1")
    small = [a for a in SMALL if a != "logger=none"]  # TensorBoard: its event file shows the steps going on
    args = [*small, "trainer.max_steps=100000", "eval_every=1000", "checkpoint_every=1000"]
    proc = subprocess.Popen(
        [NATS_TRAIN, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    runs = tmp_path / "logs" / "train" / "runs"
    deadline, sizes = time.time() + 300, set()
    while time.time() < deadline and proc.poll() is None and len(sizes) < 2:  # until step 10's loss is logged
        sizes = {f.stat().st_size for f in runs.glob("*/tensorboard/**/events.out.tfevents.*")} | sizes
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    text = out + err
    assert proc.returncode == 143, text[-3000:]
    (run_dir,) = runs.iterdir()
    rel = run_dir.relative_to(tmp_path)
    match = re.search(r"interrupted at step (\d+) \(SIGTERM; state saved in (\S+)\); resume with (.*)$", text, re.M)
    assert match, text[-3000:]
    step = int(match.group(1))
    assert step >= 10 and match.group(3) == f"nats-train resume={rel}"
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == step
    for noise in ("litlogger", "LeafSpec", "Total FLOPs", "Validation DataLoader", "Traceback"):
        assert noise not in text, noise

    resumed = nats_train([f"resume={rel}", f"trainer.max_steps={step + 2}"], tmp_path)
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} at step {step}" in resumed.stdout
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == step + 2
    assert "val_ppl" in resumed.stdout


def test_ctrl_c_ends_the_optimizer_step_and_saves_as_sigterm_does(tmp_path, monkeypatch, caplog):
    """A first Ctrl-C (SIGINT) in mid-accumulation: the optimizer step ends, checkpoints/last.ckpt holds it, and the
    run reports 'interrupted at step N (Ctrl-C; state saved in ...); resume with ...' with status 130."""
    import signal
    import threading

    import lightning as L

    import nats.train as T
    from nats.runs import RunInterrupted, report_failure

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")

    class CtrlC(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 3 and batch_idx % trainer.accumulate_grad_batches == 0:  # step 4's first half
                os.kill(os.getpid(), signal.SIGINT)

    build = T.build

    def with_ctrl_c(cfg):
        datamodule, module, trainer = build(cfg)
        trainer.callbacks.append(CtrlC())
        return datamodule, module, trainer

    monkeypatch.setattr(T, "build", with_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    cfg = compose([*SMALL, "trainer.max_steps=50", "eval_every=100", "checkpoint_every=100"], tmp_path)
    with pytest.raises(RunInterrupted) as err:
        T.run(cfg)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    assert err.value.reason == "Ctrl-C" and err.value.step == 4  # the step in progress was completed
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 4
    with caplog.at_level("ERROR", logger="nats"):
        assert report_failure(err.value, tmp_path, program="nats-train", new_folder=False) == 130
    assert re.search(
        r"interrupted at step 4 \(Ctrl-C; state saved in \S+last\.ckpt\); resume with nats-train", caplog.text
    )


def test_resumes_after_an_early_interrupt_keep_one_last_checkpoint_at_the_newest_state(tmp_path, caplog):
    """A run interrupted before its first checkpoint interval (InterruptCheckpoint writes last.ckpt at step 1),
    resumed in its folder (ckpt_path=auto, as `nats-train resume=<run>`) to the end: last.ckpt is rewritten, not
    joined by a last-v1.ckpt (Lightning versions the name of a file it did not write itself), so a second resume
    continues from the final step, and nats-eval of last.ckpt evaluates the final weights."""
    from nats.runs import RunInterrupted
    from nats.train import run

    settings = [*SMALL, "trainer.max_steps=4", "eval_every=100", "checkpoint_every=2", "callbacks.progress_bar=null"]
    stop = ["+callbacks.stop._target_=slurm_callbacks.SigtermAt", "+callbacks.stop.step=1"]
    with pytest.raises(RunInterrupted):
        run(compose(settings + stop, tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 1
    run(compose(settings, tmp_path))  # resumed to the end: last.ckpt rewritten at steps 2 and 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]
    assert checkpoint_step(last) == 4
    with caplog.at_level("INFO", logger="nats"):
        run(compose(settings, tmp_path))
    assert f"resuming from {last} at step 4" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]


def test_the_end_of_a_run_saves_its_final_state_and_validation(tmp_path):
    """trainer.max_steps not a multiple of checkpoint_every (nor of eval_every): last.ckpt holds the final step, and
    the final validation (the val_ppl nats-train prints) runs within the fit, so the best checkpoint by validation
    loss is chosen among all validations, the final one included (here the loss still falls: the final step's)."""
    from nats.train import run

    metrics = run(compose([*SMALL, "trainer.max_steps=3", "final_validation=true", "ckpt_path=null"], tmp_path))
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 3
    (best,) = (tmp_path / "checkpoints").glob("best-*.ckpt")
    assert best.name == f"best-step3-val{metrics['val/loss']:.4f}.ckpt"
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 3
