"""Sweeps and SLURM without a cluster: the launcher configs, the batch scripts of the paper's resources (GPUs,
tasks, account, partition: rendered through the real pipeline -> Hydra -> submitit path, not submitted), a 2x2
multirun through the submitit_local launcher collected into one table, checkpoint auto-resume in the run folder.
The same entry points run for real on a local one-node SLURM in test_slurm.py (jobs, requeue, time limit)."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA_DIR, REPO, compose
from helpers import TINY_GPT, nats_train
from nats.runs import resolve_ckpt_path
from nats.train import run

BIN = Path(sys.executable).parent
PIPELINE = [sys.executable, str(REPO / "slurm" / "pipeline.py")]  # the paper's pipeline
TINY = [
    *TINY_GPT,
    "data.micro_batch_size=2",
    "global_batch_size=2",
    "data.max_eval_windows=2",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "trainer.enable_progress_bar=false",
]

sys.path.insert(0, str(REPO / "experiments"))
import collect  # noqa: E402  (experiments/collect.py)

sys.path.insert(0, str(REPO / "slurm"))
import pipeline  # noqa: E402  (slurm/pipeline.py)


# ----------------------------------------------------------------------------------------------------
# a fake sbatch that keeps the batch script and refuses the job: the paper's resources (4 GPUs, an account, a
# partition, a constraint) exist on no local cluster, so their batch scripts are checked as rendered
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_slurm(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/sh\ncp "$1" "$FAKE_SLURM_DIR/sbatch_$$.sh"\n'
        'echo "sbatch: error: a test double, nothing was submitted" >&2\nexit 1\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        PROJECT_ROOT=str(tmp_path),
        OMP_NUM_THREADS="1",
    )


def sbatch_scripts(folder: Path) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob("sbatch_*.sh"))]


def srun_command(script: str) -> list[str]:
    """The command srun runs in a batch script (without srun and its options)."""
    line = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    tokens = shlex.split(line)
    i = tokens.index("-u")
    return tokens[i - 1 :]


def load_pickles(folder: Path):
    from submitit.core.utils import DelayedSubmission

    return [DelayedSubmission.load(p) for p in sorted(folder.rglob("*.pkl"))]


# ----------------------------------------------------------------------------------------------------
# launcher configs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer, tasks", [("ddp", 4), ("gpu", 1)])
def test_slurm_launcher_follows_the_trainer(trainer, tasks, tmp_path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose(
            "train",
            overrides=[
                "hydra/launcher=submitit_slurm",
                f"trainer={trainer}",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.account=proj",
                "hydra.launcher.mem_gb=256",
                "hydra.launcher.constraint=h100",
                "hydra.launcher.timeout_min=600",
                f"paths.output_dir={tmp_path}",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher.tasks_per_node == launcher.gpus_per_node == tasks == cfg.trainer.devices
    assert launcher.nodes == cfg.trainer.num_nodes == 1
    assert (launcher.partition, launcher.account, launcher.mem_gb, launcher.constraint) == ("gpu", "proj", 256, "h100")
    assert launcher.additional_parameters.requeue is True and launcher.max_num_timeout > 0
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        local = hydra_compose(
            "train",
            overrides=["hydra/launcher=submitit_local", f"paths.output_dir={tmp_path}"],
            return_hydra_config=True,
        )
    assert local.hydra.launcher._target_.endswith("LocalLauncher") and local.hydra.launcher.tasks_per_node == 1


# ----------------------------------------------------------------------------------------------------
# the batch script of the paper's pipeline, rendered through the real pipeline -> Hydra -> submitit path
# ----------------------------------------------------------------------------------------------------
def test_pipeline_renders_the_batch_scripts(tmp_path, fake_slurm):
    out = tmp_path / "paper"
    resources = "--partition gpu --account proj --constraint h100 --time-min 600 --mem-gb 200".split()
    cmd = [*PIPELINE, "--stages", "train", "--out", str(out), "--lambdas", "0.1", "0.3", *resources]
    cmd += ["--", "data.path=/data/pg19"]
    res = subprocess.run(cmd, env=fake_slurm, capture_output=True, text=True, timeout=240)
    assert "a test double" in res.stderr, res.stdout + res.stderr
    scripts = sbatch_scripts(tmp_path)
    assert len(scripts) == 2, res.stdout + res.stderr  # the NAtS sweep (a job array) and the dense baseline
    by_kind = {("nats" if "/train/nats/" in s else "dense"): s for s in scripts}
    for kind, script in by_kind.items():
        flags = {
            ln.split("=", 1)[0]: ln.split("=", 1)[1] if "=" in ln else True
            for ln in (x[len("#SBATCH ") :] for x in script.splitlines() if x.startswith("#SBATCH "))
        }
        assert flags["--gpus-per-node"] == "4" and flags["--ntasks-per-node"] == "4" and flags["--nodes"] == "1"
        assert flags["--partition"] == "gpu" and flags["--account"] == "proj" and flags["--constraint"] == "h100"
        assert flags["--time"] == "600" and flags["--mem"] == "200GB" and flags["--requeue"] is True
        assert flags["--signal"] == "USR2@120"  # what nats.runs.requeue_signal() listens to
        assert flags["--cpus-per-task"] == "8"
        command = srun_command(script)
        assert command[1:4] == ["-u", "-m", "submitit.core._submit"]
        assert command[4] == str(out / "train" / kind / ".submitit" / "%j")
        assert "export SUBMITIT_EXECUTOR=slurm" in script
    assert "--array=0-1%2" in by_kind["nats"] and "--array" not in by_kind["dense"]
    # the pickled jobs: one per lambda plus the dense one, each with the pipeline's overrides
    jobs = load_pickles(out / "train")
    overrides = sorted(tuple(j.args[0]) for j in jobs)
    assert len(overrides) == 3
    assert all("ckpt_path=auto" in o and "data.path=/data/pg19" in o for o in overrides)
    lambdas = sorted(
        next(x for x in o if x.startswith("model.attention.sparsity_lambda="))
        for o in overrides
        if "experiment=pg19_gpt2_nats" in o
    )
    assert lambdas == ["model.attention.sparsity_lambda=0.1", "model.attention.sparsity_lambda=0.3"]
    assert sum("experiment=pg19_gpt2_dense" in o for o in overrides) == 1


def test_plain_sbatch_script_resources(monkeypatch):
    """slurm/train.sbatch asks for the paper's resources (4 GPUs, one task per GPU) and the signal Lightning listens
    to; what it runs is run for real on the local cluster (test_slurm.py), where a CPU node takes overrides."""
    script = REPO / "slurm" / "train.sbatch"
    flags = [ln.split()[1] for ln in script.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert {"--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=4", "--signal=USR2@120", "--requeue"} <= set(flags)
    assert "trainer=ddp" in script.read_text() and 'trainer.devices="$SLURM_NTASKS_PER_NODE"' in script.read_text()
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    from nats.runs import requeue_signal

    assert requeue_signal() == signal.SIGUSR2


# ----------------------------------------------------------------------------------------------------
# a 2x2 multirun with the submitit_local launcher, collected into one table
# ----------------------------------------------------------------------------------------------------
def test_local_multirun_2x2_collects_4_rows(tmp_path):
    sweep = tmp_path / "sweep"
    grid = ["model/attention=nats", "model.attention.sparsity_lambda=0,0.5", "model.attention.window=4,8"]
    short = ["trainer.max_steps=2", "eval_every=2", "logger=none", f"paths.data_dir={DATA_DIR}"]
    nats_train(["-m", "hydra/launcher=submitit_local", *grid, *short, f"hydra.sweep.dir={sweep}", *TINY], tmp_path)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1", "2", "3"]
    assert list((sweep / ".submitit").iterdir()), "submitit wrote no job folders"
    rows = collect.main([str(sweep), "--out", str(tmp_path / "results")])
    assert len(rows) == 4 and all(r["status"] == "done" and r["steps"] == 2 for r in rows)
    assert sorted((r["lambda"], r["window"]) for r in rows) == [(0, 4), (0, 8), (0.5, 4), (0.5, 8)]
    assert all(0 < r["kv_fraction"] <= 1 and r["val_ppl"] > 1 for r in rows)
    with open(tmp_path / "results" / "runs.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {"lambda", "window", "seed", "val_ppl", "kv_fraction", "sweep"} <= set(table[0])
    md = (tmp_path / "results" / "runs.md").read_text()
    assert md.count("| done |") == 4
    assert (tmp_path / "results" / "ppl_vs_kv.png").stat().st_size > 1000


def fake_run(root: Path, name: str, attention: dict, seed: int, metrics: dict | None, eval_rows=None) -> Path:
    import yaml

    run_dir = root / name
    (run_dir / ".hydra").mkdir(parents=True)
    cfg = {
        "task_name": "train",
        "seed": seed,
        "global_batch_size": 480,
        "model": {"n_layer": 12, "block_size": 1024, "attention": attention},
    }
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    overrides = [f"seed={seed}"] + [f"model.attention.{k}={v}" for k, v in attention.items() if k != "name"]
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps({"metrics": metrics, "global_step": 10}))
    if eval_rows:
        (run_dir / "eval" / ".hydra").mkdir(parents=True)
        (run_dir / "eval" / ".hydra" / "config.yaml").write_text("task_name: eval\n")
        with open(run_dir / "eval" / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(eval_rows[0]))
            w.writeheader()
            w.writerows(eval_rows)
    return run_dir


def test_collect_dense_seeds_eval_and_unfinished(tmp_path):
    root = tmp_path / "multirun"
    for seed, shift in ((1, 0.0), (2, 0.2)):
        fake_run(
            root,
            f"nats/l0.1_s{seed}",
            {"name": "nats", "window": 16, "sparsity_lambda": 0.1},
            seed,
            {"val/loss": 3.0 + shift, "val/ppl": 20.0 + shift, "val/density": 0.2},
        )
        fake_run(
            root,
            f"nats/l1_s{seed}",
            {"name": "nats", "window": 16, "sparsity_lambda": 1.0},
            seed,
            {"val/loss": 3.2 + shift, "val/density": 0.05},
        )
    eval_rows = [
        {"method": "full", "label": "full", "budget": "", "ppl": "21.0", "area": "1.0"},
        {"method": "h2o", "label": "h2o", "budget": "0.25", "ppl": "30.0", "area": "0.25"},
    ]
    fake_run(root, "dense/s1", {"name": "dense", "output_gate": "none"}, 1, {"val/loss": 2.9}, eval_rows)
    fake_run(root, "nats/l3_s1", {"name": "nats", "window": 16, "sparsity_lambda": 3.0}, 1, None)  # still running
    crashed = fake_run(root, "nats/l10_s1", {"name": "nats", "window": 16, "sparsity_lambda": 10.0}, 1, None)
    (crashed / "failed.json").write_text(json.dumps({"error": "CUDA out of memory", "type": "OutOfMemoryError"}))
    rows = collect.main([str(root)])
    assert len(rows) == 7
    dense = next(r for r in rows if r["attention"] == "dense")
    assert dense["kv_fraction"] == 1.0 and dense["val_ppl"] == pytest.approx(math.exp(2.9))
    running = next(r for r in rows if r["lambda"] == 3.0)
    assert running["status"] == "running"
    assert next(r for r in rows if r["lambda"] == 10.0)["status"] == "failed: CUDA out of memory"
    means = collect.seed_means(rows)
    l01 = next(m for m in means if m["lambda"] == 0.1)
    assert l01["seeds"] == 2 and l01["val_ppl"] == pytest.approx(20.1) and l01["kv_fraction"] == pytest.approx(0.2)
    md = (root / "runs.md").read_text()
    assert "Mean over seeds" in md and md.count("| running |") == 1 and md.count("| failed: CUDA out of memory |") == 1
    with open(root / "eval.csv", newline="") as f:
        ev = list(csv.DictReader(f))
    assert [e["method"] for e in ev] == ["full", "h2o"] and ev[0]["attention"] == "dense"
    assert (root / "ppl_vs_kv.png").is_file() and (root / "eval_ppl_vs_area.png").is_file()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no runs"):
        collect.collect([tmp_path / "empty"])


def test_pipeline_dry_run_and_eval_overrides(tmp_path, capsys):
    assert (
        pipeline.main(
            [
                "--dry-run",
                "--out",
                str(tmp_path),
                "--lambdas",
                "0.03",
                "1",
                "--seeds",
                "1",
                "2",
                "--windows",
                "8",
                "16",
                "--partition",
                "gpu",
                "--",
                "data.path=/data/pg19",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    nats_line = next(ln for ln in text.splitlines() if ln.startswith("[train:nats]"))
    for part in (
        "experiment=pg19_gpt2_nats",
        "model.attention.sparsity_lambda=0.03,1",
        "model.attention.window=8,16",
        "seed=1,2",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=gpu",
        "ckpt_path=auto",
        f"hydra.sweep.dir={tmp_path / 'train' / 'nats'}",
        "data.path=/data/pg19",
    ):
        assert part in nats_line, part
    assert "experiment=pg19_gpt2_dense" in next(ln for ln in text.splitlines() if ln.startswith("[train:dense]"))
    assert "[collect]" in text
    # the eval stage evaluates a finished run on the data it was trained on
    import yaml

    run_dir = tmp_path / "train" / "nats" / "W16_lambda0.1_seed1"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump({"data": {"source": "pg19", "path": "/data/pg19", "hf_name": None, "seed": "${seed}"}})
    )
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["paths.data_dir=/cache", "seed=1"]))
    assert pipeline.eval_data_overrides(run_dir) == ["data=pg19", "data.path=/data/pg19", "paths.data_dir=/cache"]
    # a run on data=pg19_subset (source pg19, path an interpolation) is evaluated on pg19_subset, not pg19
    sub = tmp_path / "train" / "nats" / "subset"
    (sub / ".hydra").mkdir(parents=True)
    (sub / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump(
            {"data": {"source": "pg19", "path": "${oc.env:NATS_PG19_SUBSET,x}", "cache_name": "pg19-subset"}}
        )
    )
    (sub / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": {"data": "pg19_subset", "model": "gpt2_small"}}}})
    )
    assert pipeline.eval_data_overrides(sub) == ["data=pg19_subset", "data.cache_name=pg19-subset"]


# ----------------------------------------------------------------------------------------------------
# ckpt_path=auto: resume from the run folder
# ----------------------------------------------------------------------------------------------------
def test_resolve_ckpt_path(tmp_path):
    assert resolve_ckpt_path(None, tmp_path) is None and resolve_ckpt_path("auto", tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_text("x")
    assert resolve_ckpt_path("auto", tmp_path) == str(last)
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    hpc.write_text("x")
    os.utime(last, (time.time() - 60, time.time() - 60))
    assert resolve_ckpt_path("auto", tmp_path) == str(hpc)  # the newer one
    os.utime(hpc, (time.time() - 120, time.time() - 120))
    assert resolve_ckpt_path("auto", tmp_path) == str(last)
    with pytest.raises(FileNotFoundError, match="nope.ckpt does not exist"):
        resolve_ckpt_path(str(tmp_path / "nope.ckpt"), tmp_path)


def test_auto_resume_from_the_run_folder(tmp_path, capsys):
    base = TINY + ["eval_every=2", "logger=none", "callbacks.model_checkpoint.save_top_k=0"]  # last.ckpt only
    run(compose(base + ["trainer.max_steps=2"], tmp_path))
    assert json.loads((tmp_path / "metrics.json").read_text())["resumed_from"] is None
    run(compose(base + ["trainer.max_steps=4"], tmp_path))  # ckpt_path=auto (the default)
    info = json.loads((tmp_path / "metrics.json").read_text())
    assert info["resumed_from"] == str(tmp_path / "checkpoints" / "last.ckpt") and info["global_step"] == 4
    assert "resuming from" in capsys.readouterr().out
    run(compose(base + ["trainer.max_steps=2", "ckpt_path=null"], tmp_path))  # null: from scratch
    info = json.loads((tmp_path / "metrics.json").read_text())
    assert info["resumed_from"] is None and info["global_step"] == 2


@pytest.mark.slow
def test_pipeline_locally_end_to_end(tmp_path):
    """slurm/pipeline.py with local processes on the small model: train 2 NAtS lambdas + dense, nats-eval each
    (when nats/eval.py exists), collect: 3 rows, and the eval rows of every run."""
    out = tmp_path / "paper"
    runs = "--nats model/attention=nats --dense model/attention=dense --lambdas 0 0.5".split()
    evals = "--eval-overrides max_windows=2 methods=[full,streaming_llm] budgets=[0.5] device=cpu progress=false"
    cmd = [*PIPELINE, "--launcher", "submitit_local", "--out", str(out), *runs, *evals.split()]
    cmd += ["--", "trainer.max_steps=2", "eval_every=2", "logger=none", f"paths.data_dir={DATA_DIR}", *TINY]
    res = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "results" / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["attention"], r["lambda"]) for r in rows) == [("dense", ""), ("nats", "0"), ("nats", "0.5")]
    assert all(r["status"] == "done" for r in rows)
    assert next(r for r in rows if r["attention"] == "dense")["kv_fraction"] == "1.0"
    if pipeline.importlib.util.find_spec("nats.eval") is not None:
        with open(out / "results" / "eval.csv", newline="") as f:
            ev = list(csv.DictReader(f))
        assert len(ev) == 6 and {e["method"] for e in ev} == {"full", "streaming_llm"}
    else:
        assert "[eval] skipped" in res.stdout
