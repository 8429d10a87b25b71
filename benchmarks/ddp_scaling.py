r"""4-GPU DDP against 1 GPU, the paper's pre-training step (GPT-2-small, context 1024, global batch 480).

    python3 benchmarks/ddp_scaling.py --out logs/bench/ddp            # NAtS (falls back to dense if it fails)
    python3 benchmarks/ddp_scaling.py --out logs/bench/ddp --experiment pg19_gpt2_dense --compile

On a machine without a package index, install the Hydra stack from a folder of wheels first (as
benchmarks/gpu_site.sh does with WHEELS=<folder>).

Runs ``python3 -m nats.train experiment=<exp> data=gutenberg`` twice, through the real Hydra/Lightning stack:

1. ``trainer=ddp`` on 4 GPUs (Lightning DDP, one process per GPU), ``--steps`` optimizer steps (default 200) at
   global batch 480 = micro-batch x 4 GPUs x accumulation (40 x 4 x 3 by default);
2. ``trainer=gpu`` on 1 GPU, the same micro-batch with 4x the accumulation (40 x 1 x 12), so the same 480
   sequences per optimizer step (the sampler draws the same global samples per step for any number of
   processes) and the same learning-rate schedule (``optim.max_steps`` = the 4-GPU run's steps), for as many
   steps as the time budget leaves (at most ``--steps``).

Tokens/s come from Lightning's ThroughputMonitor (``train/items_per_sec``, all GPUs together, synchronised
timing), the median over the logged values after the first quarter of the run (compilation, Triton JIT and
data-loader start-up excluded). The loss curves (``train/loss`` every 10 steps) of both runs are printed side by
side; the final validation loss of each run on the same 64 validation windows is printed too.

Before that a preflight (one forward/backward of GPT-2-small with the chosen attention and micro-batch on one GPU,
~30 s) checks that the step works: on CUDA out-of-memory it halves the micro-batch, on any other error it
switches to the dense experiment, and says so. Total wall time stays under ``--budget-s`` (default 420 s).

Writes ``ddp_scaling.{md,json}`` and ``ddp_scaling_loss.png`` into ``--out``, the runs' folders (CSV logs, Hydra
config) into ``--out/runs/``.

``--cpu-smoke`` runs the same pipeline on CPU (2 processes with gloo vs 1, the tiny model), to test the script.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 480


def log(msg: str) -> None:
    print(msg, flush=True)


def python_env() -> dict[str, str]:
    """The environment of the child processes: the repo importable (the project installed: ``pip install -e .``)."""
    if importlib.util.find_spec("nats_kernels") is None:
        raise SystemExit("install the project first: pip install -e . (make setup does)")
    env = dict(os.environ, PROJECT_ROOT=str(REPO), PYTHONUNBUFFERED="1")
    paths = [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_cmd(cmd: list[str], timeout: float, log_file: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run ``cmd`` in its own process group (DDP children included), output to ``log_file``; kill the group at
    ``timeout``. Returns (exit code, wall seconds)."""
    t0 = time.time()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    return rc, time.time() - t0


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------- preflight
PREFLIGHT = r"""
import sys, time, torch
import hydra
from nats.train import compose_config
cfg = compose_config(sys.argv[1:])
module = hydra.utils.instantiate(cfg.module, _convert_="all")
model = module.model.cuda()
B, N = int(cfg.data.micro_batch_size), int(cfg.model.block_size)
x = torch.randint(0, 50257, (B, N + 1), device="cuda")
t0 = time.time()
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x[:, :-1], x[:, 1:])
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    loss.backward()
torch.cuda.synchronize()
from nats.functional import triton_available
print(f"PREFLIGHT_OK loss={loss.item():.3f} peak_mem_gb={torch.cuda.max_memory_allocated() / 2**30:.1f} "
      f"s={time.time() - t0:.1f} triton={triton_available()}")
"""


def preflight(
    experiment: str, micro: int, devices: int, out: Path, env: dict[str, str], timeout: float
) -> tuple[str, int, str]:
    """(experiment, micro-batch, note) that work on one GPU: halve the micro-batch on OOM, dense on other errors."""
    notes = []
    while True:
        overrides = [f"experiment={experiment}", "data=gutenberg", f"data.micro_batch_size={micro}"]
        rc, secs = run_cmd([sys.executable, "-c", PREFLIGHT, *overrides], timeout, out / "preflight.log", env)
        text = (out / "preflight.log").read_text(errors="replace")
        ok = [ln for ln in text.splitlines() if ln.startswith("PREFLIGHT_OK")]
        if rc == 0 and ok and "nats" in experiment and "triton=False" in ok[0]:
            # without the fused kernels NAtS runs its O(N^2)-memory PyTorch reference: not a throughput test
            notes.append(f"{experiment}: the Triton NAtS kernels do not load here, using pg19_gpt2_dense")
            log(notes[-1])
            experiment = "pg19_gpt2_dense"
            continue
        if rc == 0 and ok:
            log(f"preflight {experiment} micro-batch {micro}: {ok[0]} ({secs:.0f}s with start-up)")
            return experiment, micro, "; ".join(notes)
        if "OutOfMemoryError" in text or "out of memory" in text:
            if micro <= 4:
                raise SystemExit(f"preflight: out of memory at micro-batch {micro}:\n{tail(out / 'preflight.log')}")
            new = max(d for d in range(1, micro // 2 + 1) if GLOBAL_BATCH % (devices * d) == 0)
            notes.append(f"micro-batch {micro} ran out of GPU memory, using {new}")
            log(notes[-1])
            micro = new
            continue
        if experiment != "pg19_gpt2_dense":
            notes.append(f"{experiment} failed the preflight (see preflight.log), using pg19_gpt2_dense")
            log(notes[-1] + ":\n" + tail(out / "preflight.log", 15))
            (out / f"preflight_{experiment}.log").write_text(text)
            experiment = "pg19_gpt2_dense"
            continue
        raise SystemExit(f"preflight failed for {experiment}:\n{tail(out / 'preflight.log')}")


# ---------------------------------------------------------------------------------------------------- runs
def train_overrides(
    args: argparse.Namespace, experiment: str, micro: int, devices: int, steps: int, run_dir: Path
) -> list[str]:
    if args.cpu_smoke:
        base = [
            "model.block_size=64",
            "data.num_workers=0",
            "trainer=ddp" if devices > 1 else "trainer=cpu",
            "trainer.accelerator=cpu",
            f"trainer.devices={devices}",
            "trainer.precision=32-true",
            "data.max_eval_windows=8",
            f"optim.warmup_steps={args.warmup}",
        ]
        if devices == 1:
            base.remove("trainer.accelerator=cpu")
    else:
        base = [
            f"experiment={experiment}",
            f"data={args.data}",
            "data.num_workers=4",
            "data.max_eval_windows=64",
            "trainer=ddp" if devices > 1 else "trainer=gpu",
            f"trainer.devices={devices}",
            f"compile={str(args.compile).lower()}",
            f"optim.warmup_steps={args.warmup}",
        ]
    return base + [
        f"data.micro_batch_size={micro}",
        f"global_batch_size={args.global_batch}",
        f"trainer.max_steps={steps}",
        f"optim.max_steps={args.steps}",
        f"eval_every={args.eval_every}",
        "final_validation=false",
        "ckpt_path=null",
        "logger=csv",
        f"trainer.log_every_n_steps={args.log_every}",
        f"+logger.csv.flush_logs_every_n_steps={args.log_every}",  # a killed run keeps its curve so far
        "callbacks.progress_bar=null",
        "trainer.enable_progress_bar=false",
        # no checkpoints: every checkpoint callback of conf/callbacks/default.yaml off, then Lightning's own
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint=null",
        "callbacks.interrupt_checkpoint=null",
        "+trainer.enable_checkpointing=false",
        "callbacks.throughput.window_size=2",  # timing points: the rate over the last logging interval
        f"paths.data_dir={args.data_dir}",
        f"hydra.run.dir={run_dir}",
        *args.extra,
    ]


def read_run(run_dir: Path, steps: int) -> dict:
    """Loss curve, tokens/s (median after the first quarter) and the validation loss of a finished run."""
    files = list((run_dir / "csv").rglob("metrics.csv"))
    if not files:
        return {}
    with open(files[0], newline="") as f:
        rows = list(csv.DictReader(f))
    loss, val = {}, {}
    tps, tps_dev = [], []
    for r in rows:
        step = int(r["step"]) + 1 if r.get("step") else None  # Lightning logs the 0-based step index
        if r.get("train/loss"):
            loss[step] = float(r["train/loss"])
        if step is not None and step > steps // 4:
            if r.get("train/items_per_sec"):
                tps.append(float(r["train/items_per_sec"]))
            if r.get("train/device/items_per_sec"):
                tps_dev.append(float(r["train/device/items_per_sec"]))
        if r.get("val/loss"):
            val[step] = float(r["val/loss"])
    metrics = json.loads((run_dir / "metrics.json").read_text()) if (run_dir / "metrics.json").is_file() else {}
    world = int(metrics.get("world_size") or 1)
    per_gpu = statistics.median(tps_dev) if tps_dev else math.nan
    # Lightning logs the all-GPU figure only for several processes; for one it is the per-device one
    total = statistics.median(tps) if tps else per_gpu * world
    return {
        "loss": dict(sorted(loss.items())),
        "val_loss": dict(sorted(val.items())),
        "tokens_per_s": total,
        "tokens_per_s_per_gpu": per_gpu,
        "steps": metrics.get("global_step"),
        "accumulation": metrics.get("accumulate_grad_batches"),
        "world_size": world,
    }


def report(results: dict, args: argparse.Namespace, notes: list[str], out: Path, command: str = "") -> str:
    r4, r1 = results.get("ddp"), results.get("single")
    n = args.devices
    lines = [
        f"# DDP scaling: {results['experiment']} on {args.data}, global batch {args.global_batch} x "
        f"{results['block_size']} tokens",
        "",
    ]
    both = r4 and r1 and r4.get("loss") and r1.get("loss")
    if both:  # the answer first: the speed-up, and the validation loss of both runs at their last common step
        speedup = r4["tokens_per_s"] / r1["tokens_per_s"]
        results["speedup"] = speedup
        common = sorted(set(r4["val_loss"]) & set(r1["val_loss"]))
        val = (
            f" Validation loss at step {common[-1]} (the same windows): {r4['val_loss'][common[-1]]:.3f} on {n} GPUs, "
            f"{r1['val_loss'][common[-1]]:.3f} on 1."
            if common
            else ""
        )
        lines += [
            f"**Speed-up {n} GPUs / 1 GPU: {speedup:.2f}x** (tokens/s; {100 * speedup / n:.0f}% scaling "
            f"efficiency; target >= {args.target if args.target else 0.875 * n:.2f}x).{val}",
            "",
        ]
    lines += [
        "| GPUs | steps | accumulation | tokens/s (all GPUs) | tokens/s per GPU | first loss | last loss | "
        "val loss | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, gpus in (("ddp", n), ("single", 1)):
        r = results.get(key)
        if not r or not r.get("loss"):
            lines.append(f"| {gpus} | failed (exit code {results.get(key + '_rc')}) | | | | | | | |")
            continue
        steps = sorted(r["loss"])
        last_val = r["val_loss"][max(r["val_loss"])] if r["val_loss"] else math.nan
        lines.append(
            f"| {gpus} | {r['steps']} | {r['accumulation']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['loss'][steps[0]]:.3f} (step {steps[0]}) | "
            f"{r['loss'][steps[-1]]:.3f} (step {steps[-1]}) | {last_val:.3f} | "
            f"{results[key + '_wall_s']:.0f} |"
        )
    lines += [
        "",
        f"{date.today().isoformat()}, {results.get('device', '?')}; micro-batch {results['micro']}; "
        f"compile={args.compile}; {args.steps} planned steps, LR warm-up {args.warmup} then cosine over {args.steps}."
        + (f" Command: `{command}`." if command else ""),
    ]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    if both:
        lines += [
            "",
            "## Losses at the same optimizer steps",
            "",
            f"The same {args.global_batch} sequences per step in both runs. Validation loss: the same validation "
            "windows, so the two columns should agree up to bf16 rounding. Train loss: Lightning logs rank 0's last "
            "micro-batch, which holds different sequences in the two runs, so those agree only up to batch noise.",
            "",
            f"| step | val loss, {n} GPUs | val loss, 1 GPU | train loss, {n} GPUs | train loss, 1 GPU |",
            "|---|---|---|---|---|",
        ]

        def f3(x):
            return "" if x is None else f"{x:.3f}"

        for s in sorted(set(r4["loss"]) | set(r1["loss"]) | set(r4["val_loss"]) | set(r1["val_loss"])):
            lines.append(
                f"| {s} | {f3(r4['val_loss'].get(s))} | {f3(r1['val_loss'].get(s))} | "
                f"{f3(r4['loss'].get(s))} | {f3(r1['loss'].get(s))} |"
            )
        lines += ["", "![train loss of both runs](ddp_scaling_loss.png)"]
    text = "\n".join(lines) + "\n"
    (out / "ddp_scaling.md").write_text(text)
    (out / "ddp_scaling.json").write_text(
        json.dumps({**results, "notes": notes, "args": vars(args)}, indent=2, default=str)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("ddp", f"{n} GPUs (DDP)"), ("single", "1 GPU")):
            r = results.get(key)
            if r and r.get("loss"):
                ax.plot(list(r["loss"]), list(r["loss"].values()), marker=".", label=label)
        ax.set_xlabel(f"optimizer step ({args.global_batch} sequences)")
        ax.set_ylabel("train loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ddp_scaling_loss.png", dpi=120)
        plt.close(fig)
    except Exception as exc:  # matplotlib missing on the GPU machine: the table is enough
        log(f"no plot: {exc}")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "ddp_scaling"))
    ap.add_argument("--experiment", default="pg19_gpt2_nats")
    ap.add_argument("--micro", type=int, default=40, help="micro-batch per GPU (40 fits an H100/H200 easily)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of the multi-GPU run")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--data", default="gutenberg", help="the data config of both runs (e.g. pg19_subset)")
    ap.add_argument(
        "--extra", nargs="*", default=[], help="more nats-train overrides for both runs (e.g. data.path=...)"
    )
    ap.add_argument("--single-from", default=None, help="take the 1-GPU run from this ddp_scaling.json (same settings)")
    ap.add_argument("--target", type=float, default=None, help="the speed-up target (default 0.875 x GPUs)")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=25, help="validate every this many steps (both runs)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (adds ~1 min per run)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="total wall-time budget")
    ap.add_argument("--min-single-steps", type=int, default=25)
    ap.add_argument("--data-dir", default=str(REPO / "data"))
    ap.add_argument("--no-preflight", action="store_true")
    ap.add_argument(
        "--no-autotune",
        action="store_true",
        help="NATS_KERNELS_AUTOTUNE=0: the NAtS kernels' first config, no autotuning at start-up",
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, gloo: tests the script")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "benchmarks/ddp_scaling.py", *(sys.argv[1:] if argv is None else argv)])
    t_start = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = python_env()
    if args.no_autotune:
        env["NATS_KERNELS_AUTOTUNE"] = "0"
    if args.cpu_smoke:
        env.update(OMP_NUM_THREADS="1")
        args.warmup = min(args.warmup, 2)
    notes: list[str] = []
    experiment, micro = args.experiment, args.micro
    results: dict = {"experiment": "tiny (cpu smoke)" if args.cpu_smoke else experiment}
    if not args.cpu_smoke:
        import torch

        n_gpu = torch.cuda.device_count()
        results["device"] = f"{n_gpu} x {torch.cuda.get_device_name(0)}" if n_gpu else "no GPU"
        log(f"== {results['device']}, torch {torch.__version__}")
        if n_gpu < args.devices:
            raise SystemExit(f"needs {args.devices} GPUs, found {n_gpu}")
        if not args.no_preflight:
            experiment, micro, note = preflight(experiment, micro, args.devices, out, env, timeout=180)
            if note:
                notes.append(note)
        results["experiment"] = experiment
    results["micro"] = micro
    results["block_size"] = 64 if args.cpu_smoke else 1024
    for n in (args.devices, 1):
        if args.global_batch % (micro * n):
            raise SystemExit(f"global batch {args.global_batch} is not divisible by micro-batch {micro} x {n}")

    # 1. the multi-GPU run
    ddp_dir = out / "runs" / f"ddp{args.devices}"
    cmd = [
        sys.executable,
        "-m",
        "nats.train",
        *train_overrides(args, experiment, micro, args.devices, args.steps, ddp_dir),
    ]
    log(f"== {args.devices} GPUs: {' '.join(cmd[3:])}")
    left = args.budget_s - (time.time() - t_start)
    rc, wall = run_cmd(cmd, timeout=left * 0.6, log_file=out / "ddp.log", env=env)
    results.update(ddp_rc=rc, ddp_wall_s=wall, ddp=read_run(ddp_dir, args.steps))
    log(f"exit code {rc} after {wall:.0f}s")
    if rc != 0:
        log(tail(out / "ddp.log"))
    r4 = results["ddp"]

    if args.single_from:  # the 1-GPU run of an earlier call with the same settings
        prev = json.loads(Path(args.single_from).read_text())
        for curve in ("loss", "val_loss"):  # JSON object keys are strings; steps are ints
            prev["single"][curve] = {int(k): v for k, v in prev["single"][curve].items()}
        results.update(single_rc=prev["single_rc"], single_wall_s=prev["single_wall_s"], single=prev["single"])
        notes.append(f"the 1-GPU run is the one of {args.single_from}")
        log(report(results, args, notes, out, command))
        return 0 if results["ddp_rc"] == 0 else 1

    # 2. the 1-GPU run, as many steps as the budget leaves
    left = args.budget_s - (time.time() - t_start) - 20
    per_dev = r4.get("tokens_per_s_per_gpu", math.nan) if r4 else math.nan
    tokens_per_step = args.global_batch * results["block_size"]
    if per_dev == per_dev and per_dev > 0:
        step_s = tokens_per_step / per_dev  # one GPU does all of a step at about one DDP rank's speed
        start_s = min(90.0, max(20.0, wall - args.steps * step_s / args.devices))  # start-up of the DDP run
        steps1 = int((left - start_s) / (1.1 * step_s))
    else:
        steps1 = args.steps // 4
    unit = args.eval_every  # whole validation intervals, so that the last step is validated
    steps1 = max(min(args.min_single_steps, args.steps), min(args.steps, steps1 // unit * unit))
    single_dir = out / "runs" / "gpu1"
    cmd = [sys.executable, "-m", "nats.train", *train_overrides(args, experiment, micro, 1, steps1, single_dir)]
    log(f"== 1 GPU, {steps1} steps: {' '.join(cmd[3:])}")
    rc, wall = run_cmd(
        cmd, timeout=max(60.0, args.budget_s - (time.time() - t_start)), log_file=out / "gpu1.log", env=env
    )
    results.update(single_rc=rc, single_wall_s=wall, single=read_run(single_dir, steps1))
    log(f"exit code {rc} after {wall:.0f}s")
    if rc != 0:
        log(tail(out / "gpu1.log"))
    if steps1 < args.steps:
        notes.append(
            f"the 1-GPU run did {steps1} of the {args.steps} steps (time budget); tokens/s, a rate, still compare"
        )

    log(report(results, args, notes, out, command))
    log(f"total {time.time() - t_start:.0f}s; outputs in {out}")
    ok = results["ddp_rc"] == 0 and results["single_rc"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
