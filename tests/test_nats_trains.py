"""NAtS trains like the dense model: an end-to-end guard against scorer-gradient starvation.

A NAtS GPT-2-small once passed every gradient unit test and still diverged: with the `exact` type-gradient
estimator the scorers' gradient grew to 1e6, made up nearly all of the global gradient norm, and clipping that
norm at 1.0 scaled the backbone's update by 1e-3..1e-6, so the backbone stopped learning
(docs/scorer_gradients.md, NATS_SPEC.md 3a). The defaults now are the bounded `dense` estimator
(`model.attention.mask_grad=dense`) and `optim.clip_mode=separate`.

This trains the tiny model on the Gutenberg cache twice, with NAtS attention (every NAtS and clipping option at
its default, grad_clip=1.0) and with dense attention, same seed and same data, for STEPS optimizer steps, and
checks:

1. the scorers never swamp the update: at every step the backbone's clipping factor is what it would be
   without them, min(1, grad_clip / |g_backbone|), and the scorers' gradient norm stays below twice the
   backbone's (the dense estimator keeps it below half of it; the `exact` one does not);
2. NAtS learns as the dense model does: its training loss falls from ~ln(vocab) by as much, and its mean over
   the last steps and its final validation loss are at most LOSS_TOL above the dense run's.

The learning rate is 5x the CPU default (1e-2, reached after 10 warm-up steps): there the `exact` estimator's
scorer gradient outgrows the backbone's within these 30 steps, so the old setting (`mask_grad=exact`,
`clip_mode=global`) fails both checks, and `exact` under separate clipping fails the scorer bound; at the
default 2e-3 the tiny model does not get there this soon. The dense model and the default NAtS model train
well at 1e-2. Block size 64 and batch 4 keep the two runs cheap on CPU (the 50k-token LM head dominates the
cost): ~30 s together on one core.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from conftest import compose
from nats.train import build

STEPS = 30
RUN = [
    "model.block_size=64",
    "global_batch_size=4",
    "data.micro_batch_size=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=10",
    f"trainer.max_steps={STEPS}",
    f"eval_every={STEPS}",
    "data.max_eval_windows=16",
    "final_validation=false",
    "logger=csv",
    "trainer.log_every_n_steps=1",
    "callbacks=none",
    "trainer.enable_progress_bar=false",
]
NATS = ["model/attention=nats"]  # every NAtS and clipping option at its default
DENSE = ["model/attention=dense"]
FIRST, LAST = 5, 10  # the training loss compared: means over the first / last steps
LOSS_TOL = 0.2  # nats (NAtS may do better, not worse by more); the loss falls by ~3
SCORER_OVER_BACKBONE = 2.0  # the dense estimator peaks at 0.5 here; `exact` passes 1e3 by step 14


def train(run_dir: Path, overrides: list[str]) -> tuple[dict[int, dict[str, float]], float, float]:
    """Fit RUN + overrides; returns ({step: logged train metrics}, final val/loss, grad_clip)."""
    cfg = compose([*RUN, *overrides], run_dir)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == STEPS
    steps: dict[int, dict[str, float]] = {}
    val = []
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if v not in ("", None)}
            if "val/loss" in values:
                val.append(values["val/loss"])
            if "train/loss" in values:
                steps.setdefault(int(values["step"]), {}).update(values)
    assert sorted(steps) == list(range(STEPS)), "a training step was not logged"
    assert len(val) == 1, val
    return steps, val[0], float(cfg.optim.grad_clip)


# the two trainings run once, in one test process (make test's --dist loadgroup would otherwise run them in each)
pytestmark = pytest.mark.xdist_group("nats_trains")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, on one thread: on shared cores, two OpenMP threads that wait on each other take several times
    as long (8x, measured beside another 2-thread torch process); on a quiet machine one thread costs little."""
    root = tmp_path_factory.mktemp("nats_trains")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"nats": train(root / "nats", NATS), "dense": train(root / "dense", DENSE)}
    finally:
        torch.set_num_threads(threads)


def test_scorer_never_shrinks_the_backbone_update(runs):
    """At every step the backbone is clipped as if there were no scorer (clip_mode=separate)."""
    steps, _, clip = runs["nats"]
    shrunk, clipped = [], 0
    for step, m in sorted(steps.items()):
        backbone, scorer = m["train/grad_norm_backbone"], m["train/grad_norm_scorer"]
        assert m["train/grad_norm"] ** 2 == pytest.approx(backbone**2 + scorer**2, rel=1e-4), step
        alone = min(1.0, clip / (backbone + 1e-6))  # the factor the backbone's own norm calls for
        clipped += alone < 1.0
        share = m["train/grad_clip_coef_backbone"] / alone
        if abs(share - 1.0) > 1e-5:
            shrunk.append((share, step, backbone, scorer))
    assert not shrunk, (
        f"the scorers' gradient shrank the backbone's update at {len(shrunk)} of {STEPS} steps; worst: step "
        f"{min(shrunk)[1]}, scaled by {min(shrunk)[0]:.3g} x what its own norm ({min(shrunk)[2]:.3g}) calls for "
        f"(scorer norm {min(shrunk)[3]:.3g})"
    )
    assert clipped >= 5, "clipping was hardly ever active: the check above would say little"


def test_scorer_gradient_stays_below_the_backbone(runs):
    """The scorers' gradient norm stays of the backbone's order (the dense estimator's bound) at every step."""
    steps, _, _ = runs["nats"]
    ratio = {s: m["train/grad_norm_scorer"] / m["train/grad_norm_backbone"] for s, m in steps.items()}
    over = sorted(s for s, r in ratio.items() if r >= SCORER_OVER_BACKBONE)
    worst = max(ratio, key=ratio.get)
    assert not over, (
        f"scorer gradient norm >= {SCORER_OVER_BACKBONE} x the backbone's at steps {over}; worst: step {worst}, "
        f"{steps[worst]['train/grad_norm_scorer']:.3g} against {steps[worst]['train/grad_norm_backbone']:.3g}"
    )


def test_nats_loss_falls_like_dense(runs):
    (nats, nats_val, _), (dense, dense_val, _) = runs["nats"], runs["dense"]

    def loss(steps, which):
        return sum(steps[s]["train/loss"] for s in which) / len(which)

    first, last = range(FIRST), range(STEPS - LAST, STEPS)
    report = (
        f"train loss, first {FIRST} / last {LAST} steps: nats {loss(nats, first):.3f} / {loss(nats, last):.3f}, "
        f"dense {loss(dense, first):.3f} / {loss(dense, last):.3f}; val loss: nats {nats_val:.3f}, "
        f"dense {dense_val:.3f}"
    )
    for steps in (dense, nats):  # both learn: ~10.4 -> ~7.3
        assert loss(steps, last) < loss(steps, first) - 2.5, report
    assert loss(nats, last) < loss(dense, last) + LOSS_TOL, report
    assert nats_val < dense_val + LOSS_TOL, report
    # and the NAtS run was sparse (not dense attention by another name)
    assert nats[STEPS - 1]["train/density"] < 0.9, nats[STEPS - 1]["train/density"]
