"""Gradient clipping and gradient-norm logging with the type scorers apart (docs/scorer_gradients.md).

`optim.clip_mode=separate` clips the attention's type scorers and the backbone as two groups, so that a huge
scorer gradient cannot scale the backbone's update down; `global` is one norm over everything (the behaviour
before). The tests compose the real configs and train through Lightning, as nats-train does.
"""

from __future__ import annotations

import csv
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch

from conftest import compose
from nats.clipping import scorer_parameters
from nats.train import build

INFLATE = 1e6  # what the scorer's gradient is multiplied by: the 2e3 -> 1e6 growth seen on GPT-2-small


def small(overrides: list[str]) -> list[str]:
    """Tiny model on the Gutenberg data, 2 micro-batches of 2 per optimizer step (so accumulation is on)."""
    return [
        "model.block_size=32",
        "data.micro_batch_size=2",
        "global_batch_size=4",
        "data.max_eval_windows=2",
        "callbacks=none",
        "final_validation=false",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]


def backbone_and_scorer(module) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    ids = {id(p) for p in scorer_parameters(module.model)}
    named = dict(module.model.named_parameters())
    return ({n: p for n, p in named.items() if id(p) not in ids}, {n: p for n, p in named.items() if id(p) in ids})


class Capture(L.Callback):
    """The parameters before training and the gradients the optimizer stepped with (after clipping)."""

    def on_train_start(self, trainer, pl_module):
        self.before = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
        self.grads: list[dict[str, torch.Tensor]] = []
        named = list(pl_module.model.named_parameters())

        def post_step(optimizer, args, kwargs):
            self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

        trainer.optimizers[0].register_step_post_hook(post_step)


def fit(tmp_path: Path, overrides: list[str], inflate: float | None = None):
    """Train `overrides` with the scorer gradient multiplied by `inflate` (a hook on the scorer weights, so the
    factor applies before clipping); returns (module, capture)."""
    cfg = compose(small(overrides), tmp_path)
    datamodule, module, trainer = build(cfg)
    capture = Capture()
    trainer.callbacks.append(capture)
    if inflate is not None:
        scorers = scorer_parameters(module.model)
        assert scorers, "the NAtS model has no scorer parameters"
        for p in scorers:
            p.register_hook(lambda g: g * inflate)
    trainer.fit(module, datamodule=datamodule)
    return module, capture


def norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors])))


# ----------------------------------------------------------------------------------------------------
# which parameters are the scorers'
# ----------------------------------------------------------------------------------------------------
def test_scorer_parameters(tmp_path):
    nats = hydra.utils.instantiate(compose(["model/attention=nats"], tmp_path).module, _convert_="all")
    backbone, scorer = backbone_and_scorer(nats)
    assert sorted(scorer) == [f"blocks.{i}.attn.core.scorer.weight" for i in range(nats.config.n_layer)]
    assert all(".scorer." not in n for n in backbone)
    dense = hydra.utils.instantiate(compose([], tmp_path).module, _convert_="all")
    assert scorer_parameters(dense.model) == []


def test_default_and_bad_options(tmp_path):
    cfg = compose([], tmp_path)
    assert (cfg.optim.clip_mode, cfg.optim.grad_clip, cfg.optim.scorer_grad_clip) == ("separate", 1.0, None)
    assert compose(["experiment=pg19_gpt2_nats"], tmp_path).optim.clip_mode == "separate"
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        build(compose(["optim.clip_mode=bogus"], tmp_path))
    with pytest.raises(ValueError, match="scorer_grad_clip applies only with optim.clip_mode=separate"):
        build(compose(["optim.clip_mode=global", "optim.scorer_grad_clip=0.5"], tmp_path))


# ----------------------------------------------------------------------------------------------------
# the clipping itself, on a bare module (no trainer: nothing logged)
# ----------------------------------------------------------------------------------------------------
def grads_after_clip(tmp_path, overrides, inflate=1.0):
    torch.manual_seed(0)
    module = hydra.utils.instantiate(compose(["model.block_size=32", *overrides], tmp_path).module, _convert_="all")
    x = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the Gumbel noise
    out = module.model(x, x)
    (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
    for p in scorer_parameters(module.model):
        p.grad.mul_(inflate)
    raw = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    module.on_before_optimizer_step(None)
    return module, raw, {n: p.grad for n, p in module.model.named_parameters()}


def test_global_is_clip_grad_norm_bit_for_bit(tmp_path):
    """clip_mode=global is what the code did before: torch.nn.utils.clip_grad_norm_ over all parameters."""
    module, raw, clipped = grads_after_clip(tmp_path, ["model/attention=nats", "optim.clip_mode=global"])
    for n, p in module.model.named_parameters():
        p.grad = raw[n].clone()
    total = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    assert total > 1.0  # clipping is active in this case
    for n, p in module.model.named_parameters():
        assert torch.equal(p.grad, clipped[n]), n


def test_separate_clips_each_group_to_its_bound(tmp_path):
    module, raw, clipped = grads_after_clip(
        tmp_path, ["model/attention=nats", "optim.clip_mode=separate", "optim.scorer_grad_clip=0.01"], inflate=1e3
    )
    backbone, scorer = backbone_and_scorer(module)
    assert norm(raw[n] for n in scorer) > 0.01 and norm(raw[n] for n in backbone) > 1.0  # both groups clipped
    assert norm(clipped[n] for n in scorer) == pytest.approx(0.01, rel=1e-4)
    assert norm(clipped[n] for n in backbone) == pytest.approx(1.0, rel=1e-4)
    # the backbone's clipped gradient is clip_grad_norm_ of the backbone alone
    for n, p in module.model.named_parameters():
        p.grad = raw[n].clone()
    torch.nn.utils.clip_grad_norm_(list(backbone.values()), 1.0)
    for n in backbone:
        assert torch.equal(backbone[n].grad, clipped[n]), n


# ----------------------------------------------------------------------------------------------------
# (a) an inflated scorer gradient: separate leaves the backbone's update alone, global starves it
# ----------------------------------------------------------------------------------------------------
def test_inflated_scorer_gradient_cannot_starve_the_backbone(tmp_path):
    steps = ["model/attention=nats", "trainer.max_steps=1", "logger=none"]
    runs = {
        (mode, inflate): fit(tmp_path / f"{mode}-{inflate}", steps + [f"optim.clip_mode={mode}"], inflate)
        for mode in ("separate", "global")
        for inflate in (None, INFLATE)
    }
    module = runs["separate", None][0]
    backbone, scorer = backbone_and_scorer(module)

    def grad(run, names):
        return [run[1].grads[0][n] for n in names]

    def update(run, names):
        params = dict(run[0].model.named_parameters())
        return [params[n].detach() - run[1].before[n] for n in names]

    # the inflation reached the scorer's gradient and dominates the global norm (before clipping)
    base_sep, infl_sep = runs["separate", None], runs["separate", INFLATE]
    base_glob, infl_glob = runs["global", None], runs["global", INFLATE]
    assert norm(grad(infl_sep, scorer)) == pytest.approx(1.0, rel=1e-4)  # clipped to grad_clip on its own

    # separate: the backbone's gradient and update are exactly those of the run without the inflation
    for a, b in zip(grad(base_sep, backbone), grad(infl_sep, backbone)):
        assert torch.equal(a, b)
    for a, b in zip(update(base_sep, backbone), update(infl_sep, backbone)):
        assert torch.equal(a, b)
    assert norm(update(base_sep, backbone)) > 0

    # global: the same inflation scales the backbone's gradient down by orders of magnitude, and its update with it
    g_base, g_infl = norm(grad(base_glob, backbone)), norm(grad(infl_glob, backbone))
    assert g_infl < 1e-3 * g_base, (g_base, g_infl)
    u_base, u_infl = norm(update(base_glob, backbone)), norm(update(infl_glob, backbone))
    assert u_infl < 0.5 * u_base, (u_base, u_infl)


# ----------------------------------------------------------------------------------------------------
# (b) the logged metrics
# ----------------------------------------------------------------------------------------------------
def logged_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("attention", ["nats", "dense"])
def test_gradient_norms_logged_on_log_steps(attention, tmp_path, monkeypatch):
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or foreach_norm(*a, **k))
    fit(
        tmp_path,
        [
            f"model/attention={attention}",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=2",
            "logger=csv",
            "optim.grad_clip=0.5",
        ],
    )
    rows = logged_rows(tmp_path)
    loss_steps = sorted(int(r["step"]) for r in rows if r.get("train/loss"))
    norm_rows = [r for r in rows if r.get("train/grad_norm")]
    assert loss_steps == [1, 3] and sorted(int(r["step"]) for r in norm_rows) == loss_steps
    assert len(calls) == 4  # clipping: one norm launch per optimizer step, also on steps that do not log
    for r in norm_rows:
        total, backbone = float(r["train/grad_norm"]), float(r["train/grad_norm_backbone"])
        coef = float(r["train/grad_clip_coef_backbone"])
        if attention == "nats":
            scorer = float(r["train/grad_norm_scorer"])
            assert 0 < scorer < total and total**2 == pytest.approx(scorer**2 + backbone**2, rel=1e-5)
            assert coef == pytest.approx(min(1.0, 0.5 / (backbone + 1e-6)), rel=1e-5)
            assert float(r["train/grad_clip_coef_scorer"]) == pytest.approx(min(1.0, 0.5 / (scorer + 1e-6)), rel=1e-5)
        else:
            assert not r.get("train/grad_norm_scorer") and not r.get("train/grad_clip_coef_scorer")
            assert backbone == total and coef == pytest.approx(min(1.0, 0.5 / (total + 1e-6)), rel=1e-5)


def test_norms_without_clipping_only_on_log_steps(tmp_path, monkeypatch):
    """grad_clip=null: the norms cost nothing on the steps that are not logged."""
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or foreach_norm(*a, **k))
    fit(
        tmp_path,
        [
            "model/attention=nats",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=2",
            "logger=csv",
            "optim.grad_clip=null",
        ],
    )
    rows = [r for r in logged_rows(tmp_path) if r.get("train/grad_norm_scorer")]
    assert sorted(int(r["step"]) for r in rows) == [1, 3] and len(calls) == 2
    assert not any(r.get("train/grad_clip_coef_backbone") for r in logged_rows(tmp_path))


# ----------------------------------------------------------------------------------------------------
# (c) without scorers the two modes are the same, bit for bit
# ----------------------------------------------------------------------------------------------------
def test_dense_model_separate_equals_global(tmp_path):
    steps = ["trainer.max_steps=3", "logger=none", "optim.grad_clip=0.5"]
    a, cap_a = fit(tmp_path / "separate", steps + ["optim.clip_mode=separate"])
    b, cap_b = fit(tmp_path / "global", steps + ["optim.clip_mode=global"])
    assert scorer_parameters(a.model) == []
    for ga, gb in zip(cap_a.grads, cap_b.grads):
        assert all(torch.equal(ga[n], gb[n]) for n in ga)
    # the clipping was active (otherwise the modes could not differ anyway)
    assert any(norm(g.values()) == pytest.approx(0.5, rel=1e-4) for g in cap_a.grads)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
