"""The same evaluation through two versions of the code, side by side: a change that should not move the quality
numbers (a refactor) is shown by them.

    python experiments/carry_over.py --base DIR --out OUT gpt CKPT [CKPT ...] [-- nats-eval overrides]
    python experiments/carry_over.py --base DIR --out OUT hf [-- nats-eval-hf overrides]

``--base DIR``: a checkout of the earlier code (its ``nats/``, ``kernels/`` and ``conf/``, e.g. ``git worktree add DIR
<commit>`` or ``git archive <commit> nats kernels conf | tar -x -C DIR``); ``--head DIR``: the later code (default:
this repository; a snapshot keeps a long run apart from edits made meanwhile). Each
evaluation runs once per version in a process of its own (``python -m nats.eval`` / ``python -m nats.eval_hf``, the
version's packages first on ``PYTHONPATH``), into ``OUT/<label>_{base,head}``; then ``OUT/carry_over_<section>.md``
gets one table with both versions' numbers per method and budget and their difference, and is printed. ``gpt``:
nats-eval of each checkpoint (perplexity, KV area and peak); ``hf``: nats-eval-hf (mean accuracy, KV area, peak and
kept share). The overrides after ``--`` go to both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_version(tree: Path, module: str, overrides: list[str], out: Path) -> float:
    """``python -m module overrides`` with ``tree``'s packages first (nats, and kernels/ as nats_kernels), its output
    folder ``out``; returns the seconds it took. A failure stops the script with the run's last lines."""
    links = Path(tempfile.mkdtemp(prefix="carry_over_"))
    (links / "nats_kernels").symlink_to(tree / "kernels")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(links), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PROJECT_ROOT"] = str(ROOT)  # data and logs paths as the current checkout's
    cmd = [sys.executable, "-m", module, *overrides, f"hydra.run.dir={out}", "progress=false"]
    print(f"[{tree.name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"{module} failed in {tree} ({done.returncode}):\n" + "\n".join(tail))
    return seconds


def gpt_rows(folder: Path) -> dict[tuple, dict]:
    rows = json.loads((folder / "results.json").read_text())["results"]
    return {(r["method"], r.get("budget")): r for r in rows}


def hf_rows(folder: Path) -> dict[tuple, dict]:
    rows = json.loads((folder / "summary.json").read_text())["results"]
    return {(r["method"], r.get("budget")): r for r in rows}


def table(title: str, keys: list[str], base: dict, head: dict, seconds: tuple[float, float]) -> str:
    """One markdown table: both versions' `keys` per (method, budget) and their largest absolute difference."""
    lines = [f"### {title}", "", f"base {seconds[0]:.0f} s, head {seconds[1]:.0f} s", ""]
    cols = [f"{k} base | {k} head" for k in keys]
    lines.append("| method | budget | " + " | ".join(cols) + " | max abs diff |")
    lines.append("|---|---|" + "---:|---:|" * len(keys) + "---:|")
    for key in sorted(set(base) | set(head), key=str):
        b, h = base.get(key, {}), head.get(key, {})
        cells, diff = [], 0.0
        for k in keys:
            vb, vh = b.get(k), h.get(k)
            cells += [_fmt(vb), _fmt(vh)]
            if isinstance(vb, (int, float)) and isinstance(vh, (int, float)):
                diff = max(diff, abs(vb - vh))
            elif vb != vh:
                diff = float("nan")
        lines.append(f"| {key[0]} | {_fmt(key[1])} | " + " | ".join(cells) + f" | {diff:.2g} |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a checkout of the earlier code (nats/, kernels/, conf/)")
    p.add_argument("--head", type=Path, default=ROOT, help="the later code (default: this checkout)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("section", choices=("gpt", "hf"))
    p.add_argument("ckpts", nargs="*", type=Path, help="gpt: nats-train checkpoints")
    args = p.parse_args(argv)
    base, head, out = args.base.resolve(), args.head.resolve(), args.out.resolve()
    for flag, tree in (("--base", base), ("--head", head)):
        for part in ("nats", "kernels", "conf"):
            if not (tree / part).is_dir():
                raise SystemExit(f"{flag} {tree} has no {part}/: pass a checkout of the code")
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# The same evaluation through two versions of the code ({args.section})", ""]
    runs = [(c.parent.parent.name or "ckpt", ["ckpt_path=" + str(c.resolve())]) for c in args.ckpts]
    if args.section == "hf":
        runs = [("hf", [])]
    elif not runs:
        raise SystemExit("gpt: pass one or more checkpoints")
    module = "nats.eval" if args.section == "gpt" else "nats.eval_hf"
    rows_of = gpt_rows if args.section == "gpt" else hf_rows
    keys = ["ppl", "area", "peak"] if args.section == "gpt" else ["mean_accuracy", "area", "peak", "kv_fraction"]
    for label, own in runs:
        seconds = []
        for name, tree in (("base", base), ("head", head)):
            seconds.append(run_version(tree, module, own + extra, out / f"{label}_{name}"))
        report.append(table(label, keys, rows_of(out / f"{label}_base"), rows_of(out / f"{label}_head"),
                            tuple(seconds)))  # fmt: skip
    text = "\n".join(report)
    (out / f"carry_over_{args.section}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
