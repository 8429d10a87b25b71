"""Gated attention (Qiu et al. 2025) at small scale: dense attention without an output gate, with a headwise
gate and with an elementwise gate, trained for the same number of steps with the same seed and data, through
the same configs as `nats-train experiment=gate_study model.attention.output_gate=<gate>`.

Reports validation loss and perplexity (all validation windows), and per layer the first-token attention
share (mean over heads and queries of the attention probability on key 0, the attention-sink measure) and
the mean gate value, from `nats.analysis.dataset_diagnostics` over the first --diag-batches validation batches.

    python experiments/gate_study.py                     # the default tiny model and steps of conf/train.yaml
    python experiments/gate_study.py --steps 100 data.max_eval_windows=64
    python experiments/gate_study.py --seeds 0 1 2 trainer=gpu      # three seeds on a GPU

Writes docs/results/gate_study.{md,json}; logs go to logs/gate_study/.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GATES = ("none", "headwise", "elementwise")


def run_one(gate: str, steps: int | None, run_dir: Path, extra: list[str], diag_batches: int, seed: int = 0) -> dict:
    from nats.analysis import dataset_diagnostics
    from nats.train import compose_config, fit_in

    cfg = compose_config(
        [
            "experiment=gate_study",
            f"model.attention.output_gate={gate}",
            f"seed={seed}",
            f"paths.output_dir={run_dir}",
            "callbacks=none",  # the experiment's attention_sink monitor stays
            "trainer.enable_progress_bar=false",
            "+trainer.enable_model_summary=false",
            *([f"trainer.max_steps={steps}"] if steps else []),
            *extra,
        ]
    )
    datamodule, module, trainer, seconds = fit_in(cfg, run_dir)
    final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    diag = dataset_diagnostics(module.model, datamodule.val_dataloader(), max_batches=diag_batches)
    return {
        "gate": gate,
        "seed": seed,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": int(trainer.global_step),
        "params": module.model.num_params(),
        "train_seconds": seconds,
        "val_loss": float(final["val/loss"]),
        "val_ppl": math.exp(float(final["val/loss"])),
        "val_acc": float(final.get("val/acc", math.nan)),
        **diag,
    }


def write_outputs(results: list[dict], args, out_dir: Path, command: str = "") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gate_study.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=2, default=str)
    )
    n_layer = len(results[0]["first_token_share"])
    seeds = sorted({r.get("seed", 0) for r in results})
    uniform = sum(1 / i for i in range(1, 129)) / 128
    per_run = [
        "| gate | seed | params | train s | val loss | val ppl | "
        + " | ".join(f"sink L{i}" for i in range(n_layer))
        + " | "
        + " | ".join(f"gate L{i}" for i in range(n_layer))
        + " |",
        "|---|---|---|---|---|---|" + "---|" * (2 * n_layer),
    ]
    for r in results:
        sinks = " | ".join(f"{s:.3f}" for s in r["first_token_share"])
        gates = " | ".join("-" if math.isnan(g) else f"{g:.3f}" for g in r["gate_mean"])
        per_run.append(
            f"| {r['gate']} | {r.get('seed', 0)} | {r['params'] / 1e6:.2f}M | {r['train_seconds']:.0f} | "
            f"{r['val_loss']:.4f} | {r['val_ppl']:.2f} | {sinks} | {gates} |"
        )
    by_gate: dict[str, list[dict]] = {}
    for r in results:
        by_gate.setdefault(r["gate"], []).append(r)
    means, ppl_words, sink_means = [], [], []
    for gate, rs in by_gate.items():
        ppl = torch.tensor([r["val_ppl"] for r in rs], dtype=torch.float64)
        sink = torch.tensor([sum(r["first_token_share"]) / n_layer for r in rs], dtype=torch.float64)
        gmean = [sum(r["gate_mean"]) / n_layer for r in rs]

        def std(t):
            return float(t.std()) if len(t) > 1 else 0.0

        spread = len(rs) > 1
        ppl_words.append(f"{gate} {float(ppl.mean()):.2f}" + (f" ± {std(ppl):.2f}" if spread else ""))
        sink_means.append(float(sink.mean()))
        g = "-" if any(math.isnan(x) for x in gmean) else f"{sum(gmean) / len(gmean):.3f}"
        means.append(
            f"| {gate} | {len(rs)} | {float(ppl.mean()):.2f} ± {std(ppl):.2f} | "
            f"{float(sink.mean()):.4f} ± {std(sink):.4f} | {g} |"
        )
    several = any(len(rs) > 1 for rs in by_gate.values())
    lines = [
        "# Gate study: dense attention with and without the output gate",
        "",
        f"Validation perplexity after {results[0]['steps']} optimizer steps"
        + (f" (mean ± standard deviation over seeds {seeds})" if several else "")
        + ": "
        + ", ".join(ppl_words)
        + f". Mean first-token share {min(sink_means):.4f}-{max(sink_means):.4f} (uniform attention: {uniform:.4f}).",
        "",
    ]
    if several:
        lines += ["| gate | seeds | val ppl | mean first-token share | mean gate |", "|---|---|---|---|---|", *means]
    else:
        lines += per_run
    lines += [
        "",
        f"{date.today().isoformat()}, {results[0]['device']}"
        + (f" (torch threads = {torch.get_num_threads()})" if results[0]["device"] == "cpu" else "")
        + f": `{command or 'python experiments/gate_study.py'}`. The tiny model of conf/train.yaml (4 layers, 4 "
        "heads, d = 128, RoPE, context 128) on gutenberg; "
        + (
            "a seed sets the initialisation and the data order, the same for every gate"
            if all("seed" in r for r in results)
            else "the same seed and data order for every row"
        )
        + ". Validation over all validation windows unless data.max_eval_windows caps them; first-token share "
        "(sink): attention probability on key 0, mean over heads and queries, the first query included (uniform "
        f"causal attention: H_N / N = {uniform:.4f} at N = 128); gate: mean gate value; both per layer over "
        f"{args.diag_batches} validation batches.",
    ]
    if several:
        lines += ["", "## Per seed", "", *per_run]
    (out_dir / "gate_study.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: trainer.max_steps of the config)")
    p.add_argument("--gates", nargs="+", default=list(GATES), choices=GATES)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed and gate")
    p.add_argument("--diag-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-dir", type=Path, default=ROOT / "logs" / "gate_study")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args()
    command = shlex.join(["python", "experiments/gate_study.py", *sys.argv[1:]])
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for seed in args.seeds:
        for gate in args.gates:
            run_dir = args.log_dir / f"{gate}_steps{args.steps or 'default'}_seed{seed}"
            results.append(run_one(gate, args.steps, run_dir, args.overrides, args.diag_batches, seed))
            r = results[-1]
            print(
                f"[{gate}, seed {seed}] {r['steps']} steps in {r['train_seconds']:.0f}s: val ppl {r['val_ppl']:.2f}",
                flush=True,
            )
            write_outputs(results, args, args.out, command)


if __name__ == "__main__":
    main()
