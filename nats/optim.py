"""The `optim` node of the LightningModules (conf/optim/*.yaml): its checks, the optimizer it configures (a partial
config, lightning-hydra-template style) and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# The keys of `optim` (conf/optim/*.yaml): the optimizer as a partial config, then the schedule and the clipping.
OPTIM_KEYS = ("optimizer", "lr", "min_lr", "warmup_steps", "max_steps", "grad_clip", "clip_mode", "scorer_grad_clip")
# Top-level keys of the `optim` format before the `optimizer` node: an error naming their place under it.
RETIRED_OPTIM_KEYS = ("weight_decay", "betas", "eps")
# The optimizer of an `optim` without an `optimizer` node: conf/optim/adamw_cosine.yaml's.
DEFAULT_OPTIMIZER = {
    "_target_": "torch.optim.AdamW",
    "_partial_": True,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
}


def check_optim_keys(optim: Mapping[str, Any], valid: tuple[str, ...], listed: tuple[str, ...] | None = None) -> None:
    """Unknown keys of `optim` are an error that names the closest valid key of each and lists ``listed`` (default:
    ``valid``). Shared by every LightningModule's `optim` node (`optimizer_config`, `nats.finetune.lit`)."""
    unknown = sorted(set(optim) - set(valid))
    if unknown:
        hints = [
            f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, valid, n=1)) else k
            for k in unknown
        ]
        raise ValueError(
            f"unknown optim keys: {', '.join(hints)}; the valid keys: {', '.join(listed or valid)} "
            "(the optimizer's own arguments go under optim.optimizer, e.g. optim.optimizer.weight_decay)"
        )


def optimizer_node(node: Any, lr: float) -> dict[str, Any]:
    """`optim.optimizer` checked: a config with a ``_target_`` (a partial, built here once so that a mistyped class
    or argument fails now, not when training starts) whose lr, if given, is ``optim.lr``, the schedule's peak.
    Returns the node as a dict with ``lr`` set."""
    if isinstance(node, functools.partial) or not isinstance(node, Mapping) or "_target_" not in node:
        raise ValueError(
            f"optim.optimizer must be a config with a _target_ (e.g. torch.optim.AdamW) and "
            f"_partial_: true, got {node!r}; instantiate the LightningModule with _recursive_=False (as "
            "conf/train.yaml's module node does), so that it receives the config and its checkpoints "
            "hold plain data"
        )
    node = dict(node)
    if node.setdefault("lr", lr) != lr:
        raise ValueError(
            f"optim.optimizer.lr={node['lr']} differs from optim.lr={lr}, the schedule's peak: "
            "set optim.lr (conf/optim's optimizer.lr follows it)"
        )
    optimizer_partial(node)
    return node


def optimizer_config(optim: Mapping[str, Any]) -> dict[str, Any]:
    """`optim` checked and in the current form: unknown keys are an error (naming the valid ones), the optimizer
    arguments of the format before the `optimizer` node (`RETIRED_OPTIM_KEYS`) an error saying where they go now,
    no `optimizer` node the default AdamW (`DEFAULT_OPTIMIZER`), and the optimizer's lr is the schedule's peak,
    `optim.lr`."""
    optim = dict(optim)
    retired = [k for k in RETIRED_OPTIM_KEYS if k in optim]
    if retired:
        raise ValueError(
            f"optim.{', optim.'.join(retired)}: retired keys of an older config format; they are now "
            f"optim.optimizer.{', optim.optimizer.'.join(retired)} (move them there in the config, or in a "
            "checkpoint's hyper_parameters['optim'])"
        )
    check_optim_keys(optim, OPTIM_KEYS)
    if "lr" not in optim:
        raise ValueError("optim.lr (the peak learning rate of the schedule) is required")
    node = optim.get("optimizer")
    if node is None:
        node = {**DEFAULT_OPTIMIZER, "lr": optim["lr"]}
    optim["optimizer"] = optimizer_node(node, optim["lr"])
    return optim


def optimizer_partial(node: Mapping[str, Any]) -> functools.partial:
    """The optimizer class with its configured arguments (betas as a tuple): call it with the parameters."""
    import hydra

    try:
        make = hydra.utils.instantiate(dict(node), _partial_=True, _convert_="all")
    except Exception as err:  # noqa: BLE001 - an import error, an unknown class: one message
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"optim.optimizer ({node.get('_target_')}) cannot be built: {msg}") from err
    signature = inspect.signature(make.func)
    try:
        signature.bind_partial(**make.keywords)
    except TypeError as err:
        options = ", ".join(n for n in signature.parameters if n != "params")
        raise ValueError(f"optim.optimizer ({node.get('_target_')}): {err}; its arguments: {options}") from None
    if isinstance(make.keywords.get("betas"), list):
        make = functools.partial(make.func, *make.args, **{**make.keywords, "betas": tuple(make.keywords["betas"])})
    return make


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def configure_optimizers(model: nn.Module, optim: Mapping[str, Any], *, cuda: bool, max_steps: int | None) -> dict:
    """The `optim.optimizer` partial called with two parameter groups: the weights of 2+ dims (with the
    optimizer's weight_decay) and the rest (biases, norms, weight_decay 0); `fused=True` when `cuda` and the
    optimizer takes it and the config does not set it. Then the warm-up + cosine schedule (`lr_at`), per step, to
    optim.max_steps or else `max_steps` (the trainer's). `optim`: `optimizer_config`'s. Lightning's
    configure_optimizers answer."""
    o = optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    make = optimizer_partial(o["optimizer"])
    kwargs = {}
    if "fused" not in make.keywords and "fused" in inspect.signature(make.func).parameters:
        kwargs["fused"] = cuda or None
    optimizer = make(groups, **kwargs)
    max_steps = o.get("max_steps") or max_steps
    if max_steps is None or max_steps < 1:
        raise ValueError("set trainer.max_steps (or optim.max_steps) to a positive number for the cosine schedule")
    schedule = dict(
        lr=o["lr"], min_lr=o.get("min_lr", o["lr"] / 10), warmup_steps=o.get("warmup_steps", 0), max_steps=max_steps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, **schedule) / o["lr"])
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
