"""Read and plot a `nats-eval-hf` run folder and a NAtS fine-tuning run (the notebook
``notebooks/hf_kv_budgets.ipynb``).

    from nats.finetune import analysis as A

    run = A.load_eval_run("logs/eval_hf/runs/<run>")      # summary.json + kv_fractions.json (+ run.json)
    print(A.format_table(run))                             # accuracy per task and method @ budget, KV fractions
    A.plot_nats_heatmaps(run)                              # NAtS: area per layer x KV head, token types per layer
    A.plot_layer_comparison(run)                           # per-layer kv_fraction: NAtS against each budget's baselines
    ft = A.load_finetune_run(A.finetune_dir_of(run))       # the scorers' run: csv/metrics.csv, nats_stats.json
    A.plot_distillation(ft); A.plot_finetune_layers(ft, run)

`demo_runs` makes both folders offline on a CPU in seconds: a tiny random Llama, a few fine-tuning steps of its
scorers and `nats-eval-hf` on short examples.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nats.finetune.evaluate import KV_FRACTIONS, PLOT, RESULTS, SETTINGS, SUMMARY, _name

TYPES = ("global", "local", "sliding")
#: the per layer x KV head arrays of kv_fractions.json
KEYS = ("area", "peak", "kv_fraction")
STATS_FILE, METRICS = "nats_stats.json", "metrics.csv"


# ----------------------------------------------------------------------------------------------------------------
# a nats-eval-hf run folder
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class EvalRun:
    """A `nats-eval-hf` run folder: ``results`` are summary.json's rows (one per method @ budget: ``accuracy`` per
    task and ``mean_accuracy`` in [0, 1], ``area``, ``peak``, ``kv_fraction``, ``examples``); ``methods`` maps
    the same names (``label`` or ``label @ budget``) to kv_fractions.json's entries, with ``area``, ``peak``,
    ``kv_fraction`` as arrays [layer, kv_head] and NAtS's ``type_fractions`` as [layer, kv_head, 3]."""

    path: Path
    header: str
    tasks: list[str]
    results: list[dict[str, Any]]
    methods: dict[str, dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [_name(r) for r in self.results]

    @property
    def nats(self) -> str | None:
        """The name of the NAtS entry (the one with token types), or None."""
        return next((n for n, m in self.methods.items() if "type_fractions" in m), None)

    @property
    def budgets(self) -> list[float]:
        """The budget fractions of the budgeted methods, largest first."""
        return sorted({r["budget"] for r in self.results if r["budget"] is not None}, reverse=True)

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, KV heads)."""
        return next(iter(self.methods.values()))["area"].shape


def _not_a_run(folder: Path, why: str) -> ValueError:
    return ValueError(
        f"{folder} is not a nats-eval-hf run folder: {why} (nats-eval-hf writes {RESULTS}, {SUMMARY}, "
        f"{KV_FRACTIONS}, {PLOT} into logs/eval_hf/runs/<run>)"
    )


def _read_json(path: Path, folder: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise _not_a_run(folder, f"{path.name} is not JSON ({err})") from None


def load_eval_run(folder: str | Path) -> EvalRun:
    """Read a `nats-eval-hf` run folder; a clear error for a folder that is not one (or has no summary yet)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass a nats-eval-hf run folder (logs/eval_hf/runs/<run>)")
    if not (folder / SUMMARY).is_file():
        if (folder / "results.json").is_file():
            raise _not_a_run(folder, "it holds results.json, a nats-eval run: see notebooks/kv_budget_analysis.ipynb")
        if (folder / RESULTS).is_file():
            raise _not_a_run(
                folder, f"{RESULTS} but no {SUMMARY} yet (no method finished): continue it with resume={folder}"
            )
        raise _not_a_run(folder, f"no {SUMMARY}")
    summary = _read_json(folder / SUMMARY, folder)
    if not isinstance(summary, dict) or not {"tasks", "results"} <= summary.keys():
        raise _not_a_run(folder, f"{SUMMARY} has no 'tasks' and 'results'")
    if not (folder / KV_FRACTIONS).is_file():
        raise _not_a_run(folder, f"{SUMMARY} but no {KV_FRACTIONS}")
    kv = _read_json(folder / KV_FRACTIONS, folder)
    if not isinstance(kv, dict) or not isinstance(kv.get("methods"), dict) or not kv["methods"]:
        raise _not_a_run(folder, f"{KV_FRACTIONS} has no 'methods'")
    methods = {}
    for name, entry in kv["methods"].items():
        arrays = {k: np.asarray(entry[k], dtype=float) for k in (*KEYS, "type_fractions") if k in entry}
        if not set(KEYS) <= arrays.keys() or any(arrays[k].ndim != 2 for k in KEYS):
            raise _not_a_run(folder, f"{KV_FRACTIONS}: {name!r} lacks {'/'.join(KEYS)} per layer and KV head")
        methods[name] = {**entry, **arrays}
    shapes = {name: m["area"].shape for name, m in methods.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{folder / KV_FRACTIONS}: the methods differ in (layers, KV heads): {shapes}")
    settings = json.loads((folder / SETTINGS).read_text()) if (folder / SETTINGS).is_file() else {}
    return EvalRun(folder, summary.get("header", ""), list(summary["tasks"]), summary["results"], methods, settings)


def accuracy_table(run: EvalRun) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)``: per method @ budget, the accuracy per task and their mean (percent), KV area, peak and
    kv_fraction, examples (summary.json's numbers; a task without examples is NaN)."""
    columns = ["method @ budget", *run.tasks, "mean", "KV area", "KV peak", "kv_fraction", "examples"]
    rows = [
        [
            _name(r),
            *(100 * float(r["accuracy"].get(t, float("nan"))) for t in run.tasks),
            100 * float(r["mean_accuracy"]),
            r["area"],
            r["peak"],
            r["kv_fraction"],
            r["examples"],
        ]
        for r in run.results
    ]
    return columns, rows


def format_table(run: EvalRun) -> str:
    """`accuracy_table` as fixed-width text (accuracies with 1 decimal, KV fractions with 3)."""
    columns, rows = accuracy_table(run)
    n_acc = len(run.tasks) + 1
    cells = [
        [row[0], *(f"{v:.1f}" for v in row[1 : 1 + n_acc]), *(f"{v:.3f}" for v in row[1 + n_acc : -1]), str(row[-1])]
        for row in rows
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    fmt = [f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths)]
    lines = ["  ".join(f.format(c) for f, c in zip(fmt, columns))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(f.format(c) for f, c in zip(fmt, r)) for r in cells]
    return "\n".join(lines)


def per_layer(run: EvalRun, key: str = "kv_fraction") -> dict[str, np.ndarray]:
    """Per method @ budget, ``key`` (area, peak or kv_fraction) per layer: the mean over KV heads."""
    if key not in KEYS:
        raise ValueError(f"key must be one of {', '.join(KEYS)}; got {key!r}")
    return {name: m[key].mean(1) for name, m in run.methods.items()}


def format_layers(run: EvalRun, key: str = "kv_fraction") -> str:
    """`per_layer` as text: a row per layer, a column per method @ budget (full left out: 1 everywhere)."""
    layers = {n: v for n, v in per_layer(run, key).items() if run.methods[n].get("method") != "full"}
    width = max(8, *(len(n) for n in layers))
    lines = [f"{key} per layer (mean over KV heads)", "layer  " + "  ".join(f"{n:>{width}}" for n in layers)]
    lines += [f"{i:>5}  " + "  ".join(f"{v[i]:>{width}.3f}" for v in layers.values()) for i in range(run.shape[0])]
    return "\n".join(lines)


def nats_types(run: EvalRun) -> np.ndarray:
    """NAtS's fractions of global / local / sliding tokens per layer [layer, 3] (mean over KV heads)."""
    name = _need_nats(run)
    return run.methods[name]["type_fractions"].mean(1)


def _need_nats(run: EvalRun) -> str:
    if run.nats is None:
        raise ValueError(
            f"{run.path}: no NAtS method among {', '.join(run.methods)}; run nats-eval-hf with "
            "scorers=<fine-tuning run>/scorers.pt and nats in methods"
        )
    return run.nats


def _heatmap(ax, values: np.ndarray, xlabels: list[str], title: str, fig) -> None:
    im = ax.imshow(values, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(values.shape[1]), xlabels)
    ax.set_yticks(range(values.shape[0]))
    ax.set_ylabel("layer")
    ax.set_title(title)
    if values.size <= 400:
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=7)
    fig.colorbar(im, ax=ax)


def plot_nats_heatmaps(run: EvalRun, key: str = "area"):
    """Two heatmaps of the NAtS entry: ``key`` (the KV area fraction) per layer x KV head, and its fractions of
    global / local / sliding tokens per layer (mean over KV heads). Returns the figure."""
    import matplotlib.pyplot as plt

    name = _need_nats(run)
    values = run.methods[name][key]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * values.shape[0] + 2.5))
    _heatmap(axes[0], values, [str(h) for h in range(values.shape[1])], f"{name}: KV {key} fraction", fig)
    axes[0].set_xlabel("KV head")
    _heatmap(axes[1], nats_types(run), list(TYPES), f"{name}: token types (mean over KV heads)", fig)
    axes[1].set_xlabel("type")
    fig.tight_layout()
    return fig


def plot_layer_comparison(run: EvalRun, key: str = "kv_fraction"):
    """Per layer, ``key`` (mean over KV heads) of NAtS (dots: its KV heads) against the baselines, one panel per
    budget fraction (dashed: the budget): PyramidKV's budgets fall with depth, the others are flat. Returns the
    figure."""
    import matplotlib.pyplot as plt

    layers = per_layer(run, key)
    budgets = run.budgets or [None]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 3.8), sharey=True, squeeze=False)
    x = np.arange(run.shape[0])
    for ax, budget in zip(axes[0], budgets):
        for r in run.results:
            name = _name(r)
            if r["budget"] == budget and budget is not None:
                ax.plot(x, layers[name], marker="o", label=r["label"])
        if run.nats is not None:
            heads = run.methods[run.nats][key]
            ax.plot(x, layers[run.nats], marker="*", markersize=10, color="k", label=f"{run.nats} (learned)")
            for h in range(heads.shape[1]):
                ax.scatter(x, heads[:, h], s=10, color="gray", alpha=0.6, zorder=3)
        if budget is not None:
            ax.axhline(budget, color="gray", linestyle="--", linewidth=1, label="budget")
        ax.set_title(f"budget {budget:g}" if budget is not None else "no budgeted method")
        ax.set_xlabel("layer")
        ax.set_xticks(x)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"{key} (mean over KV heads)")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# a NAtS fine-tuning run (nats-train experiment=finetune_smollm2_nats)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class FinetuneRun:
    """``curves``: csv/metrics.csv as {metric: {optimizer step: value}}; ``stats``: nats_stats.json (None if
    absent), the last validation's KV statistics per layer (``per_layer``) and per layer and KV head."""

    path: Path
    curves: dict[str, dict[int, float]]
    stats: dict[str, Any] | None


def finetune_dir_of(run: EvalRun) -> Path | None:
    """The fine-tuning run whose scorers `run` evaluated (the folder of its ``scorers.pt``), if it is still there."""
    scorers = run.settings.get("scorers")
    folder = Path(scorers).parent if scorers else None
    if folder is not None and ((folder / STATS_FILE).is_file() or (folder / "csv").is_dir()):
        return folder
    return None


def load_finetune_run(folder: str | Path) -> FinetuneRun:
    """Read a fine-tuning run folder (its newest ``csv/**/metrics.csv`` and ``nats_stats.json``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass a fine-tuning run (logs/finetune_smollm2_nats/runs/…)")
    files = sorted((folder / "csv").rglob(METRICS))
    stats_file = folder / STATS_FILE
    if not files and not stats_file.is_file():
        raise ValueError(
            f"{folder} is not a NAtS fine-tuning run folder: no {STATS_FILE} and no csv/{METRICS} (nats-train "
            "experiment=finetune_smollm2_nats writes the first at every validation, the second with logger=csv)"
        )
    curves: dict[str, dict[int, float]] = {}
    if files:
        with open(files[-1], newline="") as f:
            for row in csv.DictReader(f):
                if not row.get("step"):
                    continue
                step = int(row["step"]) + 1  # Lightning logs the 0-based index of the step being taken
                for k, v in row.items():
                    if k not in ("step", "epoch") and v not in ("", None):
                        curves.setdefault(k, {})[step] = float(v)
    stats = json.loads(stats_file.read_text()) if stats_file.is_file() else None
    return FinetuneRun(folder, curves, stats)


def plot_distillation(ft: FinetuneRun):
    """The distillation curve: train / validation MSE and density (the KV area fraction) per optimizer step."""
    import matplotlib.pyplot as plt

    if not any(k in ft.curves for k in ("train/mse", "val/mse")):
        raise ValueError(f"{ft.path}: no train/mse or val/mse logged (run the fine-tuning with logger=csv)")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, ax in (("train/mse", a1), ("val/mse", a1), ("train/density", a2), ("val/density", a2)):
        c = ft.curves.get(key)
        if c:
            ax.plot(list(c), list(c.values()), marker="o" if key.startswith("val") else None, label=key)
    a1.set_ylabel("MSE of the final hidden states")
    a2.set_ylabel("KV area fraction (density)")
    for ax in (a1, a2):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def plot_finetune_layers(ft: FinetuneRun, run: EvalRun | None = None):
    """The last validation's KV area and peak fraction per layer (dots: KV heads); with `run`, its NAtS area and
    kv_fraction per layer beside them (the evaluation's prompts may be longer than the fine-tuning's)."""
    import matplotlib.pyplot as plt

    if ft.stats is None:
        raise ValueError(f"{ft.path}: no {STATS_FILE} (written at every validation of the fine-tuning)")
    per, heads = ft.stats["per_layer"], ft.stats["per_layer_head"]
    x = np.arange(len(per["density"]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(x, per["density"], marker="o", label="fine-tuning val: area")
    ax.plot(x, per["peak"], marker="s", label="fine-tuning val: peak")
    for i, hs in enumerate(heads["density"]):
        ax.scatter([i] * len(hs), hs, s=10, color="gray", alpha=0.6, zorder=3)
    if run is not None and run.nats is not None:
        layers = run.methods[run.nats]
        ax.plot(x, layers["area"].mean(1), linestyle="--", marker="*", label=f"eval {run.nats}: area")
        ax.plot(x, layers["kv_fraction"].mean(1), linestyle="--", marker="x", label=f"eval {run.nats}: kv_fraction")
    ax.set_xlabel("layer")
    ax.set_xticks(x)
    ax.set_ylabel("KV fraction (mean over KV heads)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"step {ft.stats['step']}, W = {ft.stats['window']}, {ft.stats['examples']} validation examples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# a tiny offline demo: both folders in seconds on a CPU
# ----------------------------------------------------------------------------------------------------------------
def demo_runs(root: str | Path, n_layer: int = 4, steps: int = 6, quiet: bool = True) -> tuple[Path, Path]:
    """``(eval run, fine-tuning run)`` under `root`: a random `n_layer`-layer Llama (hidden 64, 4 heads / 2 KV
    heads) with a byte-level BPE tokenizer trained on the data generators' text, its NAtS scorers (W = 16)
    fine-tuned for `steps` steps by ``nats-train`` (csv logger), and ``nats-eval-hf`` on 2 examples each of
    passkey, niah and variable tracking (280-320 tokens) with full, nats, streaming_llm, snapkv and pyramidkv at
    budgets 0.5 and 0.25: the two commands run as a user runs them (:func:`demo_commands`), each in a process of
    its own. The model is random: every accuracy is ~0, only the KV fractions mean something. Reused if already
    there. ``quiet``: the commands' output is kept (and shown only if one fails)."""
    import subprocess
    import sys

    from nats.finetune.evaluate import SUMMARY
    from nats.hf.pretrained import save_tiny_random_llama

    root = Path(root)
    model, ft, ev = root / "model", root / "finetune", root / "eval"
    if not (model / "config.json").is_file():
        save_tiny_random_llama(model, n_layer=n_layer)
    train, evaluate = demo_commands(root, steps)
    for done, (module, overrides) in ((ft / "scorers.pt", train), (ev / SUMMARY, evaluate)):
        if done.is_file():
            continue
        cmd = [sys.executable, "-m", module, *overrides]
        res = subprocess.run(cmd, capture_output=quiet, text=True, check=False)
        if res.returncode != 0:
            output = f":\n{(res.stdout or '')[-2000:]}{(res.stderr or '')[-4000:]}" if quiet else ""
            raise RuntimeError(f"the demo's command failed (exit status {res.returncode}): {' '.join(cmd)}{output}")
    return ev, ft


def demo_commands(root: str | Path, steps: int = 6) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
    """The demo's two commands as ``(module, overrides)``: ``nats-train`` fine-tuning the scorers of the model in
    ``root/model`` into ``root/finetune``, then ``nats-eval-hf`` of those scorers into ``root/eval``."""
    root = Path(root)
    model, ft, ev, data = root / "model", root / "finetune", root / "eval", root / "data"
    common = [f"paths.data_dir={data}", f"hf_model.name_or_path={model}", "hf_model.max_context=512"]
    common += ["data.pg19_path=null"]
    train = [
        *common,
        f"hydra.run.dir={ft}",
        f"paths.output_dir={ft}",
        f"paths.log_dir={ft}/logs",
        "experiment=finetune_smollm2_nats",
        "trainer=cpu",
        "trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false",
        "data.max_length=384",
        "data.min_length=320",
        "data.tasks=[passkey,niah]",
        "data.num_examples=4",
        "data.num_val_examples=1",
        "module.window=16",
        "module.init_std=0.5",
        "global_batch_size=1",
        f"trainer.max_steps={steps}",
        f"optim.max_steps={steps}",
        "eval_every=2",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "callbacks.progress_bar=null",
        "callbacks.throughput=null",
        "final_validation=false",
    ]
    evaluate = [
        *common,
        f"hydra.run.dir={ev}",
        f"paths.output_dir={ev}",
        f"paths.log_dir={ev}/logs",
        f"scorers={ft / 'scorers.pt'}",
        "methods=[full,nats,streaming_llm,snapkv,pyramidkv]",
        "budgets=[0.5,0.25]",
        "data.tasks=[passkey,niah,variable_tracking]",
        "data.num_examples=2",
        "data.max_length=320",
        "data.min_length=280",
        "answer_margin=2",
        "device=cpu",
        "backend=torch",
        "progress=false",
    ]
    return ("nats.train", train), ("nats.eval_hf", evaluate)
