"""One table and plot from several `nats-eval-hf` runs on the same examples.

    python experiments/hf_study_table.py <results.jsonl> [<results.jsonl> ...] --out DIR [--name hf_study]
        [--target-kv 0.25] [--target-points 2] [--baseline-loss 5] [--nats LABEL=<results.jsonl> ...] [--note TEXT]

The runs' rows (``results.jsonl``, one per method, budget and example) are put together, a later file's row
replacing an earlier one's for the same method, budget, task and example: e.g. the baselines of one run (they do
not depend on the NAtS scorers) with ``full`` and ``nats`` of a later run with better scorers. Every file must
hold the same examples (the same prompts) for the methods it is taken for. Writes ``<name>.md`` (a title and the
answer in a few lines: each row's mean accuracy against the full cache and the target's verdict; the table of
`nats.finetune.evaluate`, then the KV target checked: NAtS at <= ``--target-kv`` of the KV cache within
``--target-points`` of the full cache's mean accuracy, the baselines at that budget losing >= ``--baseline-loss``,
with a paired bootstrap interval of each method's difference to the full cache),
``<name>.png`` (accuracy against KV kept and KV area) and ``<name>_kv_fractions.json``.

``--nats LABEL=FILE`` (repeatable) compares several NAtS scorers on the same examples: the NAtS rows of FILE
become a method of their own named LABEL (each is checked against the target), and the NAtS rows of the
positional files are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nats.finetune.evaluate import _name, kv_fractions, markdown_table, plot, read_rows, row_key, summarize


def merge(files: list[Path], nats: list[tuple[str, Path]] = ()) -> tuple[list[dict], list[dict], list[str], str]:
    """Rows of every file (later files win per key), the runs in order of first appearance, the tasks, a header.
    ``nats``: (label, file) pairs whose NAtS rows are taken as the method ``label``; with any, the NAtS rows of
    ``files`` are left out."""
    rows: dict[tuple, dict] = {}
    runs: dict[tuple, dict] = {}
    tasks: list[str] = []
    header = ""
    sources = [(f, None) for f in files] + [(f, label) for label, f in nats]
    for f, label in sources:
        summary_file = f.parent / f.name.replace("results.jsonl", "summary.json")
        if summary_file.is_file() and label is None:
            header = json.loads(summary_file.read_text()).get("header", "") or header  # the last file's
        for r in read_rows(f):
            if nats and (r["policy"] == "nats") == (label is None):
                continue  # positional files: all but NAtS; --nats files: NAtS only
            if label is not None:
                r = {**r, "method": label, "label": label}
            key = row_key(r)
            if key in rows and rows[key]["prompt_tokens"] != r["prompt_tokens"]:
                raise ValueError(
                    f"{f}: {r['task']} example {r['index']} has {r['prompt_tokens']} prompt tokens, an earlier file "
                    f"{rows[key]['prompt_tokens']}: the runs were not on the same examples"
                )
            rows[key] = r
            runs.setdefault((r["method"], r["budget"]), {k: r[k] for k in ("method", "label", "policy", "budget")})
            if r["task"] not in tasks:
                tasks.append(r["task"])
    return list(rows.values()), list(runs.values()), tasks, header


def paired_interval(rows: list[dict], method: dict, ref: str = "full", n: int = 2000, seed: int = 0):
    """95% bootstrap interval of (method - ref)'s mean accuracy over tasks, in points, resampling the examples
    of each task that both have (paired); None when they share no example."""
    import random

    def scores(m, b):
        return {(r["task"], r["index"]): r["score"] for r in rows if r["method"] == m and r["budget"] == b}

    a, r = scores(method["method"], method["budget"]), scores(ref, None)
    by_task: dict[str, list[float]] = {}
    for key in sorted(set(a) & set(r)):
        by_task.setdefault(key[0], []).append(a[key] - r[key])
    if not by_task:
        return None
    rng = random.Random(seed)
    stats = sorted(
        100 * sum(sum(rng.choices(d, k=len(d))) / len(d) for d in by_task.values()) / len(by_task) for _ in range(n)
    )
    return stats[int(0.025 * n)], stats[int(0.975 * n) - 1]


def target_check(summary: list[dict], target_kv: float, points: float, loss: float, rows=()) -> list[str]:
    """The KV target, method by method: lines of markdown."""
    full = next((s for s in summary if s["method"] == "full"), None)
    if full is None:
        return ["No `full` run: the target (points from the full cache) cannot be checked."]
    ref = 100 * full["mean_accuracy"]
    lines = [
        f"Target: NAtS at <= {target_kv:g} of the KV cache within {points:g} points of the full cache "
        f"({ref:.1f}); the baselines at that budget losing >= {loss:g} points.",
        "",
        "| method @ budget | mean | vs full | 95% interval | KV kept | KV peak | KV area | holds |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        if s["method"] == "full":
            continue
        acc = 100 * s["mean_accuracy"]
        delta = acc - ref
        kv = s["kv_fraction"]
        if s["policy"] == "nats":
            misses = ([f"KV kept {kv:.3f} > {target_kv:g}"] if kv > target_kv else []) + (
                [f"{-delta:.1f} points lost"] if delta < -points else []
            )
            why = "no: " + ", ".join(misses) if misses else "yes"
        elif s["budget"] is not None and abs(s["budget"] - target_kv) < 1e-9:
            why = "yes (loses >= the margin)" if delta <= -loss else f"no: loses only {-delta:.1f} points"
        else:
            why = ""
        ci = paired_interval(list(rows), s)
        ci_text = "" if ci is None else f"{ci[0]:+.1f} .. {ci[1]:+.1f}"
        lines.append(
            f"| {_name(s)} | {acc:.1f} | {delta:+.1f} | {ci_text} | {kv:.3f} | {s['peak']:.3f} | {s['area']:.3f} "
            f"| {why} |"
        )
    lines += [
        "",
        "95% interval: bootstrap (2000 resamples) of the difference to the full cache, resampling the examples of "
        "each task that both ran (paired).",
    ]
    return lines


def answer(summary: list[dict], target_kv: float, points: float) -> str:
    """The file's opening lines: the full cache's mean accuracy, each NAtS row and each baseline at the target
    budget against it, and which NAtS rows meet the target (as `target_check` decides)."""
    full = next((s for s in summary if s["method"] == "full"), None)
    if full is None:
        return "No `full` run: nothing to compare against."
    ref = 100 * full["mean_accuracy"]

    def item(s):
        acc = 100 * s["mean_accuracy"]
        return f"{_name(s)} {acc:.1f} ({acc - ref:+.1f}) at {s['kv_fraction']:.3f} of the KV kept"

    nats = [s for s in summary if s["policy"] == "nats"]
    base = [
        s for s in summary if s["policy"] != "nats" and s["budget"] is not None and abs(s["budget"] - target_kv) < 1e-9
    ]
    met = [s for s in nats if s["kv_fraction"] <= target_kv and 100 * s["mean_accuracy"] - ref >= -points]
    text = f"Mean accuracy over the tasks: full cache {ref:.1f}"
    text += "".join(f"; {item(s)}" for s in nats + base) + "."
    verdict = ", ".join(_name(s) for s in met) if met else "no NAtS row"
    return text + f" **Target (<= {target_kv:g} of the KV kept, within {points:g} points) met by {verdict}.**"


def labelled_files(items: list[str]) -> list[tuple[str, Path]]:
    """``--nats LABEL=FILE`` arguments as (label, file) pairs."""
    pairs = []
    for item in items:
        label, sep, file = item.rpartition("=")  # the last "=": a label may hold one (s=1)
        if not sep or not label or not file:
            raise SystemExit(f"--nats {item!r}: expected LABEL=FILE, e.g. 'lambda 0.3=<run>/results.jsonl'")
        pairs.append((label, Path(file)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="results.jsonl of nats-eval-hf runs (later ones win)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="hf_study")
    p.add_argument("--target-kv", type=float, default=0.25)
    p.add_argument("--target-points", type=float, default=2.0)
    p.add_argument("--baseline-loss", type=float, default=5.0)
    p.add_argument("--note", default="", help="a line under the answer (date or commit, machine, command)")
    p.add_argument(
        "--nats",
        nargs="*",
        action="extend",  # repeatable: --nats A --nats B (plain nargs="*" kept only the last one)
        default=[],
        metavar="LABEL=FILE",
        help="the NAtS rows of FILE as the method LABEL (several scorers in one table)",
    )
    args = p.parse_args(argv)
    nats = labelled_files(args.nats)
    for f in [*args.results, *(f for _, f in nats)]:
        if not f.is_file():
            raise SystemExit(f"{f} does not exist: pass the results.jsonl files of nats-eval-hf runs")
    rows, runs, tasks, header = merge(args.results, nats)
    summary = summarize(rows, runs, tasks)
    header = header or f"accuracy vs KV budget ({len(rows)} rows)"
    if nats:  # the header names the positional run's scorers, which are not in the table
        header = header.split(", NAtS scorers ")[0] + ", NAtS: one row per scorer set (--nats)"
    title = header.split(":")[0] if ":" in header else "nats-eval-hf runs"
    text = f"# {title}: accuracy against the KV kept\n\n{answer(summary, args.target_kv, args.target_points)}\n\n"
    if args.note:
        text += f"{args.note}\n\n"
    text += markdown_table(summary, tasks, header)
    check = target_check(summary, args.target_kv, args.target_points, args.baseline_loss, rows)
    text += "\n" + "\n".join(check) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}_kv_fractions.json").write_text(json.dumps(kv_fractions(rows, summary)))
    plot(summary, args.out / f"{args.name}.png", header.split(":")[0])
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
