"""Export a NAtS fine-tuning run's scorers as an adapter folder (the format: `nats.hf.adapter`).

python -m nats.hf.adapter_export logs/finetune_smollm2_nats/runs/<run> adapters/smollm2-nats [--evaluation DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nats.hf.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD, FORMAT, model_revision, model_shape

__all__ = ["export_nats_adapter"]


def export_nats_adapter(run: str | Path, out: str | Path, evaluation: str | Path | None = None) -> Path:
    """Write the adapter folder `out` (module docstring) from a NAtS fine-tuning run folder `run` (its
    ``scorers.pt``, ``.hydra/config.yaml`` and ``nats_stats.json``); ``evaluation``: an ``nats-eval-hf`` run folder
    of these scorers (its ``summary.json``) for the card's scores. Returns `out`."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from nats.hf.pretrained import read_scorers, resolve_pretrained, run_window
    from nats.utils import atomic_path, atomic_write

    run, out = Path(run), Path(out)
    state, window = read_scorers(run / "scorers.pt")
    window = window or run_window(run / "scorers.pt")
    cfg_path = run / ".hydra" / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run} is not a fine-tuning run folder: no .hydra/config.yaml (nats-train writes it)")
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False)
    hf = cfg.get("hf_model") or {}
    where, gguf = resolve_pretrained(hf.get("name_or_path"), hf.get("gguf_file"))
    config = AutoConfig.from_pretrained(where, local_files_only=True, **({"gguf_file": gguf} if gguf else {}))
    module = cfg.get("module") or {}
    stats_path = run / "nats_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    data = cfg.get("data") or {}
    meta = {
        **FORMAT,
        "base_model": {
            "name_or_path": hf.get("name_or_path"),
            "gguf_file": hf.get("gguf_file"),
            "revision": model_revision(config),
        },  # fmt: skip
        "shape": model_shape(config),
        "window": int(window),
        "sparsity_lambda": module.get("sparsity_lambda"),
        "trained": {
            "steps": int(stats.get("step", 0)) or (cfg.get("trainer") or {}).get("max_steps"),
            "tasks": data.get("tasks"),
            "examples": data.get("num_examples"),
            "max_length": data.get("max_length"),
        },  # fmt: skip
        "kv": {k: stats.get("mean", {}).get(k) for k in ("density", "peak")},
    }
    scores = None
    if evaluation is not None:
        summary = json.loads((Path(evaluation) / "summary.json").read_text())
        scores = [r for r in summary.get("rows", summary) if isinstance(r, dict) and r.get("method") == "nats"]
        meta["evaluation"] = scores
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with atomic_path(out / ADAPTER_WEIGHTS) as tmp:
        save_file(weights, str(tmp))
    atomic_write(out / ADAPTER_CONFIG, json.dumps(meta, indent=2) + "\n")
    atomic_write(out / CARD, _card(meta))
    return out


def _card(meta: dict[str, Any]) -> str:
    base, kv, trained = meta["base_model"], meta["kv"], meta["trained"]
    share = "not recorded" if kv.get("density") is None else f"{kv['density']:.3f} (area), peak {kv['peak']:.3f}"
    lines = [
        "---",
        "library_name: nats",
        "tags: [nats, kv-cache, sparse-attention, adapter]",
        f"base_model: {base['name_or_path']}",
        "---",
        "",
        f"# NAtS scorers for {base['name_or_path']}",
        "",
        f"Neural Attention Search type scorers (window W = {meta['window']}, lambda = {meta['sparsity_lambda']}) for "
        f"`{base['name_or_path']}` (config revision {base['revision']}). They decide per token and KV head whether its "
        "key and value stay global, local or sliding; the base model's weights are not changed.",
        "",
        f"- **Trained**: {trained['steps']} steps of distillation on {trained['examples']} examples of "
        f"{', '.join(trained['tasks'] or [])} (up to {trained['max_length']} tokens).",
        f"- **KV kept** at its last validation: {share}.",
    ]
    for row in meta.get("evaluation") or []:
        lines.append(
            f"- **Evaluation** ({row.get('label', 'nats')}): score {row.get('mean')}, KV area {row.get('area')}."
        )
    usage = 'model = load_nats_adapter(base_model, "<this folder>")  # then nats.hf.StaticPolicyCache(model, "nats")'
    lines += ["", "```python", "from nats.hf.adapter import load_nats_adapter", "", usage, "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Export a NAtS fine-tuning run's scorers as an adapter folder.")
    ap.add_argument("run", help="the fine-tuning run folder (scorers.pt, .hydra/config.yaml, nats_stats.json)")
    ap.add_argument("out", help="the adapter folder to write")
    ap.add_argument("--evaluation", help="an nats-eval-hf run folder of these scorers, for the card's scores")
    args = ap.parse_args(argv)
    print(export_nats_adapter(args.run, args.out, args.evaluation))


if __name__ == "__main__":
    main()
