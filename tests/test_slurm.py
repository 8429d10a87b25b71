"""The cluster entry points on a real one-node SLURM (slurm/local_cluster.py, the session's ``slurm_cluster``):
a 2x2 sweep through the submitit_slurm launcher collected into one table, a sweep with a failing job,
slurm/pipeline.py end to end (--detach, then --stages eval collect), slurm/train.sbatch with sbatch, and
pre-emption: ``scontrol requeue`` of a running job and the time limit's signal, each resumed in the same run
folder to the metrics of an uninterrupted run. CPU jobs of the tiny model; skipped where the cluster cannot run
(not root, no apt-get). What a cluster of one CPU node cannot show (GPUs, several nodes) is checked on the
rendered batch scripts in test_sweeps.py."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sweeps import TINY

from conftest import DATA_DIR, REPO, load_script

NATS_TRAIN = str(Path(sys.executable).parent / "nats-train")
# a CPU-only node: no GPUs, one CPU per task (the launcher's defaults ask for the paper's 4 GPUs and 8 CPUs)
CPU_JOBS = ["trainer=cpu", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1"]
SHORT = ["trainer.max_steps=2", "eval_every=2", "logger=none", f"paths.data_dir={DATA_DIR}", *TINY]
# the pre-empted runs: long enough to be interrupted (the first attempt sleeps after each step), exact to compare
PREEMPTED = [
    "trainer.max_steps=40",
    "eval_every=20",
    "checkpoint_every=5",
    "logger=none",
    "seed=7",
    f"paths.data_dir={DATA_DIR}",
    *TINY,
]


def slow(seconds: float) -> list[str]:
    return [
        "+callbacks.slow._target_=slurm_callbacks.SlowSteps",
        f"+callbacks.slow.seconds={seconds}",
        "+callbacks.slow.first_attempt_only=true",
    ]


def job_env(cluster, tmp_path: Path) -> dict[str, str]:
    """The environment of a submission: the cluster's SLURM_CONF and PATH, the run folders under tmp_path, and
    tests/ importable in the jobs (slurm_callbacks); sbatch hands it to the job."""
    env = cluster.env()
    env.update(
        PROJECT_ROOT=str(tmp_path),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def queued(cluster) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], env=cluster.env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def wait_for_jobs(cluster, ids, timeout: float = 240) -> None:
    """Until none of ``ids`` (job ids, or array ids for all their tasks) is pending or running."""
    ids = {str(i) for i in ids}
    t0 = time.time()
    while any(j in ids or j.split("_")[0] in ids for j in queued(cluster)):
        assert time.time() - t0 < timeout, f"jobs {sorted(ids)} still queued after {timeout} s: {queued(cluster)}"
        time.sleep(1)


def completions(cluster) -> list[dict[str, str]]:
    """The cluster's job-completion log: one record per ended run of a job (a requeued job has several)."""
    log = cluster.folder / "log" / "jobcomp.txt"
    return [dict(re.findall(r"(\w+)=(\S*)", ln)) for ln in log.read_text().splitlines()] if log.is_file() else []


def wait_for(predicate, what: str, timeout: float = 180) -> None:
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < timeout, f"{what}: not after {timeout} s"
        time.sleep(0.5)


def sbatch_train(cluster, tmp_path: Path, overrides: list[str]) -> str:
    """``sbatch slurm/train.sbatch`` with the overrides its header documents for a CPU node; the job id."""
    env = job_env(cluster, tmp_path)
    env["PYTHON"] = sys.executable
    cmd = [
        "sbatch",
        "--parsable",
        *("--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"),
        str(REPO / "slurm" / "train.sbatch"),
        "trainer=cpu",
        *overrides,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def job_key(record: dict[str, str]) -> str:
    """A completion record's job id as submitit and squeue write it (``<array>_<task>`` for array tasks)."""
    array = record.get("ArrayJobId")
    return f"{array}_{record.get('ArrayTaskId')}" if array and array != "0" else record["JobId"]


@pytest.fixture(scope="module")
def reference_job(slurm_cluster, tmp_path_factory):
    """The pre-empted runs' setting trained without interruption, with plain sbatch (the reference of the
    pre-emption tests, in the same environment: one thread, the same node); submitted when the module starts."""
    tmp = tmp_path_factory.mktemp("reference")
    return sbatch_train(slurm_cluster, tmp, PREEMPTED), tmp


@pytest.fixture(scope="module")
def reference(slurm_cluster, reference_job) -> dict[str, float]:
    job, tmp = reference_job
    wait_for_jobs(slurm_cluster, {job})
    return json.loads((tmp / "logs" / "train" / "slurm" / job / "metrics.json").read_text())["metrics"]


def start_sweep(cluster, tmp: Path, overrides: list[str], fixed_folder: bool = True):
    """``nats-train -m hydra/launcher=submitit_slurm ...`` in the background: (process, sweep folder, log file);
    without ``fixed_folder`` the sweep goes to the default ``logs/train/multiruns/<date>_<time>_<id>`` (None)."""
    sweep = tmp / "sweep" if fixed_folder else None
    folder = [f"hydra.sweep.dir={sweep}"] if fixed_folder else []
    cmd = [NATS_TRAIN, "-m", "hydra/launcher=submitit_slurm", *CPU_JOBS, *folder, *overrides]
    log = tmp / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=job_env(cluster, tmp), cwd=tmp, stdout=f, stderr=subprocess.STDOUT)
    return proc, sweep, log


def job_folders(sweep: Path) -> list[str]:
    """The job ids of a sweep's submitit folders: ``<array>_<task>`` of a job array, else ``<job>``."""
    names = [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir()]
    tasks = sorted(n for n in names if re.fullmatch(r"\d+_\d+", n))
    return tasks or sorted(n for n in names if n.isdigit())


@pytest.fixture(scope="module")
def failing_sweep(slurm_cluster, tmp_path_factory):
    """A sweep of two jobs whose first has a setting out of range; started when the module starts."""
    tmp = tmp_path_factory.mktemp("failing")
    proc, sweep, log = start_sweep(slurm_cluster, tmp, ["model/attention=nats", "model.attention.window=-1,4", *SHORT])
    yield proc, sweep, log, tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def time_limit_job(slurm_cluster, tmp_path_factory):
    """A one-job sweep whose allocation (2 min) ends during its first attempt: SLURM sends USR2 30 s (up to
    60 s earlier, SLURM's resolution) before the end. Submitted when the module's first test starts, so that
    it runs while the others do; test_time_limit_signal_requeues_and_resumes checks it."""
    tmp = tmp_path_factory.mktemp("time_limit")
    limits = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=30"]
    # the first attempt would last 2 min: longer than the signal takes to come
    proc, _, _ = start_sweep(slurm_cluster, tmp, [*limits, *PREEMPTED, *slow(3.0)], fixed_folder=False)
    yield proc, tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------------------------------
# sweeps through the submitit_slurm launcher
# ----------------------------------------------------------------------------------------------------
def test_sweep_2x2_runs_as_slurm_jobs_and_collects(
    slurm_cluster, time_limit_job, failing_sweep, reference_job, tmp_path
):
    """Four jobs of one array run on the cluster, each writes its run folder, collect.py makes one table. (The
    module's background jobs are submitted first, so that they run meanwhile.)"""
    collect = load_script("experiments/collect.py")
    sweep = tmp_path / "sweep"
    cmd = [
        NATS_TRAIN,
        "-m",
        "hydra/launcher=submitit_slurm",
        *CPU_JOBS,
        "model/attention=nats",
        "model.attention.sparsity_lambda=0,0.5",
        "model.attention.window=4,8",
        f"hydra.sweep.dir={sweep}",
        *SHORT,
    ]
    res = subprocess.run(
        cmd, env=job_env(slurm_cluster, tmp_path), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # one job array of four tasks, each run by SLURM to completion
    jobs = job_folders(sweep)
    assert len(jobs) == 4 and len({j.split("_")[0] for j in jobs}) == 1, jobs
    array = jobs[0].split("_")[0]
    # a task's record reaches the completion log shortly after its result: wait for all four
    wait_for(lambda: set(jobs) <= {job_key(c) for c in completions(slurm_cluster)}, "completion records", 60)
    done = {job_key(c): c["JobState"] for c in completions(slurm_cluster)}
    assert {j: done.get(j) for j in jobs} == {j: "COMPLETED" for j in jobs}
    for job in jobs:
        assert (sweep / ".submitit" / job / f"{job}_0_result.pkl").is_file()
    for i in range(4):
        info = json.loads((sweep / str(i) / "metrics.json").read_text())
        assert info["global_step"] == 2
    assert array and not queued(slurm_cluster) & {f"{array}_{i}" for i in range(4)}
    rows = collect.main([str(sweep), "--out", str(tmp_path / "results")])
    assert len(rows) == 4 and all(r["status"] == "done" and r["steps"] == 2 for r in rows)
    assert sorted((r["lambda"], r["window"]) for r in rows) == [(0, 4), (0, 8), (0.5, 4), (0.5, 8)]
    with open(tmp_path / "results" / "runs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert "Bypassing sacct error" not in res.stderr + res.stdout  # submitit reads the job states


def test_failed_job_is_reported_and_the_others_finish(slurm_cluster, failing_sweep):
    collect = load_script("experiments/collect.py")
    proc, sweep, log, tmp_path = failing_sweep
    rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc != 0, out[-3000:]
    jobs = job_folders(sweep)
    wait_for_jobs(slurm_cluster, {j.split("_")[0] for j in jobs})
    states = {job_key(c): c["JobState"] for c in completions(slurm_cluster)}
    assert [states[j] for j in jobs] == ["FAILED", "COMPLETED"]
    assert "Bypassing sacct error" not in out
    rows = {r["window"]: r for r in collect.main([str(sweep), "--out", str(tmp_path / "results")])}
    assert rows[4]["status"] == "done" and rows[4]["steps"] == 2
    assert rows[-1]["status"].startswith("failed: model.attention.window=-1")
    assert "failed: model.attention.window=-1" in (tmp_path / "results" / "runs.md").read_text()


# ----------------------------------------------------------------------------------------------------
# slurm/pipeline.py: train (detached), then eval and collect
# ----------------------------------------------------------------------------------------------------
def test_pipeline_detached_then_eval_and_collect(slurm_cluster, tmp_path):
    out = tmp_path / "paper"
    env = job_env(slurm_cluster, tmp_path)
    base = [sys.executable, str(REPO / "slurm" / "pipeline.py"), "--out", str(out), "--cpus-per-task", "1"]
    train = base + [
        *("--nats", "model/attention=nats", "--dense", "model/attention=dense", "--lambdas", "0", "0.5"),
        "--detach",
        "--",
        "trainer=cpu",
        "hydra.launcher.gpus_per_node=null",
        *SHORT,
    ]
    res = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[train:nats] 2/2 jobs submitted" in res.stdout and "[train:dense] 1/1 jobs submitted" in res.stdout
    ids = {p.name.split("_")[0] for p in (out / "train").glob("*/.submitit/*") if p.is_dir()}
    assert ids, "no job folders"
    wait_for_jobs(slurm_cluster, ids)
    finished = sorted(str(p.parent.relative_to(out / "train")) for p in (out / "train").glob("*/*/metrics.json"))
    assert finished == ["dense/seed1337", "nats/W16_lambda0.5_seed1337", "nats/W16_lambda0_seed1337"]
    later = base + [
        *("--stages", "eval", "collect", "--eval-gpus", "0"),
        *("--eval-overrides", "max_windows=2", "methods=[full,streaming_llm]", "budgets=[0.5]", "progress=false"),
    ]
    res = subprocess.run(later, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"\[eval\] submitted 3 jobs", res.stdout), res.stdout
    with open(out / "results" / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["attention"], r["lambda"]) for r in rows) == [("dense", ""), ("nats", "0"), ("nats", "0.5")]
    assert all(r["status"] == "done" for r in rows)
    with open(out / "results" / "eval.csv", newline="") as f:
        ev = list(csv.DictReader(f))
    assert len(ev) == 6 and {e["method"] for e in ev} == {"full", "streaming_llm"}
    # run again: every run has eval/, nothing is submitted
    res = subprocess.run(base + ["--stages", "eval"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "nothing to evaluate" in res.stdout, res.stdout + res.stderr


def test_pipeline_waits_for_every_training_job_before_going_on(slurm_cluster, tmp_path):
    """A training sweep with a failing job: when the pipeline's training stage returns, every job of the sweep has
    ended and the good one has finished (submitit's launcher raises at the first failed job; the pipeline then
    waits for the sweep's jobs still queued, `wait_for_sweep`), so the next stage finds it."""
    out = tmp_path / "paper"
    cmd = [
        *(sys.executable, str(REPO / "slurm" / "pipeline.py"), "--out", str(out), "--cpus-per-task", "1"),
        *("--stages", "train", "--no-dense", "--nats", "model/attention=nats", "--lambdas", "-1", "0.5", "--"),
        *("trainer=cpu", "hydra.launcher.gpus_per_node=null", *SHORT, *slow(6.0)),  # the good job outlasts the bad
    ]
    res = subprocess.run(cmd, env=job_env(slurm_cluster, tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep = out / "train" / "nats"
    ids = {j.split("_")[0] for j in job_folders(sweep)}
    assert not any(j.split("_")[0] in ids for j in queued(slurm_cluster)), res.stdout[-3000:]
    assert (sweep / "W16_lambda0.5_seed1337" / "metrics.json").is_file(), res.stdout[-3000:]
    assert (sweep / "W16_lambda-1_seed1337" / "failed.json").is_file(), sorted(p.name for p in sweep.iterdir())


# ----------------------------------------------------------------------------------------------------
# plain sbatch, and pre-emption
# ----------------------------------------------------------------------------------------------------
def test_plain_sbatch_train_script(slurm_cluster, reference_job, reference):
    """slurm/train.sbatch, submitted with sbatch and the CPU overrides its header documents: one run in the folder
    named by the job id, its log in slurm-<id>.out."""
    job, tmp = reference_job
    run_dir = tmp / "logs" / "train" / "slurm" / job
    info = json.loads((run_dir / "metrics.json").read_text())
    assert info["global_step"] == 40 and info["resumed_from"] is None and info["metrics"] == reference
    log = (tmp / f"slurm-{job}.out").read_text()
    assert f"job {job} (restart count 0)" in log and "no checkpoint in" in log, log[-3000:]
    assert [c["JobState"] for c in completions(slurm_cluster) if c["JobId"] == job] == ["COMPLETED"]


def test_sbatch_train_script_requeued_resumes_exactly(slurm_cluster, reference, tmp_path):
    """``scontrol requeue`` while slurm/train.sbatch trains: the SIGTERM saves last.ckpt, SLURM runs the job
    again under the same id, it resumes in the same run folder and ends with the uninterrupted run's metrics."""
    env = job_env(slurm_cluster, tmp_path)
    job = sbatch_train(slurm_cluster, tmp_path, [*PREEMPTED, *slow(0.5)])
    run_dir = tmp_path / "logs" / "train" / "slurm" / job
    wait_for(lambda: (run_dir / "checkpoints" / "last.ckpt").is_file(), "the first checkpoint")
    assert job in queued(slurm_cluster)
    req = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True)
    assert req.returncode == 0, req.stderr
    wait_for(lambda: (run_dir / "metrics.json").is_file(), "the requeued job's end", timeout=240)
    wait_for_jobs(slurm_cluster, {job})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"job {job} (restart count 0)" in log and f"job {job} (restart count 1)" in log, log[-3000:]
    assert "interrupted at step" in log
    info = json.loads((run_dir / "metrics.json").read_text())
    assert info["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt") and info["global_step"] == 40
    assert info["metrics"] == reference
    assert [c["JobState"] for c in completions(slurm_cluster) if c["JobId"] == job][-1] == "COMPLETED"


def test_time_limit_signal_requeues_and_resumes(slurm_cluster, time_limit_job, reference):
    """The job of ``time_limit_job``: SLURM's USR2 before the time limit -> the current optimizer step ends,
    checkpoints/last.ckpt is saved and the job requeued (nats.callbacks.InterruptCheckpoint); it runs again in the
    same sweep folder from that checkpoint and finishes with the uninterrupted run's metrics."""
    proc, tmp = time_limit_job
    rc = proc.wait(timeout=300)
    log = (tmp / "launcher.log").read_text()
    assert rc == 0, log[-3000:]
    # the default sweep folder holds ${now:...}: the requeued job (the same pickled config) found the same one
    [sweep] = list((tmp / "logs" / "train" / "multiruns").iterdir())
    [job] = job_folders(sweep)
    run_dir = sweep / "0"
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt")), sorted(p.name for p in run_dir.iterdir())  # not mid-step
    info = json.loads((run_dir / "metrics.json").read_text())
    assert str(info["resumed_from"]).endswith("checkpoints/last.ckpt") and info["global_step"] == 40, info
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*.out"))
    assert "SLURM's SIGUSR2: requeued" in logs, logs[-3000:]
    assert info["metrics"] == reference
    runs = [c for c in completions(slurm_cluster) if job_key(c) == job]
    assert len(runs) >= 2 and runs[-1]["JobState"] == "COMPLETED", runs
