"""The optimizer as a partial config (conf/optim/*.yaml's `optimizer` node, lightning-hydra-template style): LitGPT
builds the AdamW the hand-built code did, names the place of the retired flat optimizer keys of older configs, and
rejects keys it does not know, naming the valid ones."""

from __future__ import annotations

import hydra
import pytest
import torch

from conftest import compose
from nats.lit import LitGPT
from nats.optim import OPTIM_KEYS
from nats.train import build

MODEL = {"vocab_size": 61, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "bias": True}


def adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The groups' hyperparameters; lr before the schedule (LambdaLR keeps it as initial_lr)."""
    keys = ("betas", "eps", "weight_decay", "fused")
    return [
        {k: g[k] for k in keys} | {"n": len(g["params"]), "lr": g.get("initial_lr", g["lr"])}
        for g in optimizer.param_groups
    ]


def test_composed_config_builds_the_adamw_of_before(tmp_path):
    cfg = compose([], tmp_path)
    node = cfg.optim.optimizer
    assert (node._target_, node._partial_, node.lr) == ("torch.optim.AdamW", True, cfg.optim.lr)
    module = hydra.utils.instantiate(
        compose(["model=tiny", "model.block_size=16", "optim.max_steps=10"], tmp_path).module, _convert_="all"
    )
    assert isinstance(module.hparams["optim"]["optimizer"], dict)  # plain data in checkpoints, not a partial
    opt = module.configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.AdamW
    # what the hand-built AdamW had: decay on >= 2-D weights, none on the rest, fused only on CUDA
    decay = [p for p in module.model.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.model.parameters() if p.dim() < 2]
    ref = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=None,
    )
    assert adamw_groups(opt) == adamw_groups(ref)


def test_optim_without_optimizer_node_is_the_default_adamw():
    """optim={"lr": ...} (tests/test_eval.py's checkpoints): nats.optim.DEFAULT_OPTIMIZER, conf/optim's AdamW."""
    old = LitGPT(model=MODEL, optim={"lr": 1e-3, "max_steps": 5})
    opt = old.configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.AdamW
    assert [(g["initial_lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [
        (1e-3, (0.9, 0.95), 1e-8, 0.1),
        (1e-3, (0.9, 0.95), 1e-8, 0.0),
    ]


@pytest.mark.parametrize("optimizer", [None, {"_target_": "torch.optim.AdamW", "_partial_": True}])
def test_retired_flat_optimizer_keys_are_one_error(optimizer):
    """The optimizer arguments beside lr (the format before the optimizer node) are an error naming their place."""
    flat = {"lr": 0.01, "max_steps": 5, "weight_decay": 0.0, "betas": [0.9, 0.999]}
    if optimizer is not None:
        flat["optimizer"] = optimizer
    with pytest.raises(ValueError) as err:
        LitGPT(model=MODEL, optim=flat)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("optim.weight_decay, optim.betas: retired keys of an older config format")
    assert "they are now optim.optimizer.weight_decay, optim.optimizer.betas" in message


def test_another_optimizer_class():
    optim = {
        "lr": 0.1,
        "max_steps": 5,
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9, "weight_decay": 0.01},
    }
    opt = LitGPT(model=MODEL, optim=optim).configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.SGD and [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert opt.param_groups[0]["initial_lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(
    "optim,match",
    [
        ({"lr": 1e-3, "lrr": 4}, r"unknown optim keys: lrr \(did you mean lr\?\)"),
        (
            {"lr": 1e-3, "optimizer": {"_target_": "torch.optim.AdamW"}, "weight_decay": 0.1},
            "optim.optimizer.weight_decay",
        ),
        ({"lr": 1e-3, "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-2}}, "differs from optim.lr"),
        ({"lr": 1e-3, "optimizer": {"_target_": "torch.optim.AdamW", "betaz": [0.9, 0.9]}}, "betaz"),
        ({"lr": 1e-3, "optimizer": {"_target_": "torch.optim.NoSuchOptimizer"}}, "cannot be built"),
        ({"min_lr": 1e-3}, "optim.lr"),
    ],
)
def test_bad_optim_is_an_error(optim, match):
    with pytest.raises(ValueError, match=match):
        LitGPT(model=MODEL, optim=optim)


def test_unknown_optim_key_from_the_command_line(tmp_path):
    """A mistyped `+optim.lrr=4` was silently accepted; now it names the valid keys."""
    with pytest.raises(ValueError, match="unknown optim keys: lrr") as err:
        build(compose(["model=tiny", "+optim.lrr=4"], tmp_path))
    assert all(k in str(err.value) for k in OPTIM_KEYS)
    with pytest.raises(ValueError, match="betaz"):
        build(compose(["model=tiny", "+optim.optimizer.betaz=[0.9,0.9]"], tmp_path))
