"""Report of a NAtS scorer fine-tuning run (`nats-train experiment=finetune_smollm2_nats`).

    python experiments/finetune_report.py <run folder> [--out DIR] [--name finetune_smollm2]

Reads the run folder (``csv/metrics.csv``, ``nats_stats.json``, ``step_times.json`` when the run had
``'callbacks=[default,step_timer]'``, ``metrics.json``) and writes into ``--out`` (default: the run folder):

* ``<name>.md``: first the last validation (MSE, KV area, peak) and the time per optimizer step, then the
  distillation curve (train MSE, density, validation MSE and density at each validation), the date, command and
  setting, and the learned KV area / peak fractions per layer (and per KV head);
* ``<name>_loss.png``: train MSE and density per step, validation MSE and density;
* ``<name>_kv_layers.png``: KV area and peak fraction per layer, one mark per KV head.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import date
from pathlib import Path

from nats.finetune.analysis import FinetuneRun, load_finetune_run, plot_distillation, plot_finetune_layers


def read_run(run: Path) -> FinetuneRun:
    """The run's curves (csv/metrics.csv as {metric: {optimizer step: value}}) and nats_stats.json."""
    try:
        ft = load_finetune_run(run)
    except (ValueError, FileNotFoundError):  # neither csv/ nor nats_stats.json, or no folder
        ft = None
    if ft is None or not ft.curves:
        raise SystemExit(f"no csv/metrics.csv in {run}: was the run logged with logger=tensorboard_csv or csv?")
    return ft


def step_seconds(run: Path) -> dict[str, float] | None:
    """Median seconds per optimizer step (steps whose interval holds no validation) and the first step's."""
    path = run / "step_times.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    ends, vals = rec["step_end"], [v for v in rec["val"] if v[1] is not None]
    gaps = []
    for a, b in zip(ends, ends[1:]):
        if not any(a <= v0 <= b for v0, _ in vals):
            gaps.append(b - a)
    first = ends[0] - rec["train_start"] if ends and rec.get("train_start") is not None else float("nan")
    return {"median": statistics.median(gaps) if gaps else float("nan"), "first": first, "steps": len(ends)}


def fmt(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def report(run: Path, out: Path, name: str, command: str = "") -> str:
    ft = read_run(run)
    curves, stats = ft.curves, ft.stats
    timing = step_seconds(run)
    cfg_path = run / ".hydra" / "config.yaml"
    setting = ""
    if cfg_path.is_file():
        import yaml

        cfg = yaml.safe_load(cfg_path.read_text())
        m, d = cfg.get("module", {}), cfg.get("data", {})
        max_steps = cfg.get("trainer", {}).get("max_steps")
        ran = timing["steps"] if timing else None
        # a run stopped early (trainer.max_time, an interruption) says how far it got
        steps = f"{max_steps}" if ran is None or ran >= (max_steps or 0) else f"{ran} (of max_steps {max_steps})"
        setting = (
            f"model `{cfg.get('hf_model', {}).get('name_or_path')}`, W = {m.get('window')}, lambda = "
            f"{m.get('sparsity_lambda')}, {steps} optimizer steps of "
            f"{cfg.get('global_batch_size')} examples, tasks {d.get('tasks')}, lengths "
            f"{d.get('min_length') or d.get('max_length', 0) // 2}-{d.get('max_length')} tokens, precision "
            f"{cfg.get('trainer', {}).get('precision')}"
        )
    val_steps = sorted(curves.get("val/mse", {}))
    answer = []  # the answer first: the last validation against the first, and the time per step
    if val_steps:
        first, last = val_steps[0], val_steps[-1]
        earlier = f" ({fmt(curves['val/mse'][first])} at step {first})" if first != last else ""
        answer.append(
            f"After {last} optimizer steps the validation distillation MSE is {fmt(curves['val/mse'][last])}{earlier}"
            f", at a KV area (density) of {fmt(curves.get('val/density', {}).get(last))} and a peak of "
            f"{fmt(curves.get('val/peak', {}).get(last))}."
        )
    if timing:
        answer.append(
            f"Time per optimizer step: **{timing['median']:.3f} s** (median over {timing['steps']} steps, "
            f"validations excluded); the first step took {timing['first']:.1f} s (Triton compile and autotune)."
        )
    lines = [f"# NAtS scorer fine-tuning: {run.name}", ""]
    if answer:
        lines += [" ".join(answer), ""]
    lines += [
        "| step | train MSE | train density | val MSE | val density | val peak |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    train_steps = sorted(curves.get("train/mse", {}))
    for s in sorted(set(train_steps[:: max(1, len(train_steps) // 15)]) | set(val_steps)):
        lines.append(
            f"| {s} | {fmt(curves.get('train/mse', {}).get(s))} | {fmt(curves.get('train/density', {}).get(s))} | "
            f"{fmt(curves.get('val/mse', {}).get(s))} | {fmt(curves.get('val/density', {}).get(s))} | "
            f"{fmt(curves.get('val/peak', {}).get(s))} |"
        )
    lines += [
        "",
        f"{date.today().isoformat()}: `{command or 'python experiments/finetune_report.py ' + str(run)}`"
        + (f"; {setting}" if setting else "")
        + ".",
        "",
        f"![distillation curve]({name}_loss.png)",
    ]
    if stats:
        per = stats["per_layer"]
        lines += [
            "",
            f"## KV kept per layer (validation, step {stats['step']})",
            "",
            f"{stats['examples']} examples, W = {stats['window']}: mean area {stats['mean']['density']:.3f}, mean "
            f"peak {stats['mean']['peak']:.3f}.",
            "",
            "| layer | area | peak | area per KV head |",
            "|---:|---:|---:|---|",
        ]
        heads = stats["per_layer_head"]["density"]
        for i, (a, p) in enumerate(zip(per["density"], per["peak"])):
            lines.append(f"| {i} | {a:.3f} | {p:.3f} | {', '.join(f'{h:.3f}' for h in heads[i])} |")
        lines += ["", f"![KV area and peak per layer and KV head]({name}_kv_layers.png)"]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # the notebook's plots (nats.finetune.analysis): the distillation curve, the learned KV per layer and KV head
        figures = {"loss": plot_distillation(ft)}
        if stats:
            figures["kv_layers"] = plot_finetune_layers(ft)
        for suffix, fig in figures.items():
            fig.savefig(out / f"{name}_{suffix}.png", dpi=120)
            plt.close(fig)
    except ImportError as err:  # matplotlib missing: the table is enough
        print(f"no plots: {err}")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="finetune_smollm2")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "experiments/finetune_report.py", *(sys.argv[1:] if argv is None else argv)])
    print(report(args.run, args.out or args.run, args.name, command))


if __name__ == "__main__":
    main()
