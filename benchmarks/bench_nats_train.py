"""Training throughput of the path users run, `nats-train`, next to the isolated step.

    python benchmarks/bench_nats_train.py --extra data.path=$PWD/data/pg19-subset-src     # one GPU
    python benchmarks/bench_nats_train.py --smoke --out /tmp/bench                          # CPU, tiny, minutes

For each experiment (default: fig3_dense and fig3_nats: GPT-2-small, PG-19 subset, micro-batch = global batch 32
x 1024, bf16, compiled), one after the other, this runs `python -m nats.train` as a subprocess with the
experiment's own callbacks (checkpointing, TokenThroughput, progress bar, the tau schedule) plus the StepTimer
(conf/callbacks/step_timer.yaml), the CSV + TensorBoard loggers, validation at the last step and the final
validation, and `TORCH_LOGS=recompiles`. Read back:

* tokens/s of the ThroughputMonitor (`train/items_per_sec` of the CSV log), over the logging intervals after
  `--warmup-steps` (median and mean);
* tokens/s from the StepTimer between the first logged step after the warm-up and the last logged step (the
  monitor synchronises the device on logged steps, so both ends are exact);
* startup (launch to fit start: imports, data, model), the first optimizer step (compilation), the first
  validation (its compilation), the whole process;
* the number of "Recompiling function" lines in the subprocess' stderr, with their reasons.

Then benchmarks/bench_train.py's isolated step (random tokens, no Lightning) for the same model configs in this
process, and a table: isolated vs nats-train tokens/s, nats-train / isolated, NAtS / dense through nats-train.
Writes <out>/bench_nats_train_<machine>.md and .json (machine: h100, h200, ... from the GPU name; cpu with
--smoke) and keeps the run folders under <out>/bench_nats_train_runs/ (or --workdir).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def machine_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else name.split()[-1]).lower()


def compose(overrides: list[str]):
    from nats.train import compose_config

    return compose_config(overrides)


def train_overrides(exp: str, args, run_dir: Path) -> list[str]:
    """The nats-train overrides of one benchmark run."""
    cfg = compose([f"experiment={exp}"])
    callbacks = ["default"] + (["tau_schedule"] if "tau_schedule" in (cfg.get("callbacks") or {}) else [])
    steps = args.steps
    out = [
        f"experiment={exp}",
        f"hydra.run.dir={run_dir}",
        f"callbacks=[{','.join(callbacks + ['step_timer'])}]",
        "logger=tensorboard_csv",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={args.log_every}",
        f"eval_every={steps}",
    ]
    if exp.startswith("finetune_"):  # a pretrained model's scorers (nats.finetune): no native model or windows to
        # size; one validation example per task; the experiment's own micro-batch (1) and accumulation
        device = "trainer=cpu" if args.smoke else "trainer=gpu"
        return out + ["final_validation=false", "data.num_val_examples=1", device, *args.extra]
    out += ["final_validation=true", f"data.max_eval_windows={args.eval_windows}"]
    if "tau_schedule" in callbacks:  # the schedule over this run, as a fig3 run anneals over its own max_steps
        out.append(f"callbacks.tau_schedule.steps={steps}")
    if args.smoke:
        out += [
            "model=tiny",
            "data=gutenberg",
            "trainer=cpu",
            "compile=false",
            "data.num_workers=0",
            f"data.micro_batch_size={args.batch}",
            f"global_batch_size={args.batch}",
            f"paths.data_dir={REPO / 'data'}",
        ]
    else:
        out += [
            "trainer=gpu",
            "compile=true",
            f"data.micro_batch_size={args.batch}",
            f"global_batch_size={args.batch}",
            f"model.block_size={args.seq}",
        ]
    return out + list(args.extra)


def read_csv_throughput(run_dir: Path, warmup_steps: int, log_every: int) -> dict:
    """tokens/s rows of the CSV log (`train/items_per_sec`, one device: `train/device/items_per_sec`) whose
    interval starts at or after warmup_steps."""
    path = run_dir / "csv" / "metrics.csv"
    rows = []
    if path.is_file():
        with open(path) as f:
            for r in csv.DictReader(f):
                v = r.get("train/items_per_sec") or r.get("train/device/items_per_sec")  # world > 1 / one device
                if v not in (None, ""):
                    rows.append((int(r["step"]) + 1, float(v)))  # CSV step = optimizer steps done - 1
    after = [v for step, v in rows if step - log_every >= warmup_steps]
    return {
        "all": rows,
        "after_warmup": after,
        "median": statistics.median(after) if after else float("nan"),
        "mean": statistics.fmean(after) if after else float("nan"),
    }


def read_step_timer(run_dir: Path, warmup_steps: int, log_every: int, tokens_per_step: int) -> dict:
    path = run_dir / "step_times.json"
    if not path.is_file():
        return {}
    t = json.loads(path.read_text())
    steps, ends = t["steps"], t["step_end"]
    out = {
        "fit_start_unix": t["fit_start_unix"],
        "train_start_s": t["train_start"],
        "first_step_s": ends[0] - t["train_start"] if ends else float("nan"),
        "first_val_s": (t["val"][0][1] - t["val"][0][0]) if t["val"] and t["val"][0][1] else float("nan"),
        "steps": len(steps),
    }
    # logged steps (global_step a multiple of log_every): the monitor synchronised there
    logged = [(s, e) for s, e in zip(steps, ends) if s % log_every == 0 and s >= warmup_steps]
    if len(logged) >= 2:
        (s0, e0), (s1, e1) = logged[0], logged[-1]
        out.update(
            rate_from_step=s0,
            rate_to_step=s1,
            tokens_per_s=(s1 - s0) * tokens_per_step / (e1 - e0),
            ms_per_step=1e3 * (e1 - e0) / (s1 - s0),
        )
    return out


def recompiles(stderr: str) -> dict:
    lines = stderr.splitlines()
    hits = [i for i, line in enumerate(lines) if "Recompiling function" in line]
    reasons = []
    for i in hits:  # the function and the guard failures that follow it
        block = [lines[i].split("[__recompiles]")[-1].strip()]
        for line in lines[i + 1 : i + 6]:
            if "[__recompiles]" in line and "Recompiling function" not in line:
                block.append(line.split("[__recompiles]")[-1].strip())
            else:
                break
        reasons.append(" | ".join(block))
    return {"count": len(hits), "reasons": reasons}


def train_in(run_dir: Path, exp: str, args, env: dict) -> tuple[subprocess.CompletedProcess, list[str], float, float]:
    """`python -m nats.train` of experiment `exp` with the benchmark's overrides (`train_overrides`) in a fresh
    `run_dir`: the finished process (its output also in run_dir/bench_stdout.log, bench_stderr.log), the overrides,
    the start time and the wall-clock seconds. A failed run prints the end of its output and raises."""
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    overrides = train_overrides(exp, args, run_dir)
    cmd = [sys.executable, "-m", "nats.train", *overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    (run_dir / "bench_stdout.log").write_text(proc.stdout)
    (run_dir / "bench_stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
        raise RuntimeError(f"nats-train {exp} failed (exit {proc.returncode}); logs in {run_dir}")
    return proc, overrides, t0, wall


def run_nats_train(exp: str, args, workdir: Path) -> dict:
    run_dir = workdir / exp
    saved = run_dir / "bench_result.json"
    if args.reuse and saved.is_file():  # measured by an earlier call (e.g. one device call per phase)
        print(f"reusing {saved}", flush=True)
        return json.loads(saved.read_text())
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHONUNBUFFERED="1")
    env.setdefault("PROJECT_ROOT", str(REPO))
    proc, overrides, t0, wall = train_in(run_dir, exp, args, env)
    from omegaconf import OmegaConf

    cfg = compose([f"experiment={exp}", *[o for o in overrides if not o.startswith("hydra.")]])
    tokens_per_step = int(cfg.global_batch_size) * int(cfg.data.block_size or cfg.model.block_size)
    timer = read_step_timer(run_dir, args.warmup_steps, args.log_every, tokens_per_step)
    res = {
        "experiment": exp,
        "attention": cfg.model.attention.name,
        "overrides": overrides,
        "wall_s": wall,
        "tokens_per_step": tokens_per_step,
        "monitor": read_csv_throughput(run_dir, args.warmup_steps, args.log_every),
        "timer": timer,
        "recompiles": recompiles(proc.stderr),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
    }
    if timer:
        res["startup_s"] = timer["fit_start_unix"] - t0
    saved.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return res


def run_isolated(res: dict, args) -> dict:
    """benchmarks/bench_train.py's step for the same model config, in this process."""
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "benchmarks" / "bench_train.py")
    bench_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_train)
    model_cfg = dict(res["model"])
    seq = int(model_cfg.get("block_size", args.seq)) if args.smoke else args.seq
    try:
        r = bench_train.bench(
            model_cfg["attention"],
            args.batch,
            seq,
            args.isolated_steps,
            args.isolated_warmup,
            compile=not args.smoke,
            model_cfg=model_cfg,
        )
    finally:
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    r.pop("profile", None)
    return r


def fmt(x, spec=",.0f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def report(results: list[dict], args, machine: str, device: str, command: str = "") -> str:
    def iso_of(x):
        return x.get("isolated", {}).get("tokens_per_s", float("nan"))

    def timer_of(x):
        return x["timer"].get("tokens_per_s", float("nan"))

    def monitor_of(x):
        return x["monitor"]["median"]

    dense = next((r for r in results if r["attention"] == "dense"), None)

    def ratio(r, get):
        a, b = get(r), get(dense)
        return a / b if a == a and b == b and b else float("nan")

    # the answer first: each model against dense (through nats-train and isolated), against its isolated step
    answer = [
        f"{r['experiment']} / {dense['experiment']} tokens/s through nats-train: {fmt(ratio(r, monitor_of), '.3f')} "
        f"(throughput monitor), {fmt(ratio(r, timer_of), '.3f')} (step timer); isolated steps "
        f"{fmt(ratio(r, iso_of), '.3f')}."
        for r in results
        if dense is not None and r is not dense
    ]
    answer.append(
        "nats-train / isolated: "
        + ", ".join(f"{r['experiment']} {fmt(monitor_of(r) / iso_of(r), '.3f')}" for r in results)
        + "; recompiles: "
        + ", ".join(f"{r['experiment']} {r['recompiles']['count']}" for r in results)
        + ". Targets (one H100): dense nats-train / isolated >= 0.97; NAtS / dense via nats-train >= 0.90 "
        "(moonshot 0.95); no recompiles."
    )
    lines = [
        f"# nats-train vs the isolated step ({device})",
        "",
        *answer,
        "",
        "| experiment | isolated tok/s | nats-train tok/s (monitor, median) | nats-train tok/s (step timer) | "
        "nats-train / isolated | startup s | first step s (compile) | first validation s | recompiles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        iso, mon, tim = iso_of(r), monitor_of(r), timer_of(r)
        lines.append(
            f"| {r['experiment']} | {fmt(iso)} | {fmt(mon)} | {fmt(tim)} | {fmt(mon / iso, '.3f')} | "
            f"{fmt(r.get('startup_s'), '.1f')} | {fmt(r['timer'].get('first_step_s'), '.1f')} | "
            f"{fmt(r['timer'].get('first_val_s'), '.1f')} | {r['recompiles']['count']} |"
        )
    lines += [
        "",
        f"{date.today().isoformat()}, {device}, torch {torch.__version__}; micro-batch = global batch {args.batch}, "
        f"{'N = model block size' if args.smoke else f'N = {args.seq}'}; {args.steps} steps through "
        f"nats-train, log every {args.log_every}, warm-up excluded: {args.warmup_steps} steps; isolated: "
        f"{args.isolated_steps} steps after {args.isolated_warmup} (benchmarks/bench_train.py)."
        + (f" Command: `{command}`." if command else ""),
    ]
    recomp = [(r["experiment"], reason) for r in results for reason in r["recompiles"]["reasons"]]
    if recomp:
        lines += ["", "Recompiles (TORCH_LOGS=recompiles):", ""] + [f"* {e}: {why}" for e, why in recomp]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", nargs="+", default=["fig3_dense", "fig3_nats"])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 200; smoke 6)")
    ap.add_argument("--log-every", type=int, default=None, help="trainer.log_every_n_steps (default 10; smoke 2)")
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps left out of the rates (compile, autotuning; default 50; smoke 2)",
    )
    ap.add_argument("--batch", type=int, default=None, help="micro-batch = global batch (default 32; smoke 4)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eval-windows", type=int, default=None, help="data.max_eval_windows (default 64; smoke 8)")
    ap.add_argument("--isolated-steps", type=int, default=None, help="(default 30; smoke 3)")
    ap.add_argument("--isolated-warmup", type=int, default=None, help="(default 5; smoke 1)")
    ap.add_argument("--no-isolated", action="store_true", help="skip benchmarks/bench_train.py's step")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, model=tiny, data=gutenberg, trainer=cpu, no compile, a few steps (tests the wiring)",
    )
    ap.add_argument("--extra", nargs="*", default=[], help="more nats-train overrides, e.g. data.path=...")
    ap.add_argument("--machine", default=None, help="names the result files (default: from the GPU name)")
    ap.add_argument("--out", default=str(REPO / "docs" / "results"))
    ap.add_argument("--workdir", default=None, help="run folders (default <out>/bench_nats_train_runs)")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="read the nats-train results of runs already in --workdir (bench_result.json) instead of "
        "running them again: e.g. a first call with --no-isolated, a second with --reuse",
    )
    ap.add_argument("--no-table", action="store_true", help="measure only (with --no-isolated: the first phase)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per nats-train run")
    args = ap.parse_args()
    small = args.smoke
    # the settings left unset: (a measurement's default, the smoke run's)
    unset = dict(steps=(200, 6), log_every=(10, 2), warmup_steps=(50, 2), batch=(32, 4), eval_windows=(64, 8),
                 isolated_steps=(30, 3), isolated_warmup=(5, 1))  # fmt: skip
    for name, (default, smoke) in unset.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if small else default)
    if args.steps % args.log_every:
        raise SystemExit("--steps must be a multiple of --log-every (the rates end at a logged step)")
    if not small and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on a CPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    machine = args.machine or machine_name()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not small else "CPU (smoke)"
    out = Path(args.out)
    workdir = Path(args.workdir) if args.workdir else out / "bench_nats_train_runs"
    results = []
    for exp in args.experiments:
        res = run_nats_train(exp, args, workdir)
        print(
            json.dumps(
                {k: res[k] for k in ("experiment", "wall_s", "startup_s") if k in res}
                | {
                    "monitor_median": res["monitor"]["median"],
                    "timer": res["timer"],
                    "recompiles": res["recompiles"]["count"],
                }
            ),
            flush=True,
        )
        results.append(res)
    if not args.no_isolated:
        for res in results:
            res["isolated"] = run_isolated(res, args)
            print(json.dumps({"experiment": res["experiment"], "isolated": res["isolated"]}), flush=True)
    if args.no_table:
        return
    command = shlex.join(["python", "benchmarks/bench_nats_train.py", *sys.argv[1:]])
    table = report(results, args, machine, device, command)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_nats_train_{machine}.md").write_text(table)
    (out / f"bench_nats_train_{machine}.json").write_text(
        json.dumps(
            {"device": device, "machine": machine, "torch": torch.__version__, "args": vars(args), "results": results},
            indent=1,
            default=str,
        )
        + "\n"
    )
    print(table)


if __name__ == "__main__":
    main()
