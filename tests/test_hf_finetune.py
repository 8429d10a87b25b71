"""nats-train experiment=finetune_smollm2_nats on a tiny random Llama: the real config, composed
and run through nats.train, with hf_model pointing at a 2-layer model and a small byte-level BPE tokenizer saved
offline in a temporary folder.

Checked: only the scorer weights change (the backbone stays bit-identical); the loss is the MSE of the final
hidden states on the answer span (against a hand computation with an independently loaded dense model) plus
lambda x density, and the density term reaches the scorers' gradient; checkpoints hold the scorer weights only and
load strictly; a run resumed from a checkpoint ends with the uninterrupted run's scorer weights; the learning-rate
schedule; scorers.pt; the datamodule's split, order and micro-batch rule.
"""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from nats import functional as NF  # noqa: E402
from nats.finetune.datamodule import LongContextDataModule, _TrainSamples, collate  # noqa: E402
from nats.finetune.lit import LitNAtSDistill, finetune_lr_at  # noqa: E402
from nats.hf import attach_nats, load_nats_state_dict, nats_density, nats_state_dict, set_force_type  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402
from nats.train import build, compose_config, run  # noqa: E402

WINDOW = 16
STEPS = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A folder in the transformers layout: a random 2-layer Llama (hidden 64, 4 heads / 2 KV heads, vocabulary
    1024) and a byte-level BPE tokenizer (vocabulary ~1000) trained on the data generators' own text."""
    root = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_random_llama(root)
    assert len(transformers.AutoTokenizer.from_pretrained(root)) <= 1024  # the model's vocabulary
    return root


def overrides(pretrained: Path, out: Path, data_dir: Path, *extra: str) -> list[str]:
    return [
        f"paths.output_dir={out}",
        f"paths.log_dir={out}/logs",
        f"paths.data_dir={data_dir}",
        "experiment=finetune_smollm2_nats",
        "trainer=cpu",
        f"hf_model.name_or_path={pretrained}",
        "hf_model.max_context=512",
        "data.max_length=384",
        "data.min_length=320",
        "data.pg19_path=null",
        "data.tasks=[passkey,niah]",
        "data.num_examples=4",
        "data.num_val_examples=1",
        f"module.window={WINDOW}",
        "global_batch_size=2",  # micro-batch 1: two micro-batches per step
        f"optim.max_steps={STEPS}",
        "eval_every=2",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "callbacks.progress_bar=null",
        "callbacks.throughput=null",
        *extra,
    ]


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def logged(run_dir: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in csv_rows(run_dir) if r.get(key)}


def scorer_weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in nats_state_dict(module.model).items()}


@pytest.fixture(scope="module")
def full_run(pretrained, tmp_path_factory):
    """An uninterrupted run of STEPS steps (build + fit, as nats.train.run does for a fresh run)."""
    out = tmp_path_factory.mktemp("full")
    data_dir = tmp_path_factory.getbasetemp() / "data"
    cfg = compose_config(overrides(pretrained, out, data_dir, f"trainer.max_steps={STEPS}", "final_validation=false"))
    datamodule, module, trainer = build(cfg)
    before = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == STEPS
    return {"dir": out, "data_dir": data_dir, "module": module, "before": before, "cfg": cfg}


# ----------------------------------------------------------------------------------------------------------------
# what is trained, what is saved
# ----------------------------------------------------------------------------------------------------------------
def test_only_scorers_change_and_backbone_is_the_pretrained_one(full_run, pretrained):
    module, before = full_run["module"], full_run["before"]
    after = module.model.state_dict()
    scorer_keys = set(nats_state_dict(module.model))
    assert scorer_keys and len(scorer_keys) == 2  # one scorer per layer
    for key, value in after.items():
        if key in scorer_keys:
            assert not torch.equal(value, before[key]), f"{key}: the scorer was not trained"
        else:
            assert torch.equal(value, before[key]), f"{key}: a backbone weight changed"
    fresh = transformers.AutoModelForCausalLM.from_pretrained(pretrained)  # the backbone on disk, bit for bit
    for key, value in fresh.state_dict().items():
        assert torch.equal(after[key], value), key


def test_checkpoint_holds_the_scorers_only_and_loads_strictly(full_run):
    module = full_run["module"]
    ckpt = torch.load(full_run["dir"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STEPS
    assert set(ckpt["state_dict"]) == module.scorer_keys()
    assert all(".nats_scorer." in k for k in ckpt["state_dict"])
    assert ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    for key, value in ckpt["state_dict"].items():
        torch.testing.assert_close(value, module.state_dict()[key], rtol=0, atol=0)
    # strict for the scorer keys: a missing one or a foreign one is refused, naming the keys
    partial = dict(ckpt["state_dict"])
    missing = partial.pop(sorted(partial)[0])
    with pytest.raises(KeyError, match="missing scorer keys"):
        module.load_state_dict(partial)
    with pytest.raises(KeyError, match="unexpected keys"):
        module.load_state_dict({**ckpt["state_dict"], "model.not_a_weight": missing})
    module.load_state_dict(ckpt["state_dict"])  # the scorers alone: the backbone stays


def test_scorers_file_and_stats_json(full_run, pretrained):
    module = full_run["module"]
    path = full_run["dir"] / "scorers.pt"
    assert path.is_file()
    model = attach_nats(transformers.AutoModelForCausalLM.from_pretrained(pretrained), window=WINDOW)
    load_nats_state_dict(model, torch.load(path, weights_only=True))
    for key, value in nats_state_dict(model).items():
        torch.testing.assert_close(value, nats_state_dict(module.model)[key], rtol=0, atol=0)
    assert not list(full_run["dir"].glob(".scorers.pt.*.tmp"))  # written atomically
    stats = json.loads((full_run["dir"] / "nats_stats.json").read_text())
    assert stats["step"] == STEPS and stats["window"] == WINDOW and stats["examples"] == 2
    for name in ("density", "peak"):
        assert len(stats["per_layer"][name]) == 2  # layers
        assert all(len(row) == 2 for row in stats["per_layer_head"][name])  # KV heads
        assert all(0 < v <= 1 for v in stats["per_layer"][name])
    val_density = logged(full_run["dir"], "val/density")
    assert stats["mean"]["density"] == pytest.approx(val_density[max(val_density)], rel=1e-5)
    for i in range(2):
        assert logged(full_run["dir"], f"val_layers/layer{i}/density")


def test_logs_and_lr_schedule(full_run):
    run_dir = full_run["dir"]
    keys = ("train/loss", "train/mse", "train/density", "train/density_argmax", "train/grad_norm", "val/loss")
    for key in (*keys, "val/mse", "val/density"):
        assert logged(run_dir, key), key
    assert all(0 < v <= 1 for v in logged(run_dir, "train/density_argmax").values())
    lr = logged(run_dir, "lr")
    # 4 steps: warm-up and cool-down of round(0.2 * 4) = 1 step each
    assert [lr[s] for s in range(STEPS)] == pytest.approx([2e-4, 2e-3, 2e-3, 2e-4], rel=1e-6)
    # train/loss = train/mse + lambda * train/density, lambda = 0.1 (the experiment's value)
    loss, mse, dens = (logged(run_dir, k) for k in ("train/loss", "train/mse", "train/density"))
    for step in loss:
        assert loss[step] == pytest.approx(mse[step] + 0.1 * dens[step], rel=1e-5)


def test_noise_schedule_trains_on_the_argmax_types_at_its_end(full_run, pretrained, tmp_path):
    """'callbacks=[default,noise_schedule]' composes with the fine-tune experiment; the logged noise scale follows
    the schedule (1 -> 0 over 2 steps); once it is 0 the sampled density the loss sees equals the argmax density
    (train/density == train/density_argmax), while with noise (full_run) the two differ."""
    out = tmp_path / "noise"
    run(
        compose_config(
            overrides(
                pretrained,
                out,
                full_run["data_dir"],
                "trainer.max_steps=4",
                "final_validation=false",
                "callbacks=[default,noise_schedule]",
                "callbacks.noise_schedule.steps=2",
                "callbacks.progress_bar=null",
                "callbacks.throughput=null",
            )
        )
    )
    assert logged(out, "nats/noise_scale") == pytest.approx({0: 1.0, 1: 0.5, 2: 0.0, 3: 0.0})
    sampled, argmax = logged(out, "train/density"), logged(out, "train/density_argmax")
    for step in (2, 3):
        assert sampled[step] == pytest.approx(argmax[step], rel=1e-6)
    noisy = (logged(full_run["dir"], k) for k in ("train/density", "train/density_argmax"))
    assert any(abs(a - b) > 1e-4 for a, b in zip(*(d.values() for d in noisy)))


def test_lr_schedule_values():
    kw = dict(lr=2e-3, min_lr=2e-4, max_steps=300, warmup_frac=0.2, cooldown_frac=0.2)
    lrs = [finetune_lr_at(s, **kw) for s in range(300)]
    assert lrs[0] == pytest.approx(2e-4)
    assert lrs[30] == pytest.approx(2e-4 + 0.5 * 1.8e-3)  # half-way through the 60 warm-up steps
    assert lrs[60:240] == pytest.approx([2e-3] * 180)
    assert lrs[299] == pytest.approx(2e-4)
    assert lrs == pytest.approx(lrs[::-1])  # the cool-down mirrors the warm-up
    assert all(a <= b for a, b in zip(lrs[:60], lrs[1:61])) and max(lrs) == pytest.approx(2e-3)
    assert finetune_lr_at(400, **kw) == pytest.approx(2e-4)


# ----------------------------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module_and_batch(full_run):
    """A fresh module of the composed config (seeded as nats-train seeds it) and a training batch."""
    datamodule, module, _ = build(full_run["cfg"])
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    return module, next(iter(loader)), datamodule


def test_loss_is_the_answer_span_mse_plus_lambda_density(module_and_batch, pretrained):
    module, batch, datamodule = module_and_batch
    input_ids, mask, samples = batch
    example = datamodule.examples["train"][_TrainSamples(datamodule.examples["train"], datamodule.seed, 8).index(0)]
    assert input_ids[0].tolist() == example.input_ids
    p, n = len(example.prompt_ids), len(example)
    assert n > p + 1 and mask.sum() == n - p  # the answer's tokens are predicted at p - 1 ... n - 2
    # deterministic student types: every token sliding (W = 16 << N, so the student differs from the teacher)
    set_force_type(module.model, NF.TOKEN_SLIDING)
    try:
        module.train()
        loss = module.training_step(batch, 0)
        density = float(nats_density(module.model))
        with torch.no_grad():
            student = module.student_hidden(input_ids)[0]
    finally:
        set_force_type(module.model, None)
    # the teacher by hand: the same weights loaded again, plain dense attention, the decoder's output (final norm)
    dense = transformers.AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="eager")
    with torch.no_grad():
        teacher = dense.model(input_ids=input_ids).last_hidden_state[0]
    span = (student[p - 1 : n - 1] - teacher[p - 1 : n - 1]).pow(2).mean()
    everywhere = (student - teacher).pow(2).mean()
    assert 0 < density < 1 and span > 0
    assert float(loss) == pytest.approx(float(span) + 0.1 * density, rel=1e-4)
    # the sparsity term is the native model's (nats.attention.nats.sparsity_loss summed over the layers): lambda
    # times the mean density over sequences, layers and KV heads
    assert float(module.sparsity()) == pytest.approx(module.sparsity_lambda * density, rel=1e-5)
    assert abs(float(everywhere) - float(span)) > 1e-3 * float(span)  # the span matters to the check
    module.teacher_hidden(input_ids)  # dense attention: the pre-hook's stashed inputs must not be left behind
    assert module._attn_modules and all(m._nats_hidden is None for m in module._attn_modules)


def test_density_term_reaches_the_scorers(module_and_batch):
    module, (input_ids, mask, samples), _ = module_and_batch
    module.train()

    def grads(lam: float) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        with module._gumbel_noise_of(samples):  # the same Gumbel noise for both
            mse, density = module.distill(input_ids, mask)
        (mse + lam * density).backward()
        out = [p.grad.clone() for p in module.scorer_parameters()]
        assert all(p.grad is None for n, p in module.model.named_parameters() if ".nats_scorer." not in n)
        return out

    g0, g1 = grads(0.0), grads(0.5)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in g0)
    assert any(not torch.allclose(a, b) for a, b in zip(g0, g1)), "the density term has no gradient"
    module.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------------------
# resume
# ----------------------------------------------------------------------------------------------------------------
def test_resume_from_checkpoint_ends_like_the_uninterrupted_run(full_run, pretrained, tmp_path):
    first = tmp_path / "first"
    run(
        compose_config(
            overrides(pretrained, first, full_run["data_dir"], "trainer.max_steps=2", "final_validation=false")
        )
    )
    ckpt = first / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    resumed = tmp_path / "resumed"
    run(
        compose_config(
            overrides(
                pretrained,
                resumed,
                full_run["data_dir"],
                f"trainer.max_steps={STEPS}",
                f"ckpt_path={ckpt}",
                "final_validation=false",
            )
        )
    )
    want = nats_state_dict(full_run["module"].model)
    got = torch.load(resumed / "scorers.pt", weights_only=True)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
    a, b = logged(full_run["dir"], "train/loss"), logged(resumed, "train/loss")
    assert sorted(b) == [2, 3]  # the resumed run starts at step 2
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# configuration and data
# ----------------------------------------------------------------------------------------------------------------
def test_datamodule_split_order_and_micro_batch(full_run, pretrained):
    tok = transformers.AutoTokenizer.from_pretrained(pretrained)
    kw = dict(
        hf_model={"name_or_path": str(pretrained)},
        tasks=["passkey", "niah"],
        num_examples=4,
        num_val_examples=2,
        max_length=384,
        min_length=320,
        cache_dir=str(full_run["data_dir"] / "hf_longctx"),
        tokenizer=tok,
    )
    dm = LongContextDataModule(**kw)
    dm.setup("fit")
    train = {tuple(ex.input_ids) for ex in dm.examples["train"]}
    val = {tuple(ex.input_ids) for ex in dm.examples["validation"]}
    assert len(train) == 8 and len(val) == 4 and not train & val  # different seeds: different examples
    samples = _TrainSamples(dm.examples["train"], seed=dm.seed, length=24)
    order = [samples.index(s) for s in range(24)]
    for epoch in range(3):  # every epoch visits every example once, in its own order
        assert sorted(order[8 * epoch : 8 * epoch + 8]) == list(range(8))
    assert order[:8] != order[8:16]
    assert order == [_TrainSamples(dm.examples["train"], dm.seed, 24).index(s) for s in range(24)]
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        LongContextDataModule(**kw, micro_batch_size=2).setup("fit")
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        collate([dm.val_dataloader().dataset[0], dm.val_dataloader().dataset[1]])
    with pytest.raises(ValueError, match="max_context"):
        LongContextDataModule(**{**kw, "hf_model": {"name_or_path": "x", "max_context": 256}})
    with pytest.raises(ValueError, match="pg19_path"):
        LongContextDataModule(**{**kw, "tasks": ["pg19_continuation"]})


def test_the_experiment_config_and_its_errors(tmp_path, pretrained):
    cfg = compose_config(["experiment=finetune_smollm2_nats", f"paths.output_dir={tmp_path}"])
    assert "model" not in cfg and cfg.hf_model.name_or_path == "smollm2-135m"
    assert cfg.module.window == 256 and cfg.trainer.max_steps == 300 and cfg.data.max_length == 4096
    assert cfg.compile is False and cfg.task_name == "finetune_smollm2_nats"
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    lam = cfg.module.sparsity_lambda
    with pytest.raises(ValueError, match="compile=false"):
        LitNAtSDistill({"name_or_path": str(pretrained)}, optim, sparsity_lambda=lam, compile=True)
    with pytest.raises(ValueError, match="did you mean warmup_frac"):
        LitNAtSDistill({"name_or_path": str(pretrained)}, {**optim, "warmup_fraction": 0.1}, sparsity_lambda=lam)
    # lambda's default is documented in one place, the config: the module has none of its own
    assert inspect.signature(LitNAtSDistill).parameters["sparsity_lambda"].default is inspect.Parameter.empty


def test_finetune_report(full_run, tmp_path):
    """experiments/finetune_report.py turns a run folder into the report's table and plots."""
    from conftest import load_script

    mod = load_script("experiments/finetune_report.py")
    text = mod.report(full_run["dir"], tmp_path, "ft")
    stats = json.loads((full_run["dir"] / "nats_stats.json").read_text())
    n_layer = len(stats["per_layer"]["density"])
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.count("|") == 5][1:]  # header first
    assert len(rows) == n_layer  # one row per layer: area, peak, per-head areas
    assert f"{stats['per_layer']['density'][0]:.3f}" in rows[0]
    mse = logged(full_run["dir"], "train/mse")
    assert f"{mse[min(mse)]:.4f}" in text  # the curve's first logged train MSE
    assert (tmp_path / "ft.md").is_file() and (tmp_path / "ft_loss.png").is_file()
    assert (tmp_path / "ft_kv_layers.png").is_file()


def test_finetune_report_says_when_a_run_stopped_early(full_run, tmp_path):
    """A run stopped by trainer.max_time names the steps it ran against max_steps, not max_steps alone."""
    import shutil

    import yaml

    from conftest import load_script

    mod = load_script("experiments/finetune_report.py")
    run = tmp_path / "run"
    shutil.copytree(full_run["dir"], run)
    max_steps = 4
    (run / ".hydra").mkdir(exist_ok=True)  # the settings line is read from Hydra's config of the run
    cfg = {"module": {"window": 64, "sparsity_lambda": 0.3}, "trainer": {"max_steps": max_steps}, "data": {}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    ran = max_steps - 1
    times = {"train_start": 0.0, "step_end": [float(i + 1) for i in range(ran)], "val": []}
    (run / "step_times.json").write_text(json.dumps(times))
    assert f"{ran} (of max_steps {max_steps}) optimizer steps" in mod.report(run, tmp_path, "early")
    times["step_end"].append(float(max_steps))
    (run / "step_times.json").write_text(json.dumps(times))
    assert f", {max_steps} optimizer steps" in mod.report(run, tmp_path, "whole")
