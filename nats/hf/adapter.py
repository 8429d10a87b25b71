"""NAtS scorers you can share: an adapter folder, as PEFT adapters are shared (nothing is uploaded: the folder is what
a user would push to a model hub).

    python -m nats.hf.adapter logs/finetune_smollm2_nats/runs/<run> adapters/smollm2-nats   # export a fine-tuning run
    model = load_nats_adapter(AutoModelForCausalLM.from_pretrained(base), "adapters/smollm2-nats")  # one call
    nats-eval-hf scorers=adapters/smollm2-nats ...   /   nats-generate hf_model=... scorers=adapters/smollm2-nats

The folder holds:

* ``adapter_config.json``: the method and its version, the base model (its ``name_or_path``, GGUF file and
  ``revision``: a hash of its config, so that another model of the same name is told apart), the shape the scorers
  fit (model type, layers, hidden size, KV heads), the window W and lambda, and what the run trained on;
* ``adapter_model.safetensors``: the scorer weights (`nats.hf.nats_state_dict`'s keys);
* ``README.md``: a card from the run: the base model, the data, the steps, the kept share of its last validation
  (``nats_stats.json``) and, where an evaluation of it is given, its scores.

`load_nats_adapter` refuses, in one line, a folder made for a model of another shape or config.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_nats_adapter", "load_nats_adapter", "read_adapter"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD = "adapter_config.json", "adapter_model.safetensors", "README.md"
FORMAT = {"format": "nats-adapter", "format_version": 1, "method": "nats"}


def model_shape(config: Any) -> dict[str, Any]:
    """The shape a scorer set fits: model type, layers, hidden size, attention and KV heads."""
    return {
        "model_type": config.model_type,
        "num_hidden_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": int(config.num_key_value_heads or config.num_attention_heads),
    }


def model_revision(config: Any) -> str:
    """A short hash of the model's config (its architecture and sizes; not its weights)."""
    keys = sorted(
        k for k in config.to_dict() if not k.startswith(("_", "transformers_version", "torch_dtype", "dtype"))
    )
    text = json.dumps({k: config.to_dict()[k] for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def export_nats_adapter(run: str | Path, out: str | Path, evaluation: str | Path | None = None) -> Path:
    """Write the adapter folder `out` (module docstring) from a NAtS fine-tuning run folder `run` (its
    ``scorers.pt``, ``.hydra/config.yaml`` and ``nats_stats.json``); ``evaluation``: an ``nats-eval-hf`` run folder
    of these scorers (its ``summary.json``) for the card's scores. Returns `out`."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from nats.hf.pretrained import read_scorers, resolve_pretrained, run_window
    from nats.utils import atomic_write

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
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file(weights, str(tmp))
    tmp.replace(out / ADAPTER_WEIGHTS)
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


def read_adapter(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, scorer weights)`` of an adapter folder; one line naming what is missing otherwise."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"{folder} is not a NAtS adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    if meta.get("format") != FORMAT["format"] or meta.get("method") != "nats":
        raise ValueError(f"{folder}/{ADAPTER_CONFIG} is not a NAtS adapter config (format {meta.get('format')!r})")
    return meta, load_file(str(folder / ADAPTER_WEIGHTS))


def check_fits(meta: dict[str, Any], model: nn.Module, where: str) -> None:
    """One line unless the adapter's shape and config revision are the model's."""
    shape, revision = model_shape(model.config), model_revision(model.config)
    if meta["shape"] != shape or meta["base_model"]["revision"] != revision:
        raise ValueError(
            f"{where} was made for {meta['base_model']['name_or_path']} ({meta['shape']}, config revision "
            f"{meta['base_model']['revision']}), not this model ({shape}, revision {revision}): use its base model"
        )


def load_nats_adapter(model: nn.Module, folder: str | Path) -> nn.Module:
    """Attach NAtS to `model` with the adapter's window and load its scorers, in one call (the model must be the
    adapter's base model: `check_fits`)."""
    from nats.hf.scorers import attach_nats, load_nats_state_dict

    meta, weights = read_adapter(folder)
    check_fits(meta, model, str(folder))
    attach_nats(model, window=int(meta["window"]))
    load_nats_state_dict(model, weights)
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Export a NAtS fine-tuning run's scorers as an adapter folder.")
    ap.add_argument("run", help="the fine-tuning run folder (scorers.pt, .hydra/config.yaml, nats_stats.json)")
    ap.add_argument("out", help="the adapter folder to write")
    ap.add_argument("--evaluation", help="an nats-eval-hf run folder of these scorers, for the card's scores")
    args = ap.parse_args(argv)
    print(export_nats_adapter(args.run, args.out, args.evaluation))


if __name__ == "__main__":
    main()
