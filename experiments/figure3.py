"""The NAtS paper's Figure 3 at reduced scale (issue 13): perplexity against KV-cache size for NAtS and for the
KV-cache baselines (StreamingLLM, H2O) applied to a dense model, GPT-2-small at N = 1024 on the PG-19 subset.

The study runs on one GPU in resumable pieces of at most ~10 minutes (``--budget-s``); every subcommand can be
repeated and picks up where the last one stopped:

    python experiments/figure3.py train  --runs dense nats_l0 nats_l1 [--seeds 1 2] [--budget-s 540]
    python experiments/figure3.py status
    python experiments/figure3.py eval   --runs dense nats_l1 [--budget-s 540]
    python experiments/figure3.py pack   --out $OUT/figure3.tar.gz     # the small result files, for another machine
    python experiments/figure3.py report --root experiments/results/figure3 --packed a.tar.gz b.tar.gz --out docs/results

``train`` prepares the token cache once, then starts every run that is neither finished nor already running as
a background process of its own session (``nats-train experiment=fig3_dense|fig3_nats ...`` with its own run
folder ``<root>/<run>``), so that several models share the GPU (their host-side work overlaps) and a run
outlives the command that started it. A run that stopped (machine lost, killed) restarts from its
``checkpoints/last.ckpt`` (written at every validation; ``ckpt_path=auto``). ``train`` then waits, printing a
status table every minute, until all its runs have finished or ``--budget-s`` has passed.

``eval`` runs ``nats-eval`` on finished runs, also in the background and resumably: the dense models with the
full cache, StreamingLLM and H2O (token-by-token, as the spec defines it) at N/2 ... N/32, the NAtS models with
their learned types; each on the test split and on the validation split (settings are chosen on validation).

``report`` reads the run folders (or a ``pack``ed copy) and writes ``figure3.md`` (tables), ``figure3.json``,
``figure3_ppl_vs_area.png``, ``figure3_ppl_vs_peak.png``, ``figure3_loss.png`` (training curves of NAtS beside
the dense model) and ``figure3_kv_layers.png`` (per-layer / per-head KV area and type fractions).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "logs" / "figure3"
# name -> (experiment, overrides); seeds are appended as _s<seed>
RUNS: dict[str, tuple[str, list[str]]] = {
    "dense": ("fig3_dense", []),
    **{
        f"nats_l{lam:g}": ("fig3_nats", [f"model.attention.sparsity_lambda={lam}"])
        for lam in (0, 0.01, 0.03, 0.05, 0.1, 0.3, 1, 3, 10, 30)
    },
    # ablation (issue 13 part 2): the unbounded estimator under the default separate clipping, 1000 steps
    "nats_l1_exact": (
        "fig3_nats",
        ["model.attention.sparsity_lambda=1", "model.attention.mask_grad=exact", "trainer.max_steps=1000"],
    ),
}
BUDGETS = "[0.5,0.25,0.125,0.0625,0.03125]"


def python() -> list[str]:
    return [sys.executable]


def run_dir(root: Path, run: str) -> Path:
    return root / run


def parse_run(run: str, runs: dict = RUNS) -> tuple[str, int]:
    """``<name>_s<seed>`` -> (name, seed), name one of `runs` (this study's RUNS by default)."""
    base, _, seed = run.rpartition("_s")
    if not base or not seed.isdigit() or base not in runs:
        raise SystemExit(f"unknown run {run!r}: use <name>_s<seed> with name in {sorted(runs)}")
    return base, int(seed)


def expand(names: list[str], seeds: list[int], runs: dict = RUNS) -> list[str]:
    """Run names: a name of `runs` gets every seed; a name with its seed (``dense_s2``) stays as it is."""
    out = []
    for name in names:
        if name in runs:
            out += [f"{name}_s{s}" for s in seeds]
        else:
            parse_run(name, runs)  # exits with the list of names if it is neither
            out.append(name)
    return out


# ----------------------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------------------
def alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return False
    # a zombie (finished, not reaped) counts as finished
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        return state != "Z"
    except OSError:
        return True


def launch(cmd: list[str], folder: Path, log_name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / log_name, "ab")
    log.write(f"\n### {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PROJECT_ROOT": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    (folder / f"{log_name}.pid").write_text(str(proc.pid))


def train_done(folder: Path) -> bool:
    return (folder / "metrics.json").is_file()


def train_cmd(run: str, root: Path, extra: list[str], steps: int | None) -> list[str]:
    base, seed = parse_run(run)
    experiment, overrides = RUNS[base]
    cmd = python() + [
        "-m",
        "nats.train",
        f"experiment={experiment}",
        *overrides,
        f"seed={seed}",
        f"hydra.run.dir={run_dir(root, run)}",
        "ckpt_path=auto",
        "callbacks.progress_bar.refresh_rate=0",
    ]
    if steps:
        cmd.append(f"trainer.max_steps={steps}")
    return cmd + list(extra)


def prepare(extra: list[str]) -> None:
    data = [e for e in extra if e.startswith("data")]
    if not any(e.startswith("data=") for e in data):
        data.insert(0, "data=pg19_subset")
    cmd = python() + ["-m", "nats.prepare", *data]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "PROJECT_ROOT": str(REPO)})


# ----------------------------------------------------------------------------------------------------
# status
# ----------------------------------------------------------------------------------------------------
def read_csv_metrics(folder: Path) -> list[dict[str, str]]:
    f = folder / "csv" / "metrics.csv"
    if not f.is_file():
        return []
    with open(f, newline="") as fh:
        return list(csv.DictReader(fh))


def last(rows: list[dict[str, str]], key: str) -> tuple[int | None, float | None]:
    for r in reversed(rows):
        if r.get(key) not in (None, ""):
            return int(r["step"]), float(r[key])
    return None, None


def mean_last(rows, key, n=4):
    vals = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else None


def status_rows(root: Path) -> list[dict]:
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        rows = read_csv_metrics(folder)
        step, _ = last(rows, "train/loss")
        _, val_ppl = last(rows, "val/ppl")
        state = (
            "done"
            if train_done(folder)
            else "running"
            if alive(folder / "train.out.pid")
            else "stopped"
            if rows
            else "new"
        )
        evals = sorted(p.name for p in folder.glob("eval_*") if (p / "results.json").is_file())
        out.append(
            {
                "run": folder.name,
                "state": state,
                "step": step,
                "train_loss": mean_last(rows, "train/loss"),
                "val_ppl": val_ppl,
                "density": mean_last(rows, "train/density"),
                "tok_s": mean_last(rows, "train/device/items_per_sec"),
                "gn_scorer": mean_last(rows, "train/grad_norm_scorer"),
                "gn_backbone": mean_last(rows, "train/grad_norm_backbone") or mean_last(rows, "train/grad_norm"),
                "evals": ",".join(e.removeprefix("eval_") for e in evals),
            }
        )
    return out


def fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def print_status(root: Path) -> None:
    rows = status_rows(root)
    keys = ["run", "state", "step", "train_loss", "val_ppl", "density", "tok_s", "gn_scorer", "gn_backbone", "evals"]
    print(f"[{time.strftime('%H:%M:%S')}] " + " | ".join(keys))
    for r in rows:
        print("  " + " | ".join(fmt(r[k]) for k in keys), flush=True)


# ----------------------------------------------------------------------------------------------------
# subcommands
# ----------------------------------------------------------------------------------------------------
def cmd_train(args) -> None:
    root = Path(args.root)
    runs = expand(args.runs, args.seeds)
    if not args.no_prepare:
        prepare(args.extra)
    for run in runs:
        folder = run_dir(root, run)
        if train_done(folder) or alive(folder / "train.out.pid"):
            continue
        resume = (folder / "checkpoints" / "last.ckpt").is_file()
        print(f"{'resuming' if resume else 'starting'} {run}", flush=True)
        launch(train_cmd(run, root, args.extra, args.steps), folder, "train.out")
    pids = [run_dir(root, r) / "train.out.pid" for r in runs]
    if args.eval:  # evaluate each run as soon as its training has finished

        def start_evals():
            return [p for r in runs if train_done(run_dir(root, r)) for p in start_eval(r, root, args)]

        wait(root, pids, args.budget_s, poll=start_evals)
    else:
        wait(root, pids, args.budget_s)


def wait(root: Path, pid_files: list[Path], budget_s: float, every_s: float = 60.0, poll=None) -> None:
    """Until no process of pid_files (or of those that `poll()`, called every few seconds, returns) is alive or
    budget_s has passed; a status table every every_s."""
    t0 = shown = time.time()
    extra: set[Path] = set()
    while True:
        if poll is not None:
            extra.update(poll())
        running = [p for p in [*pid_files, *sorted(extra)] if alive(p)]
        if not running or time.time() - t0 > budget_s:
            print_status(root)
            print(f"{len(running)} still running after {time.time() - t0:.0f}s", flush=True)
            return
        time.sleep(5.0)
        if time.time() - shown >= every_s:
            print_status(root)
            shown = time.time()


def eval_cmds(
    run: str, root: Path, extra: list[str], max_windows: int, batch_sizes: tuple[int, int]
) -> list[tuple[str, list[str]]]:
    """nats-eval commands of a run on both splits; batch_sizes = (dense model, NAtS model): the dense model's
    H2O decodes token by token (launch-bound: a large batch is nearly free), NAtS' parallel masked forward
    holds [batch, heads, N, N] masks (a small batch keeps several evaluations within one GPU's memory)."""
    base, _ = parse_run(run)
    folder = run_dir(root, run)
    ckpt = folder / "checkpoints" / "last.ckpt"
    dense = RUNS[base][0] == "fig3_dense"
    batch_size = batch_sizes[0] if dense else batch_sizes[1]
    data = [e for e in extra if e.startswith("data")]
    if not any(e.startswith("data=") for e in data):
        data.insert(0, "data=pg19_subset")
    out = []
    for split in ("validation", "test"):
        methods = "[full,streaming_llm,h2o]" if dense else "[nats]"
        if dense and split == "validation":
            methods = "[full]"
        cmd = python() + [
            "-m",
            "nats.eval",
            f"ckpt_path={ckpt}",
            *data,
            f"split={split}",
            f"methods={methods}",
            f"budgets={BUDGETS}",
            f"max_windows={max_windows}",
            f"batch_size={batch_size}",
            "device=auto",
            "progress=false",
            f"hydra.run.dir={folder / f'eval_{split}'}",
        ]
        out.append((split, cmd))
    return out


def start_eval(run: str, root: Path, args) -> list[Path]:
    """Start the evaluations of a trained run that are neither done nor running; returns their pid files."""
    folder = run_dir(root, run)
    pids = []
    for split, cmd in eval_cmds(run, root, args.extra, args.max_windows, (args.batch_size_dense, args.batch_size_nats)):
        pid = folder / f"eval_{split}.out.pid"
        pids.append(pid)
        if (folder / f"eval_{split}" / "results.json").is_file() or alive(pid):
            continue
        print(f"evaluating {run} on {split}", flush=True)
        launch(cmd, folder, f"eval_{split}.out")
    return pids


def cmd_eval(args) -> None:
    root = Path(args.root)
    pids = []
    for run in expand(args.runs, args.seeds):
        if not train_done(run_dir(root, run)):
            print(f"{run}: not trained yet, skipped", flush=True)
            continue
        pids += start_eval(run, root, args)
    wait(root, pids, args.budget_s)


PACK_PATTERNS = [
    "csv/metrics.csv",
    "metrics.json",
    ".hydra/config.yaml",
    "eval_*/results.json",
    "eval_*/results.md",
    "eval_*/kv_fractions.json",
    "*.out",
]


def cmd_pack(args) -> None:
    root = Path(args.root)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            for pattern in PACK_PATTERNS:
                for f in sorted(folder.glob(pattern)):
                    tar.add(f, arcname=str(f.relative_to(root)))
    os.replace(tmp, out)
    print(f"packed {out} ({out.stat().st_size / 1e6:.2f} MB)")


def cmd_kill(args) -> None:
    root = Path(args.root)
    for pid_file in root.glob("*/*.pid"):
        if alive(pid_file):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            print("stopped", pid_file.parent.name, pid_file.name)


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------
def load_eval(folder: Path, split: str) -> dict | None:
    f = folder / f"eval_{split}" / "results.json"
    return json.loads(f.read_text()) if f.is_file() else None


def collect(root: Path) -> dict:
    """Everything the report needs from the run folders: per run its config, curves and evaluations."""
    runs = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            base, seed = parse_run(folder.name)
        except SystemExit:
            continue
        rows = read_csv_metrics(folder)
        metrics = json.loads((folder / "metrics.json").read_text()) if train_done(folder) else None
        kv = folder / "eval_test" / "kv_fractions.json"
        runs[folder.name] = {
            "base": base,
            "seed": seed,
            "experiment": RUNS[base][0],
            "overrides": RUNS[base][1],
            "metrics": metrics,
            "curves": {
                k: [(int(r["step"]), float(r[k])) for r in rows if r.get(k) not in (None, "")]
                for k in (
                    "train/loss",
                    "val/loss",
                    "val/ppl",
                    "train/density",
                    "train/grad_norm",
                    "train/grad_norm_scorer",
                    "train/grad_norm_backbone",
                    "train/device/items_per_sec",
                )
            },
            "eval": {s: load_eval(folder, s) for s in ("validation", "test")},
            "kv_fractions": json.loads(kv.read_text()) if kv.is_file() else None,
        }
    return runs


def lam_of(base: str) -> float | None:
    if not base.startswith("nats_l"):
        return None
    return float(base.removeprefix("nats_l").split("_")[0])


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def summarize(runs: dict) -> dict:
    """Rows of the result table: per (method, setting) mean and spread over seeds, on both splits."""
    table: dict[tuple, dict] = {}
    for name, r in runs.items():
        for split in ("validation", "test"):
            ev = r["eval"][split]
            if not ev:
                continue
            for res in ev["results"]:
                if r["experiment"] == "fig3_dense":
                    model = "dense"
                    setting = res["label"] + ("" if res["budget"] is None else f" B=N/{ev['N'] / res['budget']:g}")
                else:
                    model = r["base"]
                    setting = f"NAtS lambda={lam_of(r['base']):g}" + (" exact" if "exact" in r["base"] else "")
                key = (model, setting, split)
                row = table.setdefault(
                    key,
                    {
                        "model": model,
                        "setting": setting,
                        "split": split,
                        "policy": res["policy"],
                        "budget": res["budget"],
                        "ppl": [],
                        "area": [],
                        "peak": [],
                        "seeds": [],
                    },
                )
                row["ppl"].append(res["ppl"])
                row["area"].append(res["area"])
                row["peak"].append(res["peak"])
                row["seeds"].append(r["seed"])
    out = []
    for row in table.values():
        for k in ("ppl", "area", "peak"):
            row[k + "_mean"], row[k + "_std"] = mean_std(row[k])
        out.append(row)
    return sorted(out, key=lambda r: (r["split"], r["model"] != "dense", -r["area_mean"]))


def markdown(runs: dict, rows: list[dict], device: str) -> str:
    lines = [
        "# Figure 3 at reduced scale: perplexity against KV-cache size (GPT-2-small, PG-19 subset, N = 1024)",
        "",
        f"Produced by `experiments/figure3.py report` from the run folders; trained and evaluated on {device}.",
        "",
    ]
    full_test = [r for r in rows if r["split"] == "test" and r["policy"] == "full"]
    ref = full_test[0]["ppl_mean"] if full_test else None
    for split in ("test", "validation"):
        sub = [r for r in rows if r["split"] == split]
        if not sub:
            continue
        refs = [r for r in sub if r["policy"] == "full"]
        base_ppl = refs[0]["ppl_mean"] if refs else ref
        lines += [
            f"## {split} split",
            "",
            "| model | method | seeds | KV area | KV peak | perplexity | vs dense full |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in sub:
            pm = f"{r['ppl_mean']:.2f}" + (f" ± {r['ppl_std']:.2f}" if len(r["ppl"]) > 1 else "")
            rel = f"{100 * (r['ppl_mean'] / base_ppl - 1):+.1f}%" if base_ppl else "-"
            lines.append(
                f"| {r['model']} | {r['setting']} | {len(r['seeds'])} | {r['area_mean']:.4f} | "
                f"{r['peak_mean']:.4f} | {pm} | {rel} |"
            )
        lines.append("")
    lines += [
        "## Training",
        "",
        "| run | steps | final val ppl (training's validation) | train density (last) | tokens/s (last) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        m = {
            **(r["metrics"] or {}).get("metrics", {}),
            **{k: v for k, v in (r["metrics"] or {}).items() if k != "metrics"},
        }
        c = r["curves"]
        dens = c["train/density"][-1][1] if c["train/density"] else None
        tps = c["train/device/items_per_sec"][-1][1] if c["train/device/items_per_sec"] else None
        lines.append(
            f"| {name} | {m.get('global_step', '-')} | {fmt(m.get('val/ppl'), 4)} | {fmt(dens)} | "
            f"{fmt(tps and round(tps))} |"
        )
    lines.append("")
    lines.append(
        "Mean ± sample standard deviation over seeds where there are several. Plots: "
        "figure3_ppl_vs_area.png, figure3_ppl_vs_peak.png, figure3_loss.png, figure3_kv_layers.png."
    )
    return "\n".join(lines) + "\n"


def plots(runs: dict, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test = [r for r in rows if r["split"] == "test"]
    for key in ("area", "peak"):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for label, color in (("StreamingLLM", "C1"), ("H2O", "C2")):
            pts = sorted(
                (r[key + "_mean"], r["ppl_mean"])
                for r in test
                if r["model"] == "dense" and r["setting"].lower().startswith(label.lower()[:4])
            )
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=f"{label} (dense model)")
        full = [r for r in test if r["policy"] == "full"]
        if full:
            ax.axhline(full[0]["ppl_mean"], color="k", ls="--", lw=1, label="dense, full cache")
        nats = sorted((r for r in test if r["policy"] == "nats"), key=lambda r: r[key + "_mean"])
        if nats:
            ax.errorbar(
                [r[key + "_mean"] for r in nats],
                [r["ppl_mean"] for r in nats],
                yerr=[r["ppl_std"] for r in nats],
                fmt="*",
                color="C3",
                markersize=12,
                label="NAtS",
            )
            for r in nats:
                ax.annotate(
                    r["setting"].replace("NAtS lambda=", "λ="),
                    (r[key + "_mean"], r["ppl_mean"]),
                    textcoords="offset points",
                    xytext=(5, 5),
                    fontsize=8,
                )
        ax.set_xscale("log")
        ax.set_xlabel(f"KV {key} fraction (log)")
        ax.set_ylabel("test perplexity")
        ax.set_title(f"GPT-2-small, PG-19 subset, N=1024: perplexity vs KV {key}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"figure3_ppl_vs_{key}.png", dpi=120)
        plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, (name, r) in enumerate(sorted(runs.items())):
        color = "k" if r["experiment"] == "fig3_dense" else f"C{i % 10}"
        tl = r["curves"]["train/loss"]
        if tl:
            xs, ys = zip(*tl)
            k = 8  # running mean over 8 logged points
            sm = [sum(ys[max(0, j - k + 1) : j + 1]) / len(ys[max(0, j - k + 1) : j + 1]) for j in range(len(ys))]
            axes[0].plot(xs, sm, color=color, label=name)
        vl = r["curves"]["val/loss"]
        if vl:
            axes[1].plot(*zip(*vl), "o-", color=color, label=name)
        gn = r["curves"]["train/grad_norm_scorer"]
        if gn:
            axes[2].plot(*zip(*gn), color=color, label=f"{name} scorer")
        gb = r["curves"]["train/grad_norm_backbone"] or r["curves"]["train/grad_norm"]
        if gb:
            axes[2].plot(*zip(*gb), color=color, ls=":", label=f"{name} backbone")
    axes[0].set_title("train loss (CE, running mean)")
    axes[1].set_title("validation loss")
    axes[2].set_title("gradient norms (before clipping)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(top=6.0)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "figure3_loss.png", dpi=110)
    plt.close(fig)

    nats_runs = sorted(
        ((n, r) for n, r in runs.items() if r["kv_fractions"] and r["experiment"] == "fig3_nats"),
        key=lambda nr: (lam_of(nr[1]["base"]), "exact" in nr[0], nr[1]["seed"]),
    )
    if nats_runs:
        fig, axes = plt.subplots(2, len(nats_runs), figsize=(3.2 * len(nats_runs), 7), squeeze=False)
        for c, (name, r) in enumerate(nats_runs):
            m = next(v for v in r["kv_fractions"]["methods"].values() if v["policy"] == "nats")
            im = axes[0][c].imshow(m["area"], aspect="auto", cmap="viridis", vmin=0, vmax=max(map(max, m["area"])))
            axes[0][c].set_title(f"{name}\nKV area per layer x head", fontsize=8)
            axes[0][c].set_ylabel("layer")
            fig.colorbar(im, ax=axes[0][c])
            tf = m.get("type_fractions")
            if tf:
                layers = range(len(tf))
                for t, (lab, col) in enumerate((("global", "C0"), ("local", "C1"), ("sliding", "C2"))):
                    axes[1][c].plot(
                        layers, [sum(h[t] for h in layer) / len(layer) for layer in tf], "o-", color=col, label=lab
                    )
                axes[1][c].set_xlabel("layer")
                axes[1][c].set_title("type fractions (mean over heads)", fontsize=8)
                axes[1][c].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "figure3_kv_layers.png", dpi=110)
        plt.close(fig)


def cmd_report(args) -> None:
    root = Path(args.root)
    for packed in args.packed or []:  # several: e.g. one per GPU machine the study ran on
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(packed) as tar:
            tar.extractall(root, filter="data")
    runs = collect(root)
    rows = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "figure3.md").write_text(markdown(runs, rows, args.device))
    slim = {n: {k: v for k, v in r.items() if k != "kv_fractions"} for n, r in runs.items()}
    (out / "figure3.json").write_text(json.dumps({"device": args.device, "rows": rows, "runs": slim}, indent=1))
    plots(runs, rows, out)
    print((out / "figure3.md").read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "eval", "status", "pack", "kill", "report"):
        p = sub.add_parser(name)
        p.add_argument("--root", default=str(DEFAULT_ROOT), help="folder of the run folders")
        if name in ("train", "eval"):
            p.add_argument("--runs", nargs="+", default=["dense", "nats_l1"], help=f"from {sorted(RUNS)}")
            p.add_argument("--seeds", nargs="+", type=int, default=[1])
            p.add_argument("--budget-s", type=float, default=540.0, help="return after this many seconds")
            p.add_argument("--extra", nargs="*", default=[], help="Hydra overrides for every run, e.g. data.path=...")
        if name == "train":
            p.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the config's 2000)")
            p.add_argument("--no-prepare", action="store_true")
        if name == "train":
            p.add_argument("--eval", action="store_true", help="evaluate each run as soon as it has finished")
        if name in ("train", "eval"):
            p.add_argument("--max-windows", type=int, default=512)
            p.add_argument("--batch-size-dense", type=int, default=128)
            p.add_argument("--batch-size-nats", type=int, default=16)
        if name == "pack":
            p.add_argument("--out", required=True)
        if name == "report":
            p.add_argument("--packed", nargs="*", default=None, help="`pack` archives to extract into --root first")
            p.add_argument("--out", default=str(REPO / "docs" / "results"))
            p.add_argument("--device", default="one NVIDIA GPU", help="the machine, for the table's caption")
    args = ap.parse_args(argv)
    {
        "train": cmd_train,
        "eval": cmd_eval,
        "status": lambda a: print_status(Path(a.root)),
        "pack": cmd_pack,
        "kill": cmd_kill,
        "report": cmd_report,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
