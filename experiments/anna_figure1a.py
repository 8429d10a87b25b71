"""Reproduce Figure 1a of ANNA (Liu, Yu, Sanford, Andoni, Hsu, NeurIPS 2025) on a CPU.

For each task (Match2, induction heads) and each beta in {0.1, 1, 10}: train the one-layer, one-head softmax
surrogate with Lightning through the same Hydra configs as `nats-train experiment=anna_<task>
model.attention.beta=<beta>` (Adam at peak lr 0.01: 1000 warm-up steps, cosine to 1e-4, gradient norm clipped
at 1.0; batch 32, 10000 training samples), then evaluate the
trained weights with ANNA attention in place of the surrogate (l in {1, 2, 4, 8} tables, z in {1, 2} bits)
on the 256 test samples. ANNA's hashing is random: each (l, z) cell is the mean over --hash-seeds draws of
the planes (min and max in the JSON).

    python experiments/anna_figure1a.py                  # 20000 steps, as the paper
    python experiments/anna_figure1a.py --steps 2000     # shorter
    python experiments/anna_figure1a.py --eval-only      # re-evaluate the saved weights

Writes docs/results/anna_figure1a.{md,json,png} (merging with the rows of other tasks/betas already in
the JSON, unless --fresh); weights and CSV logs go to logs/anna_figure1a/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def task_error(model, loader) -> float:
    """Fraction of wrong predictions over all positions with a target (y != -100)."""
    model.eval()
    wrong = total = 0
    for x, y in loader:
        pred = model(x).logits.argmax(-1)
        keep = y != -100
        wrong += int((pred != y)[keep].sum())
        total += int(keep.sum())
    return wrong / total


def compose_cfg(task: str, beta: float, steps: int, run_dir: Path, extra: list[str]):
    from nats.train import compose_config

    return compose_config(
        [
            f"experiment=anna_{task}",
            f"model.attention.beta={beta}",
            f"trainer.max_steps={steps}",
            f"paths.output_dir={run_dir}",
            "callbacks=none",
            "trainer.enable_progress_bar=false",
            "+trainer.enable_model_summary=false",
            "final_validation=false",
            *extra,
        ]
    )


def train_one(task: str, beta: float, steps: int, run_dir: Path, extra: list[str]) -> tuple[object, object, float]:
    from nats.train import fit_in

    datamodule, module, _, seconds = fit_in(compose_cfg(task, beta, steps, run_dir, extra), run_dir)
    torch.save(module.model.state_dict(), run_dir / "model.pt")
    return module.model, datamodule, seconds


def load_one(task: str, beta: float, steps: int, run_dir: Path, extra: list[str]):
    import hydra

    from nats.models.gpt import GPT, GPTConfig

    cfg = compose_cfg(task, beta, steps, run_dir, extra)
    datamodule = hydra.utils.instantiate(cfg.data)
    from omegaconf import OmegaConf

    model = GPT(GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)))
    model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu"))
    return model, datamodule


def run_optim(run_dir: Path) -> dict | None:
    """The resolved optimiser settings the run was trained with (from its saved config.yaml)."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(path).optim) if path.exists() else None


def evaluate(model, datamodule, ls, zs, hash_seeds: int) -> dict:
    from nats.attention.anna import use_anna

    datamodule.setup("test")
    loader = datamodule.test_dataloader()
    out = {"surrogate": task_error(model, loader), "anna": {}}
    for z in zs:
        for l in ls:
            errs = [task_error(use_anna(model, l=l, z=z, seed=s), loader) for s in range(hash_seeds)]
            out["anna"][f"l={l},z={z}"] = {"mean": sum(errs) / len(errs), "min": min(errs), "max": max(errs)}
    return out


def merge_results(results: list[dict], path: Path) -> list[dict]:
    """Rows of an earlier JSON that this run did not redo (other tasks or betas), then this run's rows; an
    --eval-only row keeps the training time of the row it re-evaluates."""
    if not path.exists():
        return results
    old = json.loads(path.read_text())["results"]
    key = lambda r: (r["task"], float(r["beta"]))  # noqa: E731
    mine = {key(r): r for r in results}
    for r in old:
        new = mine.get(key(r))
        if new is not None and new.get("train_seconds") is None and new["steps"] == r["steps"]:
            new["train_seconds"] = r.get("train_seconds")
    merged = [r for r in old if key(r) not in mine] + results
    order = {"match2": 0, "induction": 1}
    return sorted(merged, key=lambda r: (order.get(r["task"], 9), float(r["beta"])))


def answer(results: list[dict], ls: list[int], zs: list[int]) -> str:
    """The sentence the file opens with: ANNA's error at the fewest and the most hash tables (the fewest bits),
    and how far above the surrogate's own error it stays, read from the table's rounded values."""
    lo, hi, z = min(ls), max(ls), min(zs)

    def cells(l: int) -> list[float]:
        return [float(f"{r['anna'][f'l={l},z={z}']['mean']:.4f}") for r in results if f"l={l},z={z}" in r["anna"]]

    def span(xs: list[float]) -> str:
        return f"{min(xs):.4f}" if min(xs) == max(xs) else f"{min(xs):.4f}-{max(xs):.4f}"

    rows = [r for r in results if f"l={hi},z={z}" in r["anna"]]
    if not rows:
        return ""
    gaps = [(float(f"{r['anna'][f'l={hi},z={z}']['mean']:.4f}") - float(f"{r['surrogate']:.4f}"), r) for r in rows]
    gap, worst = max(gaps, key=lambda g: g[0])
    above = (
        f"at most {gap:.4f} above the surrogate's own error ({worst['task']}, beta {worst['beta']:g})"
        if gap > 0
        else "not above the surrogate's own error"
    )
    return (
        f"**The answer.** The surrogate-trained weights evaluated with ANNA attention (z = {z} bit{'s' * (z > 1)} per "
        f"hash) err on {span(cells(lo))} of the test positions with l = {lo} hash table{'s' * (lo > 1)} and "
        f"{span(cells(hi))} with l = {hi}: {above}."
    )


def wrap(text: str) -> list[str]:
    """Lines of at most 118 characters, never broken around an " = "."""
    return [line.replace("\0", " ") for line in textwrap.wrap(text.replace(" = ", "\0=\0"), 118)]


def markdown(results: list[dict], args, provenance: str, plot: bool = True) -> list[str]:
    """The result file: the answer, the table, its provenance line, what the columns mean, the plot."""
    cols = [(l, z) for z in args.zs for l in args.ls]
    lines = [
        "# ANNA Figure 1a: test error of surrogate-trained models evaluated with ANNA attention",
        "",
        *wrap(answer(results, args.ls, args.zs)),
        "",
        "| task | beta | steps | train s | surrogate | " + " | ".join(f"l={l} z={z}" for l, z in cols) + " |",
        "|---|---|---|---|---|" + "---|" * len(cols),
    ]
    for r in results:
        cells = [f"{r['anna'][f'l={l},z={z}']['mean']:.4f}" if f"l={l},z={z}" in r["anna"] else "-" for l, z in cols]
        secs = f"{r['train_seconds']:.0f}" if r.get("train_seconds") is not None else "-"
        lines.append(
            f"| {r['task']} | {r['beta']:g} | {r['steps']} | {secs} | {r['surrogate']:.4f} | "
            + " | ".join(cells)
            + " |"
        )
    notes = (
        "Test error over all target positions of the 256 test samples; `surrogate`: the trained softmax surrogate; "
        f"`l=.. z=..`: the same weights with ANNA attention, l hash tables of z bits, mean over {args.hash_seeds} "
        "draws of the planes. One layer, one head, d = 64, MLP 4d GELU; Adam, peak lr 0.01, 1000 warm-up steps, "
        "cosine to 1e-4, gradient norm clipped at 1.0, batch 32, 10000 training samples"
        + (f"; overrides: `{' '.join(args.overrides)}`" if args.overrides else "")
        + "."
    )
    lines += ["", provenance, "", *wrap(notes)]
    if plot:
        lines += ["", f"![ANNA test error against l, per task and z; dotted: the surrogate]({args.name}.png)"]
    return lines


def provenance() -> str:
    """Date, commit and machine of this run, and the command that reproduces it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    command = " ".join(["python experiments/anna_figure1a.py", *map(shlex.quote, sys.argv[1:])])
    return (
        f"{datetime.date.today()}, commit {commit}, a shared CPU (torch threads = {torch.get_num_threads()}): "
        f"`{command}`"
    )


def write_outputs(results: list[dict], args, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"
    results = merge_results([dict(r) for r in results], path) if not args.fresh else results
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    lines = markdown(results, args, provenance())
    (out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in results))
    fig, axes = plt.subplots(
        len(tasks), len(args.zs), figsize=(4.2 * len(args.zs), 3.3 * len(tasks)), squeeze=False, sharey=True
    )
    for i, task in enumerate(tasks):
        for j, z in enumerate(args.zs):
            ax = axes[i][j]
            for k, r in enumerate(x for x in results if x["task"] == task):
                color = f"C{k}"
                ys = [r["anna"].get(f"l={l},z={z}", {}).get("mean", math.nan) for l in args.ls]
                ax.plot(args.ls, ys, "o-", color=color, label=f"beta={r['beta']:g}")
                ax.axhline(r["surrogate"], color=color, ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.ls, [str(l) for l in args.ls])
            ax.set_title(f"{task}, z={z}")
            ax.set_xlabel("l (hash tables)")
            if j == 0:
                ax.set_ylabel("test error")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="dotted: surrogate", title_fontsize=7)
    steps = ", ".join(f"{t}: {sorted({r['steps'] for r in results if r['task'] == t})}" for t in tasks)
    fig.suptitle(f"ANNA evaluation of softmax-surrogate models (steps {steps})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / f"{args.name}.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--tasks", nargs="+", default=["match2", "induction"], choices=["match2", "induction"])
    p.add_argument("--betas", nargs="+", type=float, default=[0.1, 1.0, 10.0])
    p.add_argument("--ls", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--zs", nargs="+", type=int, default=[1, 2])
    p.add_argument("--hash-seeds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--eval-only", action="store_true", help="evaluate the weights saved by an earlier run")
    p.add_argument("--fresh", action="store_true", help="do not merge with the rows of an earlier results JSON")
    p.add_argument("--log-dir", type=Path, default=ROOT / "logs" / "anna_figure1a")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--name", default="anna_figure1a", help="stem of the result files (and of the run folders)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. trainer.max_time=...")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    results = []
    for task in args.tasks:
        for beta in args.betas:
            run_dir = args.log_dir / f"{args.name}_{task}_beta{beta:g}_steps{args.steps}"
            if args.eval_only:
                model, datamodule = load_one(task, beta, args.steps, run_dir, args.overrides)
                seconds = None
            else:
                model, datamodule, seconds = train_one(task, beta, args.steps, run_dir, args.overrides)
            t0 = time.time()
            r = {
                "task": task,
                "beta": beta,
                "steps": args.steps,
                "train_seconds": seconds,
                **evaluate(model, datamodule, args.ls, args.zs, args.hash_seeds),
            }
            r["eval_seconds"] = time.time() - t0
            r["optim"] = run_optim(run_dir)
            results.append(r)
            best = r["anna"].get("l=8,z=1", {}).get("mean", math.nan)
            print(
                f"[{task} beta={beta:g}] train {seconds or 0:.0f}s surrogate error {r['surrogate']:.4f} "
                f"ANNA l=8,z=1 error {best:.4f}",
                flush=True,
            )
            write_outputs(results, args, args.out)


if __name__ == "__main__":
    main()
