"""The NAtS paper's pipeline on a SLURM cluster: train one NAtS model per lambda and the dense baseline, evaluate
each with ``nats-eval``, aggregate everything into one table and plot.

    # everything, waiting for each stage (run it in tmux/screen on the login node)
    python slurm/pipeline.py --out logs/paper --partition gpu --account myproj -- data.path=/data/pg19

    # submit the training jobs and return; later, when they have finished, evaluate and aggregate
    python slurm/pipeline.py --out logs/paper --partition gpu --detach -- data.path=/data/pg19
    python slurm/pipeline.py --out logs/paper --stages eval collect --partition gpu

    python slurm/pipeline.py --out logs/paper --dry-run -- data.path=/data/pg19     # print the commands only

Stages (``--stages``, default all three, in this order):

train
    Two Hydra multiruns of ``nats-train`` through the ``submitit_slurm`` launcher (``conf/hydra/launcher/``):
    ``experiment=pg19_gpt2_nats`` swept over ``--lambdas`` x ``--windows`` x ``--seeds`` into
    ``<out>/train/nats/W<W>_lambda<lambda>_seed<seed>/`` and ``experiment=pg19_gpt2_dense`` over ``--seeds``
    into ``<out>/train/dense/seed<seed>/``. Each job is one node with 4 GPUs (one task per GPU, DDP through
    Lightning's SLURM environment), requeues itself on pre-emption or at the time limit and resumes from its
    run folder (``ckpt_path=auto``). The folders are fixed, so running the stage again resumes unfinished runs
    and leaves finished ones as they are (they stop at once at ``max_steps`` and validate).
eval
    ``nats-eval ckpt_path=<run>/checkpoints/last.ckpt hydra.run.dir=<run>/eval data=<the run's data>`` (test
    split; full, StreamingLLM and H2O at N/2 ... N/32, and the learned NAtS cache) for every finished run (one
    that has ``metrics.json``) without ``<run>/eval/``: one SLURM job with one GPU each (a job array), or local
    processes with ``--launcher submitit_local``/``basic``. ``--eval-overrides`` adds overrides (e.g.
    ``max_windows=500 precision=bfloat16``). Skipped, with a message, when ``nats.eval`` does not exist in this
    checkout.
collect
    ``python experiments/collect.py <out>/train --out <out>/results``: ``runs.csv``, ``runs.md``,
    ``ppl_vs_kv.png`` (validation perplexity against KV fraction), and ``eval.csv`` from the eval outputs.

Everything after ``--`` is passed to both trainings as Hydra overrides (``data.path=...``, ``trainer.max_steps=``
...). ``--nats`` / ``--dense`` replace the experiment of each (e.g. ``--nats model/attention=nats --dense
model/attention=dense --launcher submitit_local`` tries the whole pipeline on the small CPU model).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LAUNCHERS = ("submitit_slurm", "submitit_local", "basic")


def _list(values: list) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def launcher_overrides(args: argparse.Namespace) -> list[str]:
    """``hydra/launcher=...`` and the resources of the SLURM jobs."""
    if args.launcher == "basic":
        return []
    out = [f"hydra/launcher={args.launcher}"]
    if args.launcher == "submitit_slurm":
        for key, value in (
            ("partition", args.partition),
            ("account", args.account),
            ("qos", args.qos),
            ("constraint", args.constraint),
            ("timeout_min", args.time_min),
            ("mem_gb", args.mem_gb),
            ("cpus_per_task", args.cpus_per_task),
        ):
            if value is not None:
                out.append(f"hydra.launcher.{key}={value}")
        if args.setup:
            out.append("hydra.launcher.setup=[" + ",".join(json.dumps(s) for s in args.setup) + "]")
    return out


def train_commands(args: argparse.Namespace) -> list[tuple[str, list[str], int]]:
    """(name, command, number of jobs) of the training multiruns."""
    out_dir = Path(args.out).resolve()
    common = ["ckpt_path=auto", *launcher_overrides(args), *args.overrides]
    seeds = _list(args.seeds)
    cmds = []
    nats = [
        PY,
        "-m",
        "nats.train",
        "-m",
        *args.nats,
        f"model.attention.sparsity_lambda={_list(args.lambdas)}",
        f"model.attention.window={_list(args.windows)}",
        f"seed={seeds}",
        f"hydra.sweep.dir={out_dir / 'train' / 'nats'}",
        "hydra.sweep.subdir=W${model.attention.window}_lambda${model.attention.sparsity_lambda}_seed${seed}",
        *common,
    ]
    cmds.append(("nats", nats, len(args.lambdas) * len(args.windows) * len(args.seeds)))
    if not args.no_dense:
        dense = [
            PY,
            "-m",
            "nats.train",
            "-m",
            *args.dense,
            f"seed={seeds}",
            f"hydra.sweep.dir={out_dir / 'train' / 'dense'}",
            "hydra.sweep.subdir=seed${seed}",
            *common,
        ]
        cmds.append(("dense", dense, len(args.seeds)))
    return cmds


def _submitted(sweep_dir: Path) -> int:
    return len(list((sweep_dir / ".submitit").rglob("*_submitted.pkl"))) if (sweep_dir / ".submitit").is_dir() else 0


def _queued_jobs(sweep_dir: Path) -> list[str]:
    """The sweep's SLURM jobs (ids from its .submitit folders) that are still pending or running."""
    ids = sorted({p.name.split("_")[0] for p in (sweep_dir / ".submitit").glob("*") if p.is_dir()})
    if not ids:
        return []
    res = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True)
    return res.stdout.split() if res.returncode == 0 else []


def wait_for_sweep(name: str, sweep_dir: Path, poll_s: float = 5.0) -> None:
    """Wait until no job of the sweep is queued: submitit's launcher returns at the first failed job of a sweep
    while the others still run, and the next stage must see them finished."""
    waiting = _queued_jobs(sweep_dir)
    if waiting:
        print(f"[train:{name}] waiting for {len(waiting)} job(s) still queued or running", flush=True)
    while waiting:
        time.sleep(poll_s)
        waiting = _queued_jobs(sweep_dir)


def run_train(args: argparse.Namespace) -> int:
    cmds = train_commands(args)
    env = dict(os.environ, PROJECT_ROOT=os.environ.get("PROJECT_ROOT", str(REPO)))
    procs = []
    for name, cmd, n_jobs in cmds:
        print(f"[train:{name}] {shlex.join(cmd)}", flush=True)
        if not args.dry_run:
            procs.append((name, subprocess.Popen(cmd, cwd=REPO, env=env), n_jobs))
    if args.dry_run:
        return 0
    out_dir = Path(args.out).resolve() / "train"
    if args.detach:  # wait until submitit has handed every job to sbatch, then stop waiting for them
        while any(p.poll() is None and _submitted(out_dir / name) < n for name, p, n in procs):
            time.sleep(2)
        for name, p, n in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
            print(
                f"[train:{name}] {_submitted(out_dir / name)}/{n} jobs submitted; logs in "
                f"{out_dir / name / '.submitit'}",
                flush=True,
            )
        print(
            "detached: the jobs run on their own; when they have finished run this again with --stages eval collect",
            flush=True,
        )
        return 0
    rc = 0
    for name, p, _ in procs:
        code = p.wait()
        if args.launcher == "submitit_slurm":
            wait_for_sweep(name, out_dir / name)
        print(f"[train:{name}] exit code {code}", flush=True)
        rc = rc or code
    return rc


def finished_runs(out_dir: Path) -> list[Path]:
    return sorted(p.parent for p in (out_dir / "train").rglob("metrics.json") if ".submitit" not in p.parts)


def eval_data_overrides(run: Path) -> list[str]:
    """The data a run was trained on, as ``nats-eval`` overrides (its source, path or hub name, token cache)."""
    import yaml

    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text()) or {}
    overrides_file = run / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    data = cfg.get("data") or {}
    out = []
    # the data config the run chose (e.g. pg19_subset, whose source is pg19 but whose path and cache name differ),
    # as Hydra recorded it; else the config named like the source
    hydra_file = run / ".hydra" / "hydra.yaml"
    hydra_cfg = (yaml.safe_load(hydra_file.read_text()) or {}) if hydra_file.is_file() else {}
    choice = (((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices") or {}).get("data")
    for group in (choice, data.get("source")):
        if group and (REPO / "conf" / "data" / f"{group}.yaml").is_file():
            out.append(f"data={group}")
            break
    for key in ("path", "hf_name", "hf_config", "text_field", "sdist_path", "cache_name", "cache_path"):
        value = data.get(key)
        if value is not None and "${" not in str(value):
            out.append(f"data.{key}={value}")
    out += [o for o in overrides or [] if str(o).startswith(("paths.data_dir=", "paths.root_dir="))]
    return out


def run_eval(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("nats.eval") is None:
        print("[eval] skipped: nats-eval (nats/eval.py) is not in this checkout", flush=True)
        return 0
    out_dir = Path(args.out).resolve()
    todo = []
    for run in finished_runs(out_dir):
        ckpt = run / "checkpoints" / "last.ckpt"
        if (run / "eval").exists() and not args.redo_eval:
            continue
        if not ckpt.is_file():
            print(f"[eval] {run}: no checkpoints/last.ckpt, skipped", flush=True)
            continue
        device = [f"device={'cuda' if args.eval_gpus > 0 else 'cpu'}"] if args.launcher == "submitit_slurm" else []
        todo.append(
            [
                f"ckpt_path={ckpt}",
                f"hydra.run.dir={run / 'eval'}",
                *eval_data_overrides(run),
                *device,
                *args.eval_overrides,
            ]
        )
    cmd = [PY, "-m", "nats.eval"]
    for extra in todo:
        print(f"[eval] {shlex.join(cmd + extra)}", flush=True)
    if args.dry_run or not todo:
        if not todo:
            print("[eval] nothing to evaluate (no finished run without eval/)", flush=True)
        return 0
    if args.launcher == "submitit_slurm":
        import submitit

        executor = submitit.AutoExecutor(folder=str(out_dir / "eval_jobs" / "%j"), cluster="slurm")
        params = dict(
            timeout_min=args.eval_time_min,
            tasks_per_node=1,
            nodes=1,
            cpus_per_task=args.cpus_per_task or 8,
            name="nats-eval",
            slurm_signal_delay_s=60,
        )
        for key, value in (
            ("partition", args.partition),
            ("account", args.account),
            ("qos", args.qos),
            ("constraint", args.constraint),
        ):
            if value is not None:
                params[f"slurm_{key}"] = value
        if args.eval_gpus > 0:
            params["gpus_per_node"] = args.eval_gpus
        if args.mem_gb is not None:
            params["mem_gb"] = args.mem_gb
        if args.setup:
            params["slurm_setup"] = list(args.setup)
        executor.update_parameters(**params)
        fn = submitit.helpers.CommandFunction(cmd, cwd=str(REPO), verbose=True)
        jobs = executor.map_array(fn, *zip(*todo))
        print(f"[eval] submitted {len(jobs)} jobs: {', '.join(j.job_id for j in jobs)}", flush=True)
        rc = 0
        for job in jobs:
            try:
                job.result()
            except Exception as exc:  # one failed evaluation does not stop the others
                print(f"[eval] job {job.job_id} failed: {exc}", flush=True)
                rc = 1
        return rc
    rc = 0
    for extra in todo:  # local: one after the other (each uses the whole GPU / CPU)
        rc = rc or subprocess.call(cmd + extra, cwd=REPO)
    return rc


def run_collect(args: argparse.Namespace) -> int:
    out_dir = Path(args.out).resolve()
    cmd = [PY, str(REPO / "experiments" / "collect.py"), str(out_dir / "train"), "--out", str(out_dir / "results")]
    print(f"[collect] {shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, cwd=REPO)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "logs" / "paper"), help="root of the pipeline's folders")
    ap.add_argument("--stages", nargs="+", choices=("train", "eval", "collect"), default=["train", "eval", "collect"])
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1.0], help="NAtS sparsity weights")
    ap.add_argument("--windows", type=int, nargs="+", default=[16], help="NAtS sliding windows W")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--no-dense", action="store_true", help="no dense baseline")
    ap.add_argument("--nats", nargs="+", default=["experiment=pg19_gpt2_nats"], help="base overrides, NAtS runs")
    ap.add_argument("--dense", nargs="+", default=["experiment=pg19_gpt2_dense"], help="base overrides, dense run")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="submitit_slurm")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--qos")
    ap.add_argument("--constraint", help="e.g. h100")
    ap.add_argument("--time-min", type=int, help="minutes per allocation (the job requeues itself at the limit)")
    ap.add_argument("--mem-gb", type=int)
    ap.add_argument("--cpus-per-task", type=int)
    ap.add_argument("--setup", nargs="+", help="shell lines before srun, e.g. 'source .venv/bin/activate'")
    ap.add_argument("--eval-time-min", type=int, default=240)
    ap.add_argument("--eval-gpus", type=int, default=1, help="GPUs per eval job; 0: a CPU job (device=cpu)")
    ap.add_argument("--eval-overrides", nargs="+", default=[], help="Hydra overrides for nats-eval")
    ap.add_argument("--redo-eval", action="store_true", help="evaluate runs that already have eval/")
    ap.add_argument("--detach", action="store_true", help="return once the training jobs are submitted")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every training run (after --)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.detach and args.launcher != "submitit_slurm":
        raise SystemExit("--detach needs --launcher submitit_slurm (local jobs end with the process that started them)")
    failed = 0
    for stage in [s for s in ("train", "eval", "collect") if s in args.stages]:
        rc = {"train": run_train, "eval": run_eval, "collect": run_collect}[stage](args)
        if stage == "train" and args.detach:
            return rc
        if rc:
            failed = rc
            print(
                f"[{stage}] exit code {rc}"
                + ("; the next stages use the runs that finished" if stage != "collect" else ""),
                flush=True,
            )
    return failed


if __name__ == "__main__":
    sys.exit(main())
