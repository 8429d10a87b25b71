"""Data-parallel training on the CPU: the accumulation arithmetic that keeps the global batch at 480 for 1, 2 and 4
processes, and a real 2-process DDP run (gloo) of `nats-train trainer=ddp` that matches the 1-process run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DATA_DIR, REPO, compose
from helpers import TINY_GPT, nats_train
from nats.train import build, run
from nats.utils import grad_accumulation, world_size_of

SMALL = [
    *TINY_GPT,
    "data.max_eval_windows=4",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "trainer.enable_progress_bar=false",
]


def cpu_480(micro: int, processes: int) -> list[str]:
    """SMALL on `processes` CPU processes of `micro` sequences each, global batch 480."""
    devices = [f"trainer.devices={processes}", "trainer.accelerator=cpu"]
    return [*SMALL, *devices, "global_batch_size=480", f"data.micro_batch_size={micro}"]


# ----------------------------------------------------------------------------------------------------
# global batch 480 = micro-batch x processes x accumulation
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("micro", [24, 40])  # the paper's micro-batch, and the one ddp_scaling.py uses on an H200
def test_accumulation_reaches_global_batch_480(processes, micro, tmp_path):
    cfg = compose(
        ["experiment=pg19_gpt2_dense", f"trainer.devices={processes}", f"data.micro_batch_size={micro}"], tmp_path
    )
    assert cfg.global_batch_size == 480 and world_size_of(cfg.trainer) == processes
    accum = grad_accumulation(cfg.global_batch_size, cfg.data.micro_batch_size, processes)
    assert micro * processes * accum == 480
    assert accum == {(24, 1): 20, (24, 2): 10, (24, 4): 5, (40, 1): 12, (40, 2): 6, (40, 4): 3}[(micro, processes)]
    # the Trainer the config builds (on CPU processes here) accumulates exactly that
    cpu = compose(cpu_480(micro, processes) + (["+trainer.strategy=ddp"] if processes > 1 else []), tmp_path)
    _, _, trainer = build(cpu)
    assert trainer.accumulate_grad_batches == accum and trainer.world_size == processes
    assert trainer.accumulate_grad_batches * micro * trainer.world_size == 480


@pytest.mark.parametrize("micro, processes", [(24, 3), (7, 4), (500, 1)])
def test_global_batch_that_does_not_divide(micro, processes, tmp_path):
    with pytest.raises(ValueError, match=rf"global_batch_size=480 is not divisible by .* = {micro} x {processes}"):
        grad_accumulation(480, micro, processes)
    cfg = compose(cpu_480(micro, processes), tmp_path)
    with pytest.raises(ValueError, match=r"Choose data.micro_batch_size from \[.*\]"):
        build(cfg)


# ----------------------------------------------------------------------------------------------------
# two processes, gloo
# ----------------------------------------------------------------------------------------------------
DDP_RUN = SMALL + [
    "data.micro_batch_size=2",
    "global_batch_size=8",
    "trainer.max_steps=2",
    "eval_every=2",
    "logger=none",
    "trainer.precision=32-true",
    "callbacks.model_checkpoint.save_top_k=0",
]


@pytest.mark.slow  # DDP on gloo: make test-all
def test_two_process_ddp_matches_one_process(tmp_path):
    """`nats-train trainer=ddp` with 2 CPU processes (Lightning launches the second one, gloo): global batch 8 =
    2 x 2 processes x 2 accumulation; the same samples per optimizer step as one process with 4 accumulation
    steps, hence the same validation loss."""
    run_dir = tmp_path / "ddp"
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    res = nats_train([*ddp, f"paths.data_dir={DATA_DIR}", f"hydra.run.dir={run_dir}", *DDP_RUN], tmp_path)
    assert res.stdout.count("val_ppl ") == 1  # printed by rank 0 only
    assert (run_dir / "train_ddp_process_1.log").is_file()  # the second process ran (Hydra log of rank 1)
    info = json.loads((run_dir / "metrics.json").read_text())
    assert (info["world_size"], info["accumulate_grad_batches"], info["global_step"]) == (2, 2, 2)
    assert info["global_batch_size"] == info["micro_batch_size"] * info["world_size"] * info["accumulate_grad_batches"]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    single = run(compose(DDP_RUN, tmp_path / "single"))
    assert info["metrics"]["val/loss"] == pytest.approx(single["val/loss"], rel=1e-5)


@pytest.mark.slow  # a GPU script's CPU smoke run: make test-all
def test_ddp_scaling_script_cpu_smoke(tmp_path):
    """benchmarks/ddp_scaling.py end to end on CPU (2 gloo processes vs 1): both runs, the table, the plot."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "ddp_scaling.py"),
        "--cpu-smoke",
        "--out",
        str(out),
        "--devices",
        "2",
        "--micro",
        "2",
        "--global-batch",
        "8",
        "--steps",
        "4",
        "--log-every",
        "1",
        "--eval-every",
        "2",
        "--min-single-steps",
        "4",
        "--budget-s",
        "240",
        "--data-dir",
        str(DATA_DIR),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((out / "ddp_scaling.json").read_text())
    ddp, single = result["ddp"], result["single"]
    assert ddp["world_size"] == 2 and ddp["accumulation"] == 2 and single["accumulation"] == 4
    assert ddp["tokens_per_s"] > 0 and single["tokens_per_s"] > 0 and result["speedup"] > 0
    common = set(ddp["val_loss"]) & set(single["val_loss"])
    assert common and all(ddp["val_loss"][s] == pytest.approx(single["val_loss"][s], rel=1e-4) for s in common)
    assert "Speed-up 2 GPUs / 1 GPU" in (out / "ddp_scaling.md").read_text()
