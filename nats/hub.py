"""Trained models as folders: `save_pretrained` / `from_pretrained` (huggingface_hub's PyTorchModelHubMixin), and
the export of a nats-train checkpoint to that folder.

A saved model is a folder (or a Hugging Face hub repository) with

* ``config.json``: the `nats.models.gpt.GPTConfig` fields (the attention config with them: a NAtS model keeps its
  window, its type options and so on) plus ``"model_type": "nats-gpt"``;
* ``model.safetensors`` (when the ``safetensors`` package is installed, else ``pytorch_model.bin``, a
  ``torch.save`` of the state dict): every weight, the NAtS type scorers included; with tied embeddings the
  head's weight is the embedding's and is stored once (as ``wte.weight``);
* ``README.md``: a model card (huggingface_hub's).

    from nats.hub import PretrainedGPT, export_checkpoint
    export_checkpoint("logs/train/runs/<run>/checkpoints/last.ckpt", "models/my-nats")
    model = PretrainedGPT.from_pretrained("models/my-nats")     # a folder, or a hub id "user/name"
    model.save_pretrained("models/copy")                        # push_to_hub("user/name") uploads it
    save_pretrained(lit_module.model, "models/other")           # any nats GPT, e.g. LitGPT's

`PretrainedGPT` is `nats.models.gpt.GPT` with the mixin: the same modules, forward and state dict, so everything
that takes a GPT (nats.cache.decode, nats-generate) takes it. `load_model(path)` reads either format: a
nats-train ``.ckpt`` file or a saved folder. ``python -m nats.hub CKPT OUT_DIR`` exports from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download

from nats.models.gpt import GPT, GPTConfig
from nats.runs import read_model_checkpoint

__all__ = [
    "PretrainedGPT",
    "save_pretrained",
    "from_pretrained",
    "export_checkpoint",
    "load_checkpoint",
    "load_model",
    "config_from_dict",
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "TORCH_NAME",
    "MODEL_TYPE",
]

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
TORCH_NAME = "pytorch_model.bin"
MODEL_TYPE = "nats-gpt"
# config.json keys that are not GPTConfig fields
_META_KEYS = ("model_type",)
_CKPT_HINT = "pass the .ckpt of a nats-train run, e.g. logs/train/runs/<date>/checkpoints/last.ckpt"


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def config_from_dict(cfg: Mapping[str, Any], where: str = "config") -> GPTConfig:
    """A GPTConfig from a saved dict (config.json or a checkpoint's hyper_parameters['model']): the metadata keys
    dropped; anything unknown or retired (`GPTConfig.from_dict`) is an error naming `where`."""
    values = {k: v for k, v in dict(cfg).items() if k not in _META_KEYS}
    try:
        return GPTConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: not a nats GPT config ({err})") from err


# ----------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------
def _weights(model: GPT) -> dict[str, torch.Tensor]:
    """The state dict to store: contiguous tensors, the tied head's weight left out (it is wte.weight)."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def _write_weights(model: GPT, folder: Path, use_safetensors: bool | None = None) -> Path:
    use_safetensors = _has_safetensors() if use_safetensors is None else use_safetensors
    weights = _weights(model)
    stale = TORCH_NAME if use_safetensors else SAFETENSORS_NAME  # never leave the other format's old weights
    (folder / stale).unlink(missing_ok=True)
    if use_safetensors:
        from safetensors.torch import save_file

        path = folder / SAFETENSORS_NAME
        save_file({k: v.cpu() for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    else:
        path = folder / TORCH_NAME
        torch.save({k: v.cpu() for k, v in weights.items()}, path)
    return path


def _write_config(config: GPTConfig, folder: Path) -> Path:
    path = folder / CONFIG_NAME
    path.write_text(json.dumps({"model_type": MODEL_TYPE, **config.to_dict()}, indent=2, sort_keys=True) + "\n")
    return path


def save_pretrained(
    model: GPT, save_directory: str | os.PathLike, *, use_safetensors: bool | None = None, **kwargs: Any
) -> Path:
    """Save any nats GPT (a `PretrainedGPT`, or e.g. a LitGPT's `.model`) to `save_directory` (created);
    returns the folder. `use_safetensors`: None = when the package is installed. Other keyword arguments go to
    the mixin's save_pretrained (push_to_hub=True, repo_id=..., model_card_kwargs=...)."""
    if not isinstance(model, GPT):
        raise TypeError(f"save_pretrained saves a nats.models.gpt.GPT, got {type(model).__name__}")
    folder = Path(save_directory)
    if not isinstance(model, PretrainedGPT):
        model = PretrainedGPT.wrap(model)
    model.save_pretrained(folder, use_safetensors=use_safetensors, **kwargs)
    return folder


# ----------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------
def _read_weights(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    try:
        if path.name == SAFETENSORS_NAME:
            if not _has_safetensors():
                raise ImportError(f"{path} is a safetensors file: pip install safetensors to read it")
            from safetensors.torch import load_file

            return load_file(str(path), device=str(map_location))
        return torch.load(path, map_location=map_location, weights_only=True)
    except ImportError:
        raise
    except Exception as err:  # a truncated or foreign file
        raise ValueError(f"{path} is not a readable weights file ({type(err).__name__}: {err})") from err


def _load_weights(model: GPT, weights: Mapping[str, torch.Tensor], where: str) -> GPT:
    """Load strictly: only the tied head's weight may be absent (it is the embedding's)."""
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_embeddings]
    if missing or unexpected:
        raise ValueError(
            f"{where}: the weights do not match the model config (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}): the files are damaged or were written for another model"
        )
    return model


def _looks_like_hub_id(name: str) -> bool:
    return (
        bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name))
        and not name.startswith(".")
        and not name.endswith(".ckpt")
    )


def _resolve_file(model_id: str, filename: str, hub: dict[str, Any]) -> Path | None:
    """The path of `filename` in the folder `model_id`, or downloaded from the hub repository `model_id`; None
    when that repository has no such file."""
    if os.path.isdir(model_id):
        path = Path(model_id) / filename
        return path if path.is_file() else None
    from huggingface_hub.utils import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id=model_id, filename=filename, **hub))
    except EntryNotFoundError:
        return None


MODEL_CARD = """
---
{{ card_data }}
---

A GPT of the `nats` framework (learnable sparse attention and KV-cache policies), saved with
`nats.hub.save_pretrained` (huggingface_hub's PyTorchModelHubMixin). `config.json` holds the model config, the
attention config with it; the weights are in `model.safetensors` (or `pytorch_model.bin`).

```python
from nats.hub import PretrainedGPT
model = PretrainedGPT.from_pretrained("<this folder or hub id>")
```

Decode text with any KV-cache policy: `nats-generate model_dir=<this folder or hub id> prompt="..." policy=h2o
budget=64`.
{% if trained %}
## What it keeps

{{ trained }}
{% endif %}{% if evaluation %}
## Evaluation

| split | method | perplexity | KV area | KV peak |
|---|---|---:|---:|---:|
{% for r in evaluation %}| {{ r.split }} | {{ r.label }} | {{ r.ppl }} | {{ r.area }} | {{ r.peak }} |
{% endfor %}
{{ evaluation_source }}
{% endif %}"""


class PretrainedGPT(
    GPT, PyTorchModelHubMixin, library_name="nats", tags=["nats", "gpt", "kv-cache"], model_card_template=MODEL_CARD
):
    """`nats.models.gpt.GPT` with `save_pretrained(dir)`, `from_pretrained(dir_or_hub_id)` and `push_to_hub`.

    `config`: a GPTConfig or its dict (as read from config.json)."""

    def __init__(self, config: GPTConfig | Mapping[str, Any]):
        if not isinstance(config, GPTConfig):
            config = config_from_dict(config)
        super().__init__(config)
        self._hub_mixin_config = config  # config.json is written by _save_pretrained itself

    @classmethod
    def wrap(cls, model: GPT) -> PretrainedGPT:
        """A PretrainedGPT with `model`'s config and weights (copied), on its device and in its dtype."""
        param = next(model.parameters())
        out = cls(model.config).to(device=param.device, dtype=param.dtype)
        _load_weights(out, model.state_dict(), type(model).__name__)
        out.train(model.training)
        return out

    # the mixin calls these two ------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *, use_safetensors: bool | None = None, **kwargs: Any):
        self._use_safetensors = use_safetensors
        try:
            return super().save_pretrained(save_directory, **kwargs)
        finally:
            del self._use_safetensors

    def _save_pretrained(self, save_directory: Path) -> None:
        _write_config(self.config, save_directory)
        _write_weights(self, save_directory, getattr(self, "_use_safetensors", None))

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, map_location: Any = "cpu", **kwargs: Any
    ) -> PretrainedGPT:
        """Load a folder written by `save_pretrained` / `export_checkpoint`, or download a hub repository
        ("user/name"; revision=, cache_dir=, token=, local_files_only= go to huggingface_hub). The model is
        returned in eval mode, on `map_location`, in `dtype` (a torch dtype or its name; None = as saved)."""
        name = str(pretrained_model_name_or_path)
        if os.path.isfile(name):
            hint = (
                (
                    f"; a nats-train checkpoint is read by nats.hub.load_model or exported with "
                    f"nats.hub.export_checkpoint({name!r}, out_dir)"
                )
                if name.endswith(".ckpt")
                else ""
            )
            raise ValueError(f"{name} is a file; from_pretrained takes the folder save_pretrained wrote{hint}")
        if os.path.isdir(name):
            if not (Path(name) / CONFIG_NAME).is_file():
                raise FileNotFoundError(f"{name} has no {CONFIG_NAME}: not a folder written by save_pretrained")
            return super().from_pretrained(name, map_location=map_location, **kwargs)
        if not _looks_like_hub_id(name):
            raise FileNotFoundError(
                f"{name}: no such model folder (save one with save_pretrained or "
                f"nats.hub.export_checkpoint; a hub id looks like user/name)"
            )
        try:
            return super().from_pretrained(name, map_location=map_location, **kwargs)
        except Exception as err:  # not on the hub, offline, no access, or not a nats model
            first = str(err).splitlines()[0] if str(err) else ""
            raise FileNotFoundError(
                f"{name} is no local folder and could not be loaded as a model from the "
                f"Hugging Face hub ({type(err).__name__}: {first})"
            ) from err

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir,
        force_download: bool,
        local_files_only: bool,
        token,
        map_location: Any = "cpu",
        dtype: Any = None,
        config: Any = None,
        **model_kwargs: Any,
    ) -> PretrainedGPT:
        if model_kwargs:
            raise TypeError(f"unexpected arguments {sorted(model_kwargs)} (the model is built from config.json)")
        if not isinstance(config, Mapping):
            raise FileNotFoundError(f"{model_id} has no readable {CONFIG_NAME}: not a model saved by nats")
        if config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(
                f"{model_id}: config.json has model_type={config.get('model_type')!r}, not "
                f"{MODEL_TYPE!r}: not a nats model"
            )
        model = cls(config_from_dict(config, f"{model_id}/{CONFIG_NAME}"))
        hub = dict(
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
        )
        path = _resolve_file(model_id, SAFETENSORS_NAME, hub) or _resolve_file(model_id, TORCH_NAME, hub)
        if path is None:
            raise FileNotFoundError(f"{model_id} has neither {SAFETENSORS_NAME} nor {TORCH_NAME}")
        weights = _read_weights(path, "cpu")
        if dtype is None:  # the dtype the weights were saved in
            dtype = next((w.dtype for w in weights.values() if w.is_floating_point()), torch.float32)
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        _load_weights(model.to(dtype), weights, str(path))
        return model.to(map_location).eval()


def from_pretrained(name_or_path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any) -> PretrainedGPT:
    """`PretrainedGPT.from_pretrained` (a saved folder or a hub id)."""
    return PretrainedGPT.from_pretrained(name_or_path, map_location=map_location, **kwargs)


# ----------------------------------------------------------------------------------------------------
# nats-train checkpoints
# ----------------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike | None, key: str | None = None) -> PretrainedGPT:
    """The model of a nats-train (LitGPT) Lightning checkpoint, any architecture; clear errors otherwise, naming
    the file as the setting ``key`` that gave it when there is one (``ckpt_path``: ``ckpt_path=<file>: ...``).
    The one reader of nats-train checkpoints as models (nats-eval, nats-generate, export_checkpoint); nats-eval
    then refuses the models that the KV caches cannot decode (`nats.evaluation.check_decodable`)."""
    name = f"{key}={path}" if key else str(path)
    hint = _CKPT_HINT.replace("e.g. ", f"e.g. {key}=") if key else _CKPT_HINT
    if path is not None and Path(path).is_dir():
        raise ValueError(f"{name} is a folder, not a checkpoint file: {hint}")
    model_cfg, weights = read_model_checkpoint(path, name, hint)
    model = PretrainedGPT(config_from_dict(model_cfg, name))
    return _load_weights(model, weights, name).eval()


def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, **kwargs: Any) -> Path:
    """Write the model of a nats-train checkpoint to `out_dir` in the save_pretrained format; returns out_dir.
    (The optimizer state, schedule and data position stay in the checkpoint: resume training from that.) The card
    states what the run recorded beside the checkpoint (`card_facts`)."""
    model = load_checkpoint(ckpt_path)
    facts = card_facts(ckpt_path)
    if facts:
        kwargs["model_card_kwargs"] = {**facts, **kwargs.get("model_card_kwargs", {})}
    return save_pretrained(model, out_dir, **kwargs)


def card_facts(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """What the run folder of a nats-train checkpoint (``<run>/checkpoints/*.ckpt``, or a file in ``<run>``) says of
    the model, for its card: ``trained`` (a sentence: steps, tokens, final validation perplexity and, for NAtS,
    the KV kept: area and peak; from ``metrics.json``) and ``evaluation`` (the rows of the run's nats-eval results,
    ``eval_*/results.json``, written by ``callbacks/eval_after``). Empty where the run recorded neither."""
    from nats.runs import read_metrics

    path = Path(ckpt_path)
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    facts: dict[str, Any] = {}
    record = read_metrics(run) or {}
    metrics = record.get("metrics", {})
    if metrics:
        tokens = record.get("tokens_seen")
        parts = [
            f"{record.get('global_step', '?')} steps" + (f" ({tokens:,} tokens)" if isinstance(tokens, int) else "")
        ]
        if "val/ppl" in metrics:
            parts.append(f"validation perplexity {metrics['val/ppl']:.3f}")
        if "val/density" in metrics:
            peak = f", peak {metrics['val/peak']:.4f}" if "val/peak" in metrics else ""
            parts.append(f"KV kept {metrics['val/density']:.4f} of the full cache (area{peak}) at validation")
        facts["trained"] = "Trained " + "; ".join(parts) + " (the run's `metrics.json`)."
    rows, sources = [], []
    for results in sorted(run.glob("eval_*/results.json")):
        report = json.loads(results.read_text())
        split = report.get("split") or results.parent.name.removeprefix("eval_")
        rows += [{"split": split, **r} for r in report.get("results", []) if {"ppl", "area", "peak"} <= r.keys()]
        sources.append(f"{results.parent.name}/results.json")
    if rows:
        facts["evaluation"] = [
            {"split": r["split"], "label": r.get("label", r.get("method", "?")), "ppl": f"{r['ppl']:.3f}",
             "area": f"{r['area']:.4f}", "peak": f"{r['peak']:.4f}"} for r in rows
        ]  # fmt: skip
        facts["evaluation_source"] = f"From the run's nats-eval results ({', '.join(sources)})."
    return facts


def load_model(path: str | os.PathLike, map_location: Any = "cpu") -> PretrainedGPT:
    """A nats-train ``.ckpt`` file (`load_checkpoint`) or a saved folder / hub id (`from_pretrained`)."""
    name = str(path)
    if os.path.isfile(name) or name.endswith(".ckpt"):
        return load_checkpoint(name).to(map_location)
    return from_pretrained(name, map_location=map_location)


def main(argv: list[str] | None = None) -> None:
    """python -m nats.hub CKPT OUT_DIR: export a nats-train checkpoint to a save_pretrained folder."""
    parser = argparse.ArgumentParser(prog="python -m nats.hub", description=main.__doc__)
    parser.add_argument("ckpt", help="a nats-train checkpoint, e.g. logs/train/runs/<run>/checkpoints/last.ckpt")
    parser.add_argument("out_dir", help="the folder to write (config.json, model.safetensors, README.md)")
    parser.add_argument("--torch", action="store_true", help="write pytorch_model.bin even with safetensors")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.out_dir, use_safetensors=False if args.torch else None)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"exported {args.ckpt} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")


if __name__ == "__main__":
    main()
