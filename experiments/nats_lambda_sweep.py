"""CPU-sized sweep of the NAtS sparsity weight lambda on the embedded Gutenberg corpus.

    python experiments/nats_lambda_sweep.py                       # lambda = 0, 0.1, 0.3, 1 (+ dense), 300 steps
    python experiments/nats_lambda_sweep.py --lambdas 0 0.3 --steps 100 --extra model.attention.window=8

Each run is the default `nats-train` configuration (tiny GPT, context 128, Gutenberg) with
`model/attention=nats`, the same seed and steps; the table reports the final validation perplexity and the
validation KV statistics of the learned (hard, noise-free) types: density (= area fraction), peak fraction and
the fractions of global / local / sliding tokens, averaged over layers, heads and windows.
Writes <out>/nats_lambda_sweep_table.md, nats_lambda_sweep.csv and nats_lambda_sweep.png.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.1, 0.3, 1.0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense baseline run")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    ap.add_argument("--out", default=str(REPO / "docs" / "results"))
    ap.add_argument("--runs", default=str(REPO / "logs" / "nats_lambda_sweep"))
    ap.add_argument("--data-dir", default=str(REPO / "data"), help="the token cache (shared with nats-train)")
    args = ap.parse_args()

    from nats.train import compose_config, run

    def compose(overrides: list[str], run_dir: Path):
        """conf/train.yaml with the run's outputs in run_dir and the shared token cache."""
        return compose_config(
            [
                f"paths.output_dir={run_dir}",
                f"paths.log_dir={run_dir}/logs",
                f"paths.data_dir={args.data_dir}",
                *overrides,
            ]
        )

    common = [f"trainer.max_steps={args.steps}", "callbacks.progress_bar=null", "ckpt_path=null", *args.extra]
    settings = [] if args.no_dense else [("dense", None, ["model/attention=dense"])]
    settings += [
        ("nats", lam, ["model/attention=nats", f"model.attention.sparsity_lambda={lam}"]) for lam in args.lambdas
    ]
    rows = []
    for name, lam, overrides in settings:
        t0 = time.time()
        run_dir = Path(args.runs) / (name if lam is None else f"nats_lambda{lam:g}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of an earlier sweep's
        m = run(compose(common + overrides, run_dir))
        row = {
            "attention": name,
            "lambda": "" if lam is None else lam,
            "val_ppl": m["val/ppl"],
            "val_loss": m["val/loss"],
            "density": m.get("val/density", 1.0),
            "peak": m.get("val/peak", 1.0),
            "global": m.get("val/frac_global", 1.0),
            "local": m.get("val/frac_local", 0.0),
            "sliding": m.get("val/frac_sliding", 0.0),
            "minutes": (time.time() - t0) / 60,
        }
        rows.append(row)
        print(row, flush=True)
        write(rows, args)  # after every run, so that an interrupted sweep keeps what it measured


def write(rows: list[dict], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "nats_lambda_sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"Tiny GPT (4 layers, d=128, context 128) on Gutenberg, {args.steps} steps, window W=16 unless "
        f"overridden ({' '.join(args.extra) or 'no extra overrides'}); validation on 256 windows.",
        "",
        "| attention | lambda | val ppl | density (area) | peak | global | local | sliding | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['lambda']} | {r['val_ppl']:.1f} | {r['density']:.3f} | "
            f"{r['peak']:.3f} | {r['global']:.3f} | {r['local']:.3f} | {r['sliding']:.3f} | "
            f"{r['minutes']:.1f} |"
        )
    table = "\n".join(lines)
    (out / "nats_lambda_sweep_table.md").write_text(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    nats_rows = [r for r in rows if r["attention"] == "nats"]
    ax.plot([r["density"] for r in nats_rows], [r["val_ppl"] for r in nats_rows], "o-", label="NAtS")
    for r in nats_rows:
        ax.annotate(f"λ={r['lambda']:g}", (r["density"], r["val_ppl"]))
    for r in rows:
        if r["attention"] == "dense":
            ax.plot([1.0], [r["val_ppl"]], "s", label="dense")
    ax.set_xlabel("KV density (area fraction)")
    ax.set_ylabel("validation perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "nats_lambda_sweep.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
