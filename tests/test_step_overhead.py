"""The Lightning step's per-step overhead, on the CPU.

* The per-layer statistics, the auxiliary loss, the learning rate and the temperature are logged only on the
  optimizer steps whose logs Lightning writes (``trainer.log_every_n_steps``), and what is written is the same as
  when everything is logged every step (the old behaviour).
* The tau schedule sets each NAtS core (found by type) once per optimizer step (not per micro-batch), and only
  when it changes.
* A compiled run (``compile=aot_eager``: Dynamo's guards are what is tested, not inductor's code) compiles the
  training graph once and the evaluation graph once: no recompile after the first step, through validation, the
  tau and noise schedules and a final ``trainer.validate``, with a NAtS model on the Triton backend whose kernel
  cache is empty when the run starts (the `_TRITON_BACKEND` guard).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import nats.lit
import nats.optim
import nats.step_logging
import nats.train
from conftest import compose
from nats.attention.nats import NAtSAttention
from nats.train import build, run

# 6 optimizer steps of 2 micro-batches (accumulation), logs written every 2 steps, validation every 3
BASE = [
    "model.block_size=32",
    "model.n_layer=2",
    "model/attention=nats",
    "model.attention.window=4",
    "model.attention.sparsity_lambda=0.5",
    "model.attention.backend=reference",
    "data.micro_batch_size=2",
    "global_batch_size=4",
    "data.max_eval_windows=4",
    "trainer.max_steps=6",
    "optim.warmup_steps=2",
    "eval_every=3",
    "trainer.log_every_n_steps=2",
    "logger=csv",
    "callbacks=[default,tau_schedule]",
    "callbacks.tau_schedule.steps=6",
    "callbacks.progress_bar=null",
    "callbacks.model_checkpoint=null",
    "final_validation=false",
    "ckpt_path=null",
]
TIMING = ("per_sec", "mfu", "time")  # throughput columns: wall-clock dependent


def logged_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} from the CSV logger (timing columns left out)."""
    rows: dict[int, dict[str, float]] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for r in csv.DictReader(f):
            step = int(r["step"])
            for k, v in r.items():
                if k != "step" and v not in ("", None) and not any(t in k for t in TIMING):
                    rows.setdefault(step, {})[k] = float(v)
    return rows


def test_logged_values_equal_logging_every_step(tmp_path, monkeypatch):
    """What the loggers receive is unchanged by logging only on the written steps."""
    run(compose(BASE, tmp_path / "new"))
    with monkeypatch.context() as m:  # the old behaviour: every metric logged with self.log on every micro-batch
        m.setattr(nats.lit, "logs_written_now", lambda trainer: True)

        def self_log(self, stats):  # instead of the host copy written to the loggers directly
            for name, value in stats.items():
                self.log(name, value)

        m.setattr(nats.lit.LitGPT, "_stage_layer_stats", self_log)
        run(compose(BASE, tmp_path / "old"))
    new, old = logged_rows(tmp_path / "new"), logged_rows(tmp_path / "old")
    assert new.keys() == old.keys()
    for step in old:
        assert new[step].keys() == old[step].keys(), (step, set(old[step]) ^ set(new[step]))
        for k in old[step]:
            assert new[step][k] == old[step][k], (step, k, new[step][k], old[step][k])
    train_steps = [s for s, r in new.items() if "train_layers/layer1/density" in r]
    assert train_steps == [1, 3, 5], train_steps  # written every 2 optimizer steps (Lightning counts from 0)
    for s in train_steps:
        assert {"lr", "nats/tau", "train/aux_loss", "train/density", "train/grad_norm"} <= new[s].keys()
    assert any("val/density" in r for r in new.values())


def test_statistics_and_tau_only_where_needed(tmp_path, monkeypatch):
    """Training statistics are aggregated and logged only on written steps; the temperature is set once per
    optimizer step on each core (not per micro-batch)."""
    calls: list[tuple[str, int, bool]] = []
    original = nats.lit.LitGPT._log_stats

    def spy(self, split, stats, batch_size=None):
        calls.append((split, self.trainer.global_step, nats.step_logging.logs_written_now(self.trainer)))
        return original(self, split, stats, batch_size)

    sets: list[float] = []
    prop = NAtSAttention.tau

    def set_tau(self, value):
        sets.append(value)
        prop.fset(self, value)

    monkeypatch.setattr(nats.lit.LitGPT, "_log_stats", spy)
    monkeypatch.setattr(NAtSAttention, "tau", property(prop.fget, set_tau))
    run(compose(BASE, tmp_path))
    train = [(step, written) for split, step, written in calls if split == "train"]
    assert train and all(written for _, written in train), train
    assert sorted({s for s, _ in train}) == [1, 3, 5]
    assert len(train) == 3 * 2  # both micro-batches of each written step (Lightning writes the last one's)
    assert any(split == "val" for split, _, _ in calls)
    n_cores = 2
    # tau(0) = start = the core's initial tau (not set); steps 1..5 change it once each
    assert len(sets) == 5 * n_cores, sets


def test_training_metrics_logged_after_the_backward_with_the_steps_lr(tmp_path, monkeypatch):
    """The per-layer statistics are logged once the batch's backward is queued and before anything synchronises
    the device at the end of a written step (~65 `self.log` calls of host Python then overlap the GPU's work),
    and the lr written is the one the optimizer used at that step."""
    events: list[tuple[str, int]] = []
    log_stats, after_backward = nats.lit.LitGPT._log_stats, nats.lit.LitGPT.on_after_backward

    def spy_stats(self, split, stats, batch_size=None):
        events.append((f"log_{split}", self.trainer.global_step))
        return log_stats(self, split, stats, batch_size)

    def spy_backward(self):
        events.append(("backward", self.trainer.global_step))
        return after_backward(self)

    class BatchEnd(Callback):  # the callbacks' on_train_batch_end, where the throughput monitor synchronises
        def on_train_batch_end(self, trainer, *args):
            events.append(("batch_end", trainer.global_step))

    monkeypatch.setattr(nats.lit.LitGPT, "_log_stats", spy_stats)
    monkeypatch.setattr(nats.lit.LitGPT, "on_after_backward", spy_backward)
    build_ = nats.train.build

    def build_with_spy(cfg):
        datamodule, module, trainer = build_(cfg)
        trainer.callbacks.append(BatchEnd())
        return datamodule, module, trainer

    monkeypatch.setattr(nats.train, "build", build_with_spy)
    cfg = compose(BASE, tmp_path)
    run(cfg)
    train = [i for i, (name, _) in enumerate(events) if name == "log_train"]
    assert len(train) == 6, events  # two micro-batches on each of steps 1, 3, 5
    for i in train:  # each right after its micro-batch's backward, before the batch ends
        assert events[i - 1][0] == "backward", events[max(0, i - 3) : i + 1]
        assert events[i + 1][0] == "batch_end", events[i - 1 : i + 2]
    o = cfg.optim
    rows = logged_rows(tmp_path)

    def lr(step):
        return nats.optim.lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, max_steps=6)

    for step in (1, 3, 5):
        assert rows[step]["lr"] == pytest.approx(lr(step), rel=1e-6), (step, rows[step]["lr"], lr(step))
        if step >= o.warmup_steps:  # (the cosine part) the next step's lr, read after the scheduler, differs
            assert lr(step + 1) != pytest.approx(rows[step]["lr"], rel=1e-6)


def test_training_logs_no_python_numbers(tmp_path, monkeypatch):
    """Nothing logged during training is a Python number (on a GPU, Lightning would make it a device tensor with a
    blocking host-to-device copy, a sync on every written step): the lr, tau and noise scale are CPU tensors
    (`host_scalar`), with the values of before."""
    from lightning.pytorch import LightningModule

    seen: dict[str, object] = {}
    original = LightningModule.log

    def spy(self, name, value, *args, **kwargs):
        if self.trainer.training:
            seen[name] = value
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", spy)
    run(
        compose(
            [*BASE, "callbacks=[default,tau_schedule,noise_schedule]", "callbacks.noise_schedule.steps=6"], tmp_path
        )
    )
    assert {"lr", "nats/tau", "nats/noise_scale", "train/loss", "train/density"} <= seen.keys(), seen.keys()
    numbers = {k: v for k, v in seen.items() if not isinstance(v, torch.Tensor)}
    assert not numbers, numbers
    for key in ("lr", "nats/tau", "nats/noise_scale"):
        assert seen[key].device.type == "cpu" and seen[key].dtype == torch.float64, (key, seen[key])
    assert nats.step_logging.host_scalar(0.1).item() == 0.1  # the float itself is written


def test_progress_bar_reads_the_loss_only_on_written_steps(tmp_path, monkeypatch):
    """The bar reads train/loss (a device sync) on the steps whose logs are written, where the device is synchronised
    anyway, and at the last step, not at every refresh."""
    from nats.callbacks import StepProgressBar

    reads: list[tuple[int, bool]] = []
    original = StepProgressBar.get_metrics

    def spy(self, trainer, pl_module):
        if trainer.training:
            reads.append((trainer.global_step, nats.step_logging.logs_written_now(trainer)))
        return original(self, trainer, pl_module)

    monkeypatch.setattr(StepProgressBar, "get_metrics", spy)
    overrides = [o for o in BASE if o != "callbacks.progress_bar=null"]
    cfg = compose([*overrides, "trainer.max_steps=7", "callbacks.progress_bar.refresh_rate=1"], tmp_path)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    (bar,) = [c for c in trainer.callbacks if isinstance(c, StepProgressBar)]
    # written steps 1, 3, 5 end at global_step 2, 4, 6; 7 is the last (the refresh rate alone would read at 1..7)
    assert sorted({step for step, _ in reads}) == [2, 4, 6, 7], reads
    assert all(written or step == 7 for step, written in reads), reads
    assert bar.train_progress_bar.n == 7 and "train/loss=" in str(bar.train_progress_bar.postfix)


def test_tau_schedule_finds_nats_cores_by_type():
    """TemperatureSchedule sets tau on the NAtS cores (by class), not on any module that has `tau` and `scorer`."""
    from types import SimpleNamespace

    from nats.callbacks import TemperatureSchedule
    from nats.models.gpt import GPT, GPTConfig

    class Decoy(torch.nn.Module):  # duck-typed like a NAtS core, but another class
        tau, scorer = 1.0, None

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(
                GPTConfig(
                    vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=8, attention={"name": "nats", "window": 2}
                )
            )
            self.decoy = Decoy()
            self.logged = {}

        def log(self, name, value):
            self.logged[name] = value

    module = Module()
    schedule = TemperatureSchedule(start=1.0, end=0.5, steps=4)
    trainer = SimpleNamespace(global_step=4, fast_dev_run=True)
    schedule.on_train_batch_start(trainer, module, None, 0)
    assert [b.attn.core.tau for b in module.gpt.blocks] == [0.5, 0.5] and module.decoy.tau == 1.0
    assert module.logged == {"nats/tau": 0.5}


def test_noise_schedule_values_and_cores():
    """NoiseSchedule: linear from start to end over `steps`, then end; set on the NAtS cores of the module (in
    place, the buffer the forward reads) and logged as nats/noise_scale; bad arguments are refused."""
    from types import SimpleNamespace

    from nats.callbacks import NoiseSchedule
    from nats.models.gpt import GPT, GPTConfig

    schedule = NoiseSchedule(start=1.0, end=0.0, steps=4)
    assert [schedule.value_at(s) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = GPTConfig(
                vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=8, attention={"name": "nats", "window": 2}
            )
            self.gpt = GPT(cfg)
            self.logged = {}

        def log(self, name, value):
            self.logged[name] = value

    module = Module()
    buffers = [b.attn.core.noise_buf for b in module.gpt.blocks]
    schedule.on_train_batch_start(SimpleNamespace(global_step=2, fast_dev_run=True), module, None, 0)
    assert [b.attn.core.noise_scale for b in module.gpt.blocks] == [0.5, 0.5]
    assert [b.attn.core.noise_buf for b in module.gpt.blocks] == buffers and buffers[0].item() == 0.5
    assert module.logged == {"nats/noise_scale": 0.5}
    with pytest.raises(ValueError, match="NoiseSchedule needs"):
        NoiseSchedule(start=1.0, end=-0.1, steps=4)


def test_compiled_run_never_recompiles(tmp_path):
    """compile=aot_eager, NAtS on the Triton backend (interpreted on the CPU): after the first training step
    and the first validation, nothing compiles again (fail_on_recompile), and each compiled function holds one
    graph at the end."""
    import lightning as L

    from nats import functional as NF
    from nats.models.gpt import GPT

    pytest.importorskip("triton")
    torch._dynamo.reset()
    NF._TRITON_BACKEND.clear()  # a fresh process: the kernel not loaded yet

    class FailOnRecompile(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step >= 3:  # after step 1 and the validation at step 2
                torch.compiler.set_stance("fail_on_recompile")

    overrides = [o for o in BASE if not o.startswith(("model.attention.backend", "callbacks=["))]
    cfg = compose(
        overrides
        + [
            "model.attention.backend=triton",
            "compile=aot_eager",
            "global_batch_size=2",
            "trainer.max_steps=5",
            "eval_every=2",
            "callbacks.tau_schedule.steps=5",
            "callbacks=[default,tau_schedule,noise_schedule]",  # the Gumbel noise's scale changes every step too
            "callbacks.noise_schedule.steps=5",
        ],
        tmp_path,
    )
    datamodule, module, trainer = build(cfg)
    trainer.callbacks.append(FailOnRecompile())
    try:
        trainer.fit(module, datamodule=datamodule)  # validations at steps 2 and 4
        trainer.validate(module, datamodule=datamodule, verbose=False)
    finally:
        torch.compiler.set_stance("default")
    assert trainer.global_step == 5
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    train_entries = _debug_get_cache_entry_list(GPT.forward.__code__)
    eval_entries = _debug_get_cache_entry_list(
        module._forward_eval.__wrapped__.__code__
        if hasattr(module._forward_eval, "__wrapped__")
        else module._forward_eval._torchdynamo_orig_callable.__code__
    )
    assert len(train_entries) == 1, len(train_entries)
    assert len(eval_entries) == 1, len(eval_entries)
    torch._dynamo.reset()


def test_staged_metrics_write_each_step_once_its_copy_is_done():
    """`StagedMetrics`: a step staged twice keeps its last values; write hands every completed step to the loggers
    at its own step and keeps nothing after."""

    class Logger:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

    staged, logger = nats.step_logging.StagedMetrics(), Logger()
    staged.stage(3, {"a": torch.tensor(1.0), "b": torch.tensor(2.0)})
    staged.stage(3, {"a": torch.tensor(5.0), "b": torch.tensor(6.0)})  # a later micro-batch of step 3
    staged.stage(4, {"a": torch.tensor(7.0), "b": torch.tensor(8.0)})
    assert len(staged) == 2
    staged.write([logger])
    assert logger.rows == [(3, {"a": 5.0, "b": 6.0}), (4, {"a": 7.0, "b": 8.0})] and len(staged) == 0
