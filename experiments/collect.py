"""Collect a multirun folder into one table (CSV and markdown) and a plot of perplexity against KV fraction.

    python experiments/collect.py logs/train/multiruns/2026-01-01_12-00-00
    python experiments/collect.py logs/paper/train --out logs/paper/results     # the slurm/pipeline.py layout

A run is any folder below the given ones that holds ``.hydra/config.yaml`` (each job of a Hydra multirun, or a
single run); submitit's ``.submitit/`` folders are skipped. For each run the table has the swept settings
(attention, lambda, W, seed, ...) from the run's config and the final metrics from the ``metrics.json`` that
``nats-train`` writes into the run folder at the end (``status`` = ``done``; ``failed: <error>`` when the run's
latest attempt wrote ``failed.json``; ``running`` when it has written neither yet).

KV fraction: the run's validation ``val/density`` (NAtS: the mean over layers, heads and windows of the KV-cache
area fraction of the learned hard types, NATS_SPEC.md section 6); runs whose attention keeps every key
(``dense``, gated or not) have fraction 1.

Writes into ``--out`` (default: the first folder): ``runs.csv`` (one row per run), ``runs.md`` (the table, and a
second one with the mean and standard deviation over seeds when a setting has several), ``ppl_vs_kv.png``, and,
when runs hold ``nats-eval`` outputs (``<run>/eval/results.csv``, as ``slurm/pipeline.py`` writes them, or
``<run>/eval_<name>/results.csv``, the runs' own evaluations: conf/callbacks/eval_after.yaml), ``eval.csv`` (their
rows prefixed with the run's settings) and ``eval_ppl_vs_area.png``.

The study reports (``figure3.py``, ``gate_study_gpt2.py``, beside this file) read run folders through
``find_runs`` and ``load_run``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from nats.utils import markdown_table as table

METRIC = "val/ppl"
# columns of the table: (name, dotted key in the run's config)
SETTINGS = [
    ("task", "task_name"),
    ("attention", "model.attention.name"),
    ("lambda", "model.attention.sparsity_lambda"),
    ("window", "model.attention.window"),
    ("output_gate", "model.attention.output_gate"),
    ("seed", "seed"),
    ("n_layer", "model.n_layer"),
    ("block_size", "model.block_size"),
    ("global_batch", "global_batch_size"),
]
FULL_KV = {"dense"}  # attention cores that keep every key: KV fraction 1


def find_runs(roots: Iterable[str | os.PathLike]) -> list[Path]:
    """Folders below ``roots`` (or the roots themselves) that hold ``.hydra/config.yaml``, sorted."""
    runs: set[Path] = set()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a folder: pass a multirun (or run) folder")
        for dirpath, dirnames, _ in os.walk(root):
            skip = {".submitit", "checkpoints", "tensorboard", "csv"}
            if ".hydra" in dirnames and Path(dirpath, ".hydra", "config.yaml").is_file():
                runs.add(Path(dirpath))
                # <run>/eval, <run>/eval_<name>: the nats-eval outputs of the run, not runs
                dirnames[:] = [d for d in dirnames if not d.startswith("eval")]
            dirnames[:] = [d for d in dirnames if d not in skip]
    return sorted(runs, key=_natural_key)


def _natural_key(path: Path) -> list[Any]:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _select(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, str) and "${" in node:  # an unresolved interpolation: not a plain setting
        return None
    return node


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def read_run(run_dir: Path, root: Path) -> dict[str, Any]:
    """One row: the run's settings, its overrides, its final metrics and the KV fraction."""
    cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()) or {}
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    try:
        rel = str(run_dir.relative_to(root))
    except ValueError:
        rel = str(run_dir)
    row: dict[str, Any] = {"run": rel if rel != "." else run_dir.name, "sweep": ""}
    for name, key in SETTINGS:
        row[name] = _select(cfg, key)
    attention = row["attention"]
    metrics_file = run_dir / "metrics.json"
    info = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    metrics = (info or {}).get("metrics", {})
    failed_file = run_dir / "failed.json"
    failed_last = failed_file.is_file() and (info is None or failed_file.stat().st_mtime > metrics_file.stat().st_mtime)
    if failed_last:  # the latest attempt (e.g. a resume of a finished run) failed
        try:
            row["status"] = f"failed: {json.loads(failed_file.read_text()).get('error', '?')[:120]}"
        except (ValueError, OSError):
            row["status"] = "failed"
    else:
        row["status"] = "done" if info is not None else "running"
    row["steps"] = (info or {}).get("global_step")
    row["tokens"] = (info or {}).get("tokens_seen")
    row["val_loss"] = _float(metrics.get("val/loss"))
    row["val_ppl"] = _float(metrics["val/ppl"]) if "val/ppl" in metrics else math.exp(row["val_loss"])
    density = metrics.get("val/density")
    if density is not None:
        row["kv_fraction"] = _float(density)
    elif info is not None and attention in FULL_KV:
        row["kv_fraction"] = 1.0
    else:
        row["kv_fraction"] = math.nan
    for extra in ("val/peak", "val/frac_global", "val/frac_local", "val/frac_sliding", "test/ppl"):
        if extra in metrics:
            row[extra.replace("/", "_")] = _float(metrics[extra])
    row["overrides"] = " ".join(str(o) for o in overrides)
    return row


def load_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def load_run(run_dir: Path) -> dict[str, Any]:
    """Everything a study's report reads from one run folder: the composed config (``.hydra/config.yaml``),
    ``metrics.json``, the CSV logger's rows (``csv/metrics.csv``), the evaluations the run wrote at its end
    (``eval_<name>/results.json`` and ``kv_fractions.json``, by name) and ``analysis.json`` (None where absent)."""
    run_dir = Path(run_dir)
    rows: list[dict[str, str]] = []
    if (run_dir / "csv" / "metrics.csv").is_file():
        with open(run_dir / "csv" / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    evals = sorted(p for p in run_dir.glob("eval_*") if (p / "results.json").is_file())
    return {
        "dir": str(run_dir),
        "config": yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()) or {},
        "metrics": load_json(run_dir / "metrics.json"),
        "csv": rows,
        "eval": {p.name.removeprefix("eval_"): load_json(p / "results.json") for p in evals},
        "kv_fractions": {p.name.removeprefix("eval_"): load_json(p / "kv_fractions.json") for p in evals},
        "analysis": load_json(run_dir / "analysis.json"),
    }


def runs_from_reports(paths: Iterable[str | os.PathLike]) -> dict[str, dict[str, Any]]:
    """The runs of earlier reports (the ``runs`` of a study report's JSON, e.g. docs/results/figure3.json), by name:
    a study pooled from run folders that are no longer at hand and new ones (`figure3.py --runs-from`)."""
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"--runs-from {path}: not a readable report JSON ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
            raise SystemExit(f"--runs-from {path}: no 'runs' in it (pass a study report's JSON)")
        runs.update(data["runs"])
    return runs


def training_runs(
    folders: Iterable[str | os.PathLike],
    entry: Callable[[dict[str, Any], Path], tuple[str, dict[str, Any]] | None],
    reported: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """A study's runs by name: ``entry(run, folder)`` of every run folder below ``folders`` (`load_run`) gives its
    name and entry, or None for a folder that is not one of the study's training runs; a name twice is an error.
    The runs of earlier reports (``reported``, `runs_from_reports`) join them, a folder's run replacing the report's
    of the same name; no run at all is an error."""
    folders = list(folders)
    runs: dict[str, dict[str, Any]] = {}
    where: dict[str, Path] = {}
    for folder in find_runs(folders):
        named = entry(load_run(folder), folder)
        if named is None:
            continue
        name, run = named
        if name in runs:
            raise SystemExit(f"{name} twice: {where[name]} and {folder}; pass the folders of one of them")
        runs[name], where[name] = run, folder
    runs = {**reported, **runs}
    if not runs:
        raise SystemExit(f"no training runs below {', '.join(map(str, folders)) or '(no folder)'}")
    return runs


def add_run_sources(ap: argparse.ArgumentParser, report: str) -> None:
    """A study report's inputs: run folders and earlier reports' JSON (``report``: its file name, for the help)."""
    ap.add_argument("folders", nargs="*", help="multirun (or run) folders of the study; searched recursively")
    ap.add_argument(
        "--runs-from",
        action="append",
        default=[],
        metavar="JSON",
        help=f"an earlier report's {report} whose runs join the folders' (a folder's run replaces one of the same "
        "name): seeds whose run folders are gone pooled with new ones",
    )


def check_run_sources(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.folders and not args.runs_from:
        ap.error("give run folders, --runs-from JSON, or both")


def curve(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    """(step, value) of one column of a run's CSV rows, where it is set."""
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def collect(roots: list[str | os.PathLike]) -> list[dict[str, Any]]:
    runs = find_runs(roots)
    if not runs:
        raise FileNotFoundError(f"no runs (folders with .hydra/config.yaml) below {', '.join(map(str, roots))}")
    root = Path(roots[0])
    rows = [read_run(r, root) for r in runs]
    add_sweep_column(rows)
    rows.sort(
        key=lambda r: (
            str(r["attention"]),
            _float(r["window"]),
            _float(r["lambda"]),
            _float(r["seed"]),
            _natural_key(Path(r["run"])),
        )
    )
    return rows


def add_sweep_column(rows: list[dict[str, Any]]) -> None:
    """``sweep``: the overrides whose value differs between the runs (what the multirun swept), in order."""
    parsed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in r["overrides"].split()) for r in rows]
    keys: list[str] = []
    for p in parsed:
        keys += [k for k in p if k not in keys]
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    for r, p in zip(rows, parsed):
        r["sweep"] = " ".join(f"{k}={p[k]}" for k in varying if k in p)


# ---------------------------------------------------------------------------------------------------- output
def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    # drop settings that are empty in every row
    return [c for c in cols if any(r.get(c) not in (None, "") for r in rows)]


def _fmt(value: Any, col: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if col in ("val_loss",):
            return f"{value:.4f}"
        if col in ("val_ppl", "test_ppl"):
            return f"{value:.2f}"
        if col.startswith(("kv_", "val_", "frac")):
            return f"{value:.4f}"
        return f"{value:g}"
    if col == "tokens" and isinstance(value, int):
        return f"{value:,}"
    return str(value)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    cols = _columns(rows)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})


def markdown_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    return table(cols, ([_fmt(r.get(c), c) for c in cols] for r in rows), align="-" * len(cols))


GROUP = ("attention", "window", "lambda", "output_gate")


def seed_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds of finished runs with the same attention, W and lambda."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["status"] == "done":
            groups[tuple(r.get(k) for k in GROUP)].append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(GROUP, key))
        row["seeds"] = len(rs)
        for m in ("val_ppl", "kv_fraction"):
            vals = [r[m] for r in rs if not math.isnan(r[m])]
            row[m] = statistics.fmean(vals) if vals else math.nan
            row[m + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0 if vals else math.nan
        out.append(row)
    return out


def write_markdown(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    cols = [c for c in _columns(rows) if c not in ("overrides",)]
    parts = [
        f"# {title}",
        "",
        f"{len(rows)} runs; KV fraction = validation KV-cache area fraction "
        "(`val/density`; 1 for dense attention); perplexity = final validation perplexity.",
        "",
        markdown_table(rows, cols),
    ]
    means = seed_means(rows)
    if any(m["seeds"] > 1 for m in means):
        mcols = [c for c in _columns(means)]
        parts += ["", "## Mean over seeds", "", markdown_table(means, mcols)]
    text = "\n".join(parts) + "\n"
    path.write_text(text)
    return text


def _label(r: dict[str, Any]) -> str:
    gate = f" gate={r['output_gate']}" if r.get("output_gate") not in (None, "none") else ""
    if r.get("attention") == "nats":
        return f"nats W={r.get('window')}{gate}"
    return f"{r.get('attention')}{gate}"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Perplexity against KV fraction: one series per (attention, W), one point per lambda (mean over seeds,
    with the standard deviation as error bars). Returns False when nothing is plottable or no matplotlib."""
    means = [m for m in seed_means(rows) if not math.isnan(m["val_ppl"]) and not math.isnan(m["kv_fraction"])]
    if not means:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("matplotlib is not installed: no plot")
        return False
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in means:
        series[_label(m)].append(m)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda m: m["kv_fraction"])
        xs = [m["kv_fraction"] for m in pts]
        ys = [m["val_ppl"] for m in pts]
        ax.errorbar(
            xs,
            ys,
            xerr=[m["kv_fraction_std"] for m in pts],
            yerr=[m["val_ppl_std"] for m in pts],
            marker="o" if len(pts) > 1 or xs[0] < 1 else "*",
            markersize=6 if xs[0] < 1 else 12,
            capsize=3,
            label=label,
            linestyle="-" if len(pts) > 1 else "none",
        )
        if label.startswith("nats"):
            for m in pts:
                ax.annotate(
                    f"λ={m['lambda']:g}" if isinstance(m["lambda"], (int, float)) else str(m["lambda"]),
                    (m["kv_fraction"], m["val_ppl"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
    xs_all = [m["kv_fraction"] for m in means]
    if min(xs_all) > 0 and max(xs_all) / min(xs_all) > 5:
        ax.set_xscale("log")
    ax.set_xlabel("KV fraction (validation KV-cache area / full causal cache)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_eval(eval_rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Test perplexity against KV area fraction from the nats-eval outputs: one series per run and method."""
    pts = [(r, _float(r.get("area")), _float(r.get("ppl"))) for r in eval_rows]
    pts = [(r, x, y) for r, x, y in pts if not math.isnan(x) and not math.isnan(y)]
    if not pts:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return False
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r, x, y in pts:
        run = _label(r) + (f" λ={r['lambda']}" if r.get("attention") == "nats" else "")
        series[f"{run}: {r.get('label') or r.get('method')}"].append((x, y))
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    for label, xy in sorted(series.items()):
        xy.sort()
        ax.plot([a for a, _ in xy], [b for _, b in xy], marker="o", markersize=4, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("KV area fraction (test)")
    ax.set_ylabel("test perplexity")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def collect_eval(rows: list[dict[str, Any]], root: Path, path: Path) -> int:
    """Concatenate the CSVs that ``nats-eval`` wrote under ``<run>/eval/`` (slurm/pipeline.py) or ``<run>/eval_<name>/``
    (the runs' own evaluations, conf/callbacks/eval_after.yaml) with the run's settings in front."""
    out_rows: list[dict[str, Any]] = []
    for r in rows:
        run_dir = root / r["run"] if not Path(r["run"]).is_absolute() else Path(r["run"])
        for f in sorted(f for d in run_dir.glob("eval*") if d.is_dir() for f in d.rglob("*.csv")):
            with open(f, newline="") as fh:
                for e in csv.DictReader(fh):
                    out_rows.append(
                        {
                            "run": r["run"],
                            "attention": r["attention"],
                            "lambda": r["lambda"],
                            "window": r["window"],
                            "output_gate": r.get("output_gate"),
                            "seed": r["seed"],
                            "eval_file": str(f.relative_to(run_dir)),
                            **e,
                        }
                    )
    if out_rows:
        write_csv(out_rows, path)
        plot_eval(out_rows, path.with_name("eval_ppl_vs_area.png"), "nats-eval: test perplexity vs KV budget")
    return len(out_rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="multirun (or run) folders; searched recursively")
    ap.add_argument("--out", default=None, help="output folder (default: the first folder)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    rows = collect(args.folders)
    out = Path(args.out or args.folders[0])
    out.mkdir(parents=True, exist_ok=True)
    title = args.title or f"Runs of {Path(args.folders[0]).resolve().name}"
    write_csv(rows, out / "runs.csv")
    text = write_markdown(rows, out / "runs.md", title)
    plotted = plot(rows, out / "ppl_vs_kv.png", title)
    n_eval = collect_eval(rows, Path(args.folders[0]), out / "eval.csv")
    print(text)
    done = sum(r["status"] == "done" for r in rows)
    written = [out / "runs.csv", out / "runs.md"] + ([out / "ppl_vs_kv.png"] if plotted else [])
    print(
        f"{len(rows)} runs ({done} done) -> {', '.join(map(str, written))}"
        + (f", {out / 'eval.csv'} ({n_eval} rows)" if n_eval else "")
    )
    return rows


if __name__ == "__main__":
    main()
