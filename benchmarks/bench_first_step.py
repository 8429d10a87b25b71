"""Time to the first optimizer step of two consecutive `nats-train` runs of one experiment: the first run on a GPU
and Triton version compiles and tunes the Triton kernels, the second should reuse what the first kept.

    python benchmarks/bench_first_step.py --extra data.path=$PWD/data/pg19-subset-src    # fig3_nats, one GPU
    python benchmarks/bench_first_step.py --smoke --out /tmp/first_step                   # CPU, tiny, a minute
    python benchmarks/bench_first_step.py --experiment finetune_smollm2_nats --steps 2    # SmolLM2's scorers

A fine-tune experiment (``finetune_*``: a pretrained model's NAtS scorers) runs with its own micro-batch and global
batch (accumulation over examples of different lengths); ``--extra`` passes its model and data settings
(``hf_model.name_or_path=<folder>``, ``data.pg19_path=<folder>``).

Both runs (`python -m nats.train`, a few steps, as benchmarks/bench_nats_train.py runs it, with its StepTimer) share
a Triton cache folder and an inductor cache folder created empty under the work folder (``--caches fresh``, the
default: the first run is a first run whatever this machine ran before), or use the caches this machine already has
(``--caches default``). Per run: the startup (launch to fit start), the first step (train start to the end of the
first optimizer step: compilation, Triton compiles and autotuning) and whether the run printed the kernels' tuning
line ("nats: tuning the Triton kernels ..."). Writes <out>/bench_first_step_<machine>.{md,json} (machine: h100,
h200, ... from the GPU name; cpu with --smoke).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TUNING_LINE = "nats: tuning the Triton kernels"
TUNED_LINE = "nats: tuned "  # NATS_KERNELS_TUNING_LOG=1
TARGET_S = 15.0  # the second run's first step, on a GPU


def _bench_nats_train():
    spec = importlib.util.spec_from_file_location("bench_nats_train", REPO / "benchmarks" / "bench_nats_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_weights(folder: Path) -> list[str]:
    """The hf_model overrides of a model of `folder`'s shape with random weights: `folder` holds a transformers
    config.json and tokenizer; the weights are written into it once (the first step's kernel work depends on the
    shapes, not on the weights' values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = folder.resolve()
    if not any(folder.glob("*.safetensors")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return [f"hf_model.name_or_path={folder}", "hf_model.gguf_file=null"]


def run_once(bnt, name: str, args, workdir: Path, env: dict) -> dict:
    """One nats-train run into workdir/<name without spaces>: its timings and whether it printed the tuning line."""
    run_dir = workdir / name.replace(" ", "_")
    proc, _, t0, wall = bnt.train_in(run_dir, args.experiment, args, env)
    timer = bnt.read_step_timer(run_dir, 0, args.log_every, 1)
    output = (proc.stdout + proc.stderr).splitlines()
    lines = [line for line in output if TUNING_LINE in line]
    tuned = [line.strip() for line in output if line.startswith(TUNED_LINE)]
    return {
        "run": name,
        "wall_s": wall,
        "startup_s": timer["fit_start_unix"] - t0 if timer else None,
        "first_step_s": timer.get("first_step_s"),
        "tuning_lines": lines,
        "tuned": tuned,  # with NATS_KERNELS_TUNING_LOG=1: each kernel and key benchmarked
    }


def report(runs: list[dict], args, device: str, caches: dict) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        f"# Time to the first step of two consecutive nats-train runs ({device})",
        "",
        f"torch {torch.__version__}, Triton {_triton_version()}; experiment {args.experiment}, {args.steps} steps per "
        f"run; caches: {args.caches} ({', '.join(f'{k}={v}' for k, v in caches.items()) or 'this machine'}).",
        f"Command: `python benchmarks/bench_first_step.py {' '.join(sys.argv[1:])}`",
        *([f"Model: {args.random_model.name}'s shape (its config.json), random weights."] if args.random_model else []),
        "",
        "| run | startup s | first step s (compile, Triton compile and tuning) | printed the tuning line | process s |",
        "|---|---:|---:|---|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {fmt(r['startup_s'])} | {fmt(r['first_step_s'])} | "
            f"{'yes' if r['tuning_lines'] else 'no'} | {fmt(r['wall_s'])} |"
        )
    said = next((line for r in runs for line in r["tuning_lines"]), None)
    if said:
        lines += ["", f"The tuning line: `{said.strip()}`"]
    second = runs[-1]["first_step_s"]
    if not args.smoke and second is not None:
        verdict = "met" if second <= TARGET_S else "not met"
        lines += ["", f"Target: the second run's first step within {TARGET_S:.0f} s: {verdict} ({second:.1f} s)."]
    return "\n".join(lines) + "\n"


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="fig3_nats")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 4; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch = global batch (default 32; smoke 4)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--caches", choices=("fresh", "default"), default="fresh",
                    help="fresh: empty Triton and inductor cache folders shared by the two runs; default: this "
                    "machine's own (TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR as set)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="CPU, model=tiny, data=gutenberg, no compile")
    ap.add_argument("--extra", nargs="*", default=[], help="more nats-train overrides, e.g. data.path=...")
    ap.add_argument("--random-model", type=Path, default=None,
                    help="fine-tune experiments: a folder with a transformers config.json and tokenizer; the runs use "
                    "a model of that shape with random weights (written into the folder once)")  # fmt: skip
    ap.add_argument("--machine", default=None, help="names the result files (default: from the GPU name)")
    ap.add_argument("--out", default="logs/bench/first_step")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per nats-train run")
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 4)
    args.batch = args.batch or (4 if args.smoke else 32)
    args.log_every, args.eval_windows = args.steps, 8 if args.smoke else 64
    if args.random_model is not None:
        args.extra = random_weights(args.random_model) + list(args.extra)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on a CPU")
    bnt = _bench_nats_train()
    machine = args.machine or bnt.machine_name()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "CPU (smoke)"
    out = Path(args.out)
    workdir = out / "bench_first_step_runs"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PROJECT_ROOT", str(REPO))
    caches = {}
    if args.caches == "fresh":
        for var, folder in (("TRITON_CACHE_DIR", "triton_cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor_cache")):
            path = (workdir / folder).resolve()
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            env[var] = caches[var] = str(path)
    runs = []
    for name in ("first run", "second run"):
        runs.append(run_once(bnt, name, args, workdir, env))
        print(json.dumps(runs[-1]), flush=True)
    table = report(runs, args, device, caches)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_first_step_{machine}.md").write_text(table)
    (out / f"bench_first_step_{machine}.json").write_text(
        json.dumps(
            {
                "device": device,
                "machine": machine,
                "torch": torch.__version__,
                "triton": _triton_version(),
                "args": vars(args),
                "caches": caches,
                "runs": runs,
            },
            indent=1,
            default=str,
        )
        + "\n"  # fmt: skip
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
