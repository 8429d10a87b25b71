"""The training stack through the real configs: composition, fast_dev_run fits, exact resume, clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from conftest import REPO, compose
from nats.train import build, run
from nats.utils import grad_accumulation

MODELS = sorted(p.stem for p in (REPO / "conf/model").glob("*.yaml"))
# _base: shared keys; hf_longctx: data for a pretrained transformers model (tests/test_hf_finetune.py runs it)
DATAS = sorted(
    p.stem
    for p in (REPO / "conf/data").glob("*.yaml")
    if not p.stem.startswith("_") and "nats.finetune." not in p.read_text()
)
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))
ATTENTIONS = sorted(p.stem for p in (REPO / "conf/model/attention").glob("*.yaml"))
LM_DATA = {"gutenberg", "pg19", "pg19_subset", "text_dir"}


@pytest.fixture(scope="module")
def book_dir(tmp_path_factory) -> Path:
    """A tiny corpus in PG-19's layout (train/ validation/ test/ of .txt books)."""
    root = tmp_path_factory.mktemp("books")
    words = "the quick brown fox jumps over the lazy dog and then sleeps in the warm sun".split()
    for split, n_books in (("train", 3), ("validation", 1), ("test", 1)):
        (root / split).mkdir()
        for b in range(n_books):
            text = " ".join(words[(i * 7 + b) % len(words)] for i in range(600))
            (root / split / f"book{b}.txt").write_text(text)
    return root


def small(overrides: list[str]) -> list[str]:
    """Shrink any config to CPU-test size (tiny windows and batches)."""
    return ["model.block_size=32", "data.micro_batch_size=2", "global_batch_size=2", *overrides]


def data_overrides(data: str, book_dir: Path) -> list[str]:
    out = [f"data={data}"]
    if data in ("pg19", "pg19_subset", "text_dir"):  # the tiny corpus, not the real PG-19 subset
        out += [f"data.path={book_dir}", "data.num_workers=0", f"data.cache_dir={book_dir}/cache"]
    if data in LM_DATA:
        out += ["data.max_eval_windows=4"]
    else:  # the synthetic tasks fix their own sequence length and vocabulary
        out = [f"data={data}", "data.micro_batch_size=2", "global_batch_size=2", "data.n_train=64", "data.n_test=8"]
    return out


# ----------------------------------------------------------------------------------------------------
# every config composes and instantiates
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_configs_compose_and_instantiate(experiment, tmp_path, book_dir):
    cfg = compose(
        [f"experiment={experiment}", f"data.path={book_dir}", f"data.cache_dir={tmp_path}/cache"]
        if "pg19" in experiment
        else [f"experiment={experiment}"],
        tmp_path,
    )
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if cfg.module._target_.startswith("nats.finetune."):
        # a pretrained transformers model (SmolLM2, 135M parameters): tests/test_hf_finetune.py runs this
        # experiment's module and data on a tiny model; here, the lengths agree
        assert cfg.data.max_length <= cfg.hf_model.max_context
    else:
        module = hydra.utils.instantiate(cfg.module, _convert_="all")
        datamodule = hydra.utils.instantiate(cfg.data)
        assert module.model.config.block_size >= getattr(datamodule, "block_size", 0)
    # the trainer as configured (GPUs) cannot start here: instantiate it on the CPU instead
    with open_dict(cfg):
        cfg.trainer.update(accelerator="cpu", devices=1, strategy="auto", precision="32-true")
    trainer = hydra.utils.instantiate(cfg.trainer)
    assert trainer.max_steps == cfg.trainer.max_steps


def test_paper_setting():
    """experiment=pg19_gpt2_dense is GPT-2-small on PG-19 at 1024, 4-GPU DDP, global batch 480, 600k steps."""
    cfg = compose(["experiment=pg19_gpt2_dense"], Path("/tmp"))
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    assert cfg.data.source == "pg19" and cfg.trainer.devices == 4 and cfg.trainer.strategy == "ddp"
    assert cfg.trainer.max_steps == 600_000 and cfg.global_batch_size == 480
    assert grad_accumulation(cfg.global_batch_size, cfg.data.micro_batch_size, 4) * 24 * 4 == 480
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps) == (6e-4, 6e-5, 2000)
    nats = compose(["experiment=pg19_gpt2_nats"], Path("/tmp"))
    assert nats.model.attention.name == "nats" and nats.model.attention.window == 16


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_configs_build(attention, tmp_path):
    cfg = compose([f"model/attention={attention}"], tmp_path)
    module = hydra.utils.instantiate(cfg.module, _convert_="all")
    x = torch.randint(0, 100, (2, 16))
    out = module.model(x, x)
    assert out.logits.shape == (2, 16, cfg.model.vocab_size) and torch.isfinite(out.loss)


# ----------------------------------------------------------------------------------------------------
# a fast_dev_run fit for each model and data config
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_fast_dev_run_each_model(model, tmp_path):
    text = (REPO / "conf/model" / f"{model}.yaml").read_text()
    if "${data." in text:  # a task model (vocabulary and classes from the task data)
        overrides = [
            f"model={model}",
            "trainer=debug",
            "data=match2",
            "data.micro_batch_size=2",
            "global_batch_size=2",
            "data.n_train=64",
            "data.n_test=8",
        ]
    else:
        overrides = small([f"model={model}", "trainer=debug", "data.max_eval_windows=2"])
    cfg = compose(overrides, tmp_path)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1


@pytest.mark.parametrize("data", DATAS)
def test_fast_dev_run_each_data(data, tmp_path, book_dir):
    overrides = data_overrides(data, book_dir) + ["trainer=debug"]
    if data in LM_DATA:
        overrides = small(overrides)
    else:
        overrides += ["model.vocab_size=${data.vocab_size}", "model.block_size=128"]
    cfg = compose(overrides, tmp_path)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1


# ----------------------------------------------------------------------------------------------------
# a real (short) run: logs, checkpoints, the printed perplexity, exact resume
# ----------------------------------------------------------------------------------------------------
def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


RESUME = small(
    [
        "data.micro_batch_size=2",
        "global_batch_size=4",
        "optim.max_steps=6",
        "optim.warmup_steps=2",
        "eval_every=3",
        "data.max_eval_windows=4",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "final_validation=false",
        "callbacks.throughput=null",
        "callbacks.progress_bar=null",
    ]
)


def test_resume_gives_the_uninterrupted_losses(tmp_path):
    full = tmp_path / "full"
    run(compose(RESUME + ["trainer.max_steps=6"], full))
    first = tmp_path / "first"
    run(compose(RESUME + ["trainer.max_steps=3"], first))
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    resumed = tmp_path / "resumed"
    run(compose(RESUME + ["trainer.max_steps=6", f"ckpt_path={ckpt}"], resumed))
    a, b = train_losses(full), train_losses(resumed)
    assert sorted(b) and min(b) >= 3, b  # the resumed run starts at step 3
    for step in sorted(b):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)
    # and the interrupted run's own steps equal the uninterrupted ones
    c = train_losses(first)
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6)
    # resumed in its own folder (nats-train resume=<run>: ckpt_path=auto), the run's metrics.csv keeps the rows
    # of the first 3 steps (Lightning's CSVLogger deletes them) and has every step once, as the uninterrupted run
    run(compose(RESUME + ["trainer.max_steps=6"], first))
    d = train_losses(first)
    assert sorted(d) == sorted(a), (d, a)
    for step in d:
        assert d[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, d)
    with open(first / "csv" / "metrics.csv") as f:
        rows = [(r["step"], r.get("train/loss")) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == len(set(rows)) == len(a), rows


@pytest.mark.parametrize("stop", [13, 20])  # 20: a step that validates (eval_every=20)
def test_sigterm_then_resume_ends_as_the_uninterrupted_run(tmp_path, stop):
    """A SIGTERM at the end of a step, then nats-train again in the run folder: the same final metrics (the last
    logged learning rate and gradient norm included), also when the step validated: Lightning restarts such a
    checkpoint by counting the step once more, unless the saved count is the one before it (InterruptCheckpoint),
    and every later logged step would be off by one."""
    from nats.runs import RunInterrupted

    settings = small(
        ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "trainer.max_steps=40", "eval_every=20",
         "checkpoint_every=5", "seed=7", "logger=none", "data.max_eval_windows=2", "callbacks.progress_bar=null",
         "callbacks.throughput=null", "trainer.enable_progress_bar=false"]
    )  # fmt: skip
    full, folder = tmp_path / "full", tmp_path / "interrupted"
    run(compose(settings, full))
    stopper = ["+callbacks.stop._target_=slurm_callbacks.SigtermAt", f"+callbacks.stop.step={stop}"]
    with pytest.raises(RunInterrupted):
        run(compose(settings + stopper, folder))
    run(compose(settings, folder))
    want, got = (json.loads((f / "metrics.json").read_text()) for f in (full, folder))
    assert got["resumed_from"] is not None and got["metrics"] == want["metrics"]


def test_short_run_logs_checkpoints_and_prints_ppl(tmp_path, caplog):
    cfg = compose(
        small(
            [
                "trainer.max_steps=4",
                "eval_every=2",
                "data.max_eval_windows=4",
                "trainer.log_every_n_steps=1",
                "callbacks.progress_bar=null",
                "callbacks.throughput.window_size=2",
            ]
        ),
        tmp_path,
    )
    with caplog.at_level("INFO", logger="nats"):  # what the console shows (whatever handlers another test left)
        metrics = run(cfg)
    out = caplog.text
    assert "val_ppl " in out and "unigram_ppl " in out
    ppl = float(out.split("val_ppl ")[1].split()[0])
    assert ppl == pytest.approx(torch.exp(torch.tensor(metrics["val/loss"])).item(), rel=1e-4)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "checkpoints").glob("best-*.ckpt"))
    events = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, "TensorBoard wrote no event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "val/ppl", "lr"} <= tags, tags
    assert any("items_per_sec" in t for t in tags), tags  # tokens/s


# ----------------------------------------------------------------------------------------------------
# clear errors
# ----------------------------------------------------------------------------------------------------
def test_accumulation_arithmetic():
    assert grad_accumulation(480, 24, 4) == 5
    assert grad_accumulation(480, 16, 1) == 30
    assert grad_accumulation(480, 8, 2) == 30
    with pytest.raises(ValueError, match="not divisible.*micro_batch_size"):
        grad_accumulation(480, 7, 4)
    with pytest.raises(ValueError, match=">= 1"):
        grad_accumulation(480, 0, 1)


def test_batch_that_does_not_divide(tmp_path):
    cfg = compose(["global_batch_size=10", "data.micro_batch_size=4"], tmp_path)
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible"):
        build(cfg)


def test_unknown_attention_name(tmp_path):
    cfg = compose(["model.attention.name=bogus"], tmp_path)
    with pytest.raises(ValueError, match="unknown attention 'bogus'.*dense"):
        build(cfg)


def test_window_below_one(tmp_path):
    cfg = compose(["model/attention=nats", "model.attention.window=0"], tmp_path)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        build(cfg)


def test_sequence_longer_than_model(tmp_path):
    cfg = compose(["model.block_size=32", "data.block_size=64"], tmp_path)
    with pytest.raises(ValueError, match="data.block_size=64 is longer than model.block_size=32"):
        build(cfg)
    module = hydra.utils.instantiate(compose(["model.block_size=32"], tmp_path).module, _convert_="all")
    with pytest.raises(ValueError, match="longer than the model's block_size 32"):
        module.model(torch.zeros(1, 33, dtype=torch.long))


def test_missing_checkpoint(tmp_path):
    cfg = compose(small([f"ckpt_path={tmp_path}/nope.ckpt"]), tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.ckpt does not exist"):
        run(cfg)


def test_missing_data_folder(tmp_path):
    cfg = compose(small(["data=text_dir", f"data.path={tmp_path}/missing", "trainer=debug"]), tmp_path)
    datamodule, module, trainer = build(cfg)
    with pytest.raises(FileNotFoundError, match="missing"):
        trainer.fit(module, datamodule=datamodule)
