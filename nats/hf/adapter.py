"""NAtS scorers you can share: an adapter folder, as PEFT adapters are shared (nothing is uploaded: the folder is what
a user would push to a model hub).

    python -m nats.hf.adapter_export logs/finetune_smollm2_nats/runs/<run> adapters/smollm2-nats   # export a run
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

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "check_fits", "load_nats_adapter", "read_adapter"]

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
    values = config.to_dict()
    skip = ("_", "transformers_version", "torch_dtype", "dtype")
    text = json.dumps({k: v for k, v in values.items() if not k.startswith(skip)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
