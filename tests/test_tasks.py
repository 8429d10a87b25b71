"""Match2 and k-hop induction heads: labels against brute force, data modules, and the experiment configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nats.data.tasks import (
    InductionHeadsDataModule,
    Match2DataModule,
    khop_induction,
    match2,
    match2_positive_rate,
    pair_tokens,
)


# ---------------------------------------------------------------------- generators vs brute force
def test_match2_brute_force():
    x, y = match2(50, seq_len=12, modulus=7, rng=1)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (50, 12)
    assert x.min() >= 0 and x.max() < 7
    for s in range(50):
        for i in range(12):
            expect = any((int(x[s, i]) + int(x[s, j])) % 7 == 0 for j in range(12))  # j = i allowed
            assert int(y[s, i]) == int(expect)


def test_match2_label_balance():
    x, y = match2(4000, 32, 37, rng=0)
    rate = float(y.float().mean())
    assert rate == pytest.approx(match2_positive_rate(32, 37), abs=0.01)
    assert 0.55 < rate < 0.6  # about 57.7% ones: mildly unbalanced
    assert bool(y[x == 0].all())  # x_i = 0 matches itself


def brute_find(x, i):
    """1 + the most recent j < i with x_j == x_i, or None."""
    for j in range(i - 1, -1, -1):
        if x[j] == x[i]:
            return j + 1
    return None


@pytest.mark.parametrize("k", [1, 2, 3])
def test_khop_brute_force(k):
    x, y = khop_induction(40, seq_len=30, alphabet=4, k=k, rng=k)
    assert x.shape == y.shape == (40, 30) and x.dtype == y.dtype == torch.int64
    for s in range(40):
        seq = x[s].tolist()
        assert all(a != b for a, b in zip(seq, seq[1:])), "no immediate repeats"
        for i in range(30):
            pos = i
            for _ in range(k):
                pos = brute_find(seq, pos) if pos is not None else None
            assert int(y[s, i]) == (seq[pos] if pos is not None else -100)


def test_induction_target_is_token_after_most_recent_occurrence():
    x = [0, 1, 2, 0, 3, 0, 2, 1]
    # hand-checked: i=3 (0) -> after pos 0 is 1; i=5 (0) -> after pos 3 is 3; i=6 (2) -> after pos 2 is 0;
    # i=7 (1) -> after pos 1 is 2; first occurrences -> -100
    expect = [-100, -100, -100, 1, -100, 3, 0, 2]
    got = [(x[p] if (p := brute_find(x, i)) is not None else -100) for i in range(len(x))]
    assert got == expect


def test_induction_statistics():
    x, y = khop_induction(500, 100, 4, 1, rng=0)
    assert set(x.unique().tolist()) == {0, 1, 2, 3}
    assert float((y == -100).float().mean()) < 0.05  # only the first occurrence of each token has no target
    assert (y[:, 0] == -100).all() and (y[:, 1] == -100).all()


def test_pair_tokens():
    x = torch.tensor([[2, 0, 3, 1]])
    assert pair_tokens(x, 4).tolist() == [[2, 0 + 4 * 3, 3 + 4 * 1, 1 + 4 * 4]]
    assert int(pair_tokens(khop_induction(100, 100, 4, 1, 0)[0], 4).max()) < 20


# ---------------------------------------------------------------------- data modules
def test_match2_datamodule_splits_and_batches():
    dm = Match2DataModule(n_train=100, n_test=40, micro_batch_size=16, seed=3, vocab_size=37, n_classes=2)
    dm.setup("fit")
    xs = {name: dm.split(name)[0] for name in ("train", "validation", "test")}
    assert len(xs["train"]) == 100 and len(xs["validation"]) == len(xs["test"]) == 40
    assert not torch.equal(xs["validation"], xs["test"])
    assert not torch.equal(xs["train"][:40], xs["validation"])
    again = Match2DataModule(n_train=100, n_test=40, micro_batch_size=16, seed=3)
    assert torch.equal(again.split("test")[0], xs["test"]), "generated from the seed"
    other = Match2DataModule(n_train=100, n_test=40, micro_batch_size=16, seed=4)
    assert not torch.equal(other.split("test")[0], xs["test"])
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, tuple) and len(batch) == 2
    x, y = batch
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    assert len(dm.train_dataloader()) == 100 // 16  # whole batches, about one pass without a trainer
    val = list(dm.val_dataloader())
    assert torch.equal(torch.cat([b[0] for b in val]), xs["validation"])  # in order, all of it
    assert 0.5 < dm.positive_rate() < 0.65


def fake_trainer(step=0, world=1, rank=0, max_steps=10, accum=1):
    return SimpleNamespace(
        global_step=step, world_size=world, global_rank=rank, max_steps=max_steps, accumulate_grad_batches=accum
    )


def rows(t):
    return [tuple(r) for r in t.tolist()]


def test_train_stream_passes_are_permutations():
    dm = Match2DataModule(n_train=64, n_test=8, micro_batch_size=16, seed=0)
    xs = torch.cat([b[0] for b in dm.train_dataloader()])  # no trainer: one pass
    assert len(xs) == 64 and sorted(rows(xs)) == sorted(rows(dm.split("train")[0]))
    assert not torch.equal(xs, dm.split("train")[0]), "shuffled"
    dm.trainer = fake_trainer(max_steps=8)  # 8 x 16 = two passes, in different orders
    xs = torch.cat([b[0] for b in dm.train_dataloader()])
    assert len(xs) == 128 and sorted(rows(xs[:64])) == sorted(rows(xs[64:])) and not torch.equal(xs[:64], xs[64:])
    again = Match2DataModule(n_train=64, n_test=8, micro_batch_size=16, seed=0)
    again.trainer = fake_trainer(max_steps=8)
    assert torch.equal(torch.cat([b[0] for b in again.train_dataloader()]), xs), "reproducible"


def test_train_stream_resumes_at_the_global_step():
    dm = Match2DataModule(n_train=64, n_test=8, micro_batch_size=8, seed=1)
    dm.trainer = fake_trainer(step=0, max_steps=20, accum=2)
    full = [b[0] for b in dm.train_dataloader()]
    dm.trainer = fake_trainer(step=3, max_steps=20, accum=2)  # 3 optimizer steps = 6 micro-batches done
    resumed = next(iter(dm.train_dataloader()))[0]
    assert torch.equal(resumed, full[6])


def test_ranks_read_disjoint_shares():
    dm = Match2DataModule(n_train=64, n_test=16, micro_batch_size=8, seed=0)
    dm.trainer = fake_trainer(max_steps=4)
    single = torch.cat([b[0] for b in dm.train_dataloader()])
    shares = []
    for rank in range(2):
        dm.trainer = fake_trainer(world=2, rank=rank, max_steps=2)
        shares.append(torch.cat([b[0] for b in dm.train_dataloader()]))
    assert len(shares[0]) == len(shares[1]) == 16
    assert not (set(rows(shares[0])) & set(rows(shares[1])))
    assert torch.equal(shares[0], single[0::2]) and torch.equal(shares[1], single[1::2])
    evals = []
    for rank in range(2):
        dm.trainer = fake_trainer(world=2, rank=rank)
        evals.append(torch.cat([b[0] for b in dm.val_dataloader()]))
    assert sorted(rows(torch.cat(evals))) == sorted(rows(dm.split("validation")[0]))


def test_induction_datamodule():
    dm = InductionHeadsDataModule(n_train=64, n_test=32, micro_batch_size=8, seed=0, vocab_size=20, n_classes=4)
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape == (8, 100) and int(x.max()) < 20 and int(y.max()) < 4
    plain = InductionHeadsDataModule(n_train=64, n_test=32, micro_batch_size=8, seed=0, pair_input=False)
    assert plain.vocab_size == 4
    xp, yp = plain.split("test")
    assert torch.equal(pair_tokens(xp, 4), dm.split("test")[0]) and torch.equal(yp, dm.split("test")[1])


def test_vocab_mismatch_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        InductionHeadsDataModule(pair_input=False, vocab_size=20)
    with pytest.raises(ValueError, match="n_classes"):
        Match2DataModule(n_classes=3)


# ---------------------------------------------------------------------- configs
def compose(overrides):
    from nats.train import compose_config

    return compose_config(overrides + ["paths.output_dir=/tmp/nats_test_tasks"])


@pytest.mark.parametrize(
    "experiment,causal,vocab,n_out", [("anna_match2", False, 37, 2), ("anna_induction", True, 20, 4)]
)
def test_experiment_configs_compose(experiment, causal, vocab, n_out):
    import hydra
    from omegaconf import OmegaConf

    from nats.models.gpt import GPTConfig

    cfg = compose([f"experiment={experiment}", "model.attention.beta=10"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert model["attention"] == {"name": "softmax_surrogate", "beta": 10, "output_gate": "none"}
    assert (model["n_layer"], model["n_head"], model["n_embd"]) == (1, 1, 64)
    assert (model["causal"], model["vocab_size"], model["n_out"]) == (causal, vocab, n_out)
    GPTConfig.from_dict(model)
    # the paper's Adam lr 0.01 as the peak of warm-up + cosine, with clipping (docs/anna_and_gates.md, Figure 1a)
    assert cfg.optim.lr == 0.01 and cfg.optim.optimizer.weight_decay == 0
    assert tuple(cfg.optim.optimizer.betas) == (0.9, 0.999) and cfg.optim.optimizer.lr == 0.01
    assert (cfg.optim.warmup_steps, cfg.optim.min_lr, cfg.optim.grad_clip) == (1000, 1e-4, 1.0)
    assert cfg.trainer.max_steps == 20000 and cfg.global_batch_size == cfg.data.micro_batch_size == 32
    dm = hydra.utils.instantiate(cfg.data)
    assert dm.n_train == 10000 and dm.n_test == 256
    anna = compose(
        [f"experiment={experiment}", "model/attention=anna", "model.attention.beta=10", "model.attention.l=4"]
    )
    assert anna.model.attention.name == "anna" and anna.model.attention.l == 4


def test_experiment_trains_through_lightning(tmp_path):
    """One train and one validation batch of the ANNA experiment through nats.train.build (fast_dev_run)."""
    from nats.train import build

    cfg = compose(["experiment=anna_match2", "debug=default", "data.n_train=64", "data.n_test=32"])
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
