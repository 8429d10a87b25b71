"""kvpress as the judge of the baselines, one table and plot from `nats-eval-hf` runs on the same
examples (docs/kvpress.md).

    python experiments/kvpress_comparison.py <results.jsonl> [<results.jsonl> ...] --out docs/results \
        --name kvpress_comparison_smollm2_n16 [--pair snapkv@0.25=kvpress_snapkv@0.25 ...] [--nats LABEL=FILE]
        [--exclude METHOD ...] [--note TEXT]

The runs' rows are merged as `experiments/hf_study_table.py` merges them (a later file's row replaces an earlier
one's for the same method, budget, task and example; the prompts must agree). Writes ``<name>.md``:

* the table of `nats.finetune.evaluate` (accuracy per task, mean, KV area / peak / kept);
* every method against the full cache: the mean difference on the examples both ran and its paired 95% bootstrap
  interval;
* each ``--pair A=B`` (method@budget, no budget for unbudgeted ones; e.g. the project's method = kvpress'):
  B - A with its paired bootstrap interval (resampling the examples of each task that both ran) and whether they
  agree (the interval holds 0);

and ``<name>.png`` (accuracy against KV kept and KV area).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_study_table import labelled_files, merge  # noqa: E402

from nats.finetune.evaluate import _name, markdown_table, plot, summarize  # noqa: E402


def parse_method(text: str) -> tuple[str, float | None]:
    name, _, budget = text.partition("@")
    return name, float(budget) if budget else None


def paired(rows: list[dict], a: tuple[str, float | None], b: tuple[str, float | None], n: int = 2000, seed: int = 0):
    """(mean of B - A over tasks in points, 95% bootstrap interval, examples paired): resampling, per task, the
    examples that both ran; None when they share none."""

    def scores(m):
        return {(r["task"], r["index"]): r["score"] for r in rows if (r["method"], r["budget"]) == m}

    sa, sb = scores(a), scores(b)
    by_task: dict[str, list[float]] = {}
    for key in sorted(set(sa) & set(sb)):
        by_task.setdefault(key[0], []).append(sb[key] - sa[key])
    if not by_task:
        return None
    mean = 100 * sum(sum(d) / len(d) for d in by_task.values()) / len(by_task)
    rng = random.Random(seed)
    stats = sorted(
        100 * sum(sum(rng.choices(d, k=len(d))) / len(d) for d in by_task.values()) / len(by_task) for _ in range(n)
    )
    return mean, (stats[int(0.025 * n)], stats[int(0.975 * n) - 1]), sum(len(d) for d in by_task.values())


def answer(summary: list[dict], pairs: list[tuple]) -> str:
    """The file's opening lines: the full cache's mean accuracy, the range of the others', and how many ``--pair``
    comparisons agree (with the differing ones named)."""
    full = next((s for s in summary if s["method"] == "full"), None)
    others = [s for s in summary if s is not full]
    text = ""
    if full is not None and others:
        low, high = min(others, key=lambda s: s["mean_accuracy"]), max(others, key=lambda s: s["mean_accuracy"])
        text = (
            f"Mean accuracy over the tasks: full cache {100 * full['mean_accuracy']:.1f}; the other rows from "
            f"{100 * low['mean_accuracy']:.1f} ({_name(low)}) to {100 * high['mean_accuracy']:.1f} ({_name(high)}). "
        )
    if pairs:
        differ = [f"{p[0]} -> {p[1]} {p[4]:+.1f}" for p in pairs if p[7] == "no"]
        agree = len(pairs) - len(differ)
        text += f"**{agree} of {len(pairs)} pairs agree** (the paired 95% interval of B - A holds 0)"
        text += f"; differ: {', '.join(differ)}." if differ else "."
    return text.strip() or "No full cache and no pair: nothing to compare."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="kvpress_comparison")
    p.add_argument("--pair", action="append", default=[], metavar="A=B", help="method@budget=method@budget")
    p.add_argument("--nats", action="append", default=[], metavar="LABEL=FILE")
    p.add_argument("--note", default="", help="a line under the answer (machine, versions)")
    p.add_argument("--exclude", action="append", default=[], metavar="METHOD", help="leave this method out")
    p.add_argument(
        "--plot-exclude",
        action="append",
        default=[],
        metavar="METHOD",
        help="leave this method out of the plot only (its colour cycle has 10 colours)",
    )
    args = p.parse_args(argv)
    nats = labelled_files(args.nats)
    rows, runs, tasks, header = merge(args.results, nats)
    rows = [r for r in rows if r["method"] not in args.exclude]
    runs = [r for r in runs if r["method"] not in args.exclude]
    summary = summarize(rows, runs, tasks)
    header = header.split(", NAtS scorers ")[0] + (", NAtS: " + ", ".join(label for label, _ in nats) if nats else "")
    pairs = []  # (A, B, A mean, B mean, B - A, (lo, hi), examples, agree)
    means = {(s["method"], s["budget"]): 100 * s["mean_accuracy"] for s in summary}
    for item in args.pair:
        left, _, right = item.partition("=")
        a, b = parse_method(left), parse_method(right)
        d = paired(rows, a, b)
        if d is None:
            raise SystemExit(f"--pair {item}: the two methods share no example")
        mean, (lo, hi), n = d
        pairs.append((left, right, means[a], means[b], mean, (lo, hi), n, "yes" if lo <= 0 <= hi else "no"))
    title = header.split(":")[0] if ":" in header else "nats-eval-hf runs"
    text = f"# {title}: kvpress beside the project's methods\n\n{answer(summary, pairs)}\n\n"
    if args.note:
        text += f"{args.note}\n\n"
    text += markdown_table(summary, tasks, header)
    full = next((s for s in summary if s["method"] == "full"), None)
    if full is not None:
        text += (
            "\n| method @ budget | mean | vs full | 95% interval | KV kept | KV peak | KV area |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n"
        )
        for s in summary:
            if s is full:
                continue
            d = paired(rows, ("full", None), (s["method"], s["budget"]))
            ci = "" if d is None else f"{d[1][0]:+.1f} .. {d[1][1]:+.1f}"
            # paired: the difference on the examples both ran (a run stopped early has fewer than full)
            delta = d[0] if d is not None else 100 * (s["mean_accuracy"] - full["mean_accuracy"])
            text += (
                f"| {_name(s)} | {100 * s['mean_accuracy']:.1f} | {delta:+.1f} | {ci} | {s['kv_fraction']:.3f} "
                f"| {s['peak']:.3f} | {s['area']:.3f} |\n"
            )
    if args.pair:
        text += (
            "\n| A | B | A mean | B mean | B - A | 95% interval | examples | agree |\n"
            "|---|---|---:|---:|---:|---:|---:|---|\n"
        )
        for left, right, mean_a, mean_b, mean, (lo, hi), n, agree in pairs:
            text += (
                f"| {left} | {right} | {mean_a:.1f} | {mean_b:.1f} | {mean:+.1f} | {lo:+.1f} .. {hi:+.1f} | {n} "
                f"| {agree} |\n"
            )
    text += (
        "\n95% interval: bootstrap (2000 resamples) of the difference of the mean accuracy over tasks, resampling "
        "the examples of each task that both methods ran (paired).\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    shown = [s for s in summary if s["method"] not in args.plot_exclude]
    plot(shown, args.out / f"{args.name}.png", header.split(":")[0] + ": kvpress beside the project's methods")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
