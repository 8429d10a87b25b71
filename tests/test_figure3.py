"""experiments/figure3.py: run naming, the commands it launches (they compose to the intended configs), the report
on the committed results of the study, pack / report round trip, and (slow) a tiny end-to-end run on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose

spec = importlib.util.spec_from_file_location("figure3", REPO / "experiments" / "figure3.py")
figure3 = importlib.util.module_from_spec(spec)
sys.modules["figure3"] = figure3
spec.loader.exec_module(figure3)

RESULTS = REPO / "experiments" / "results" / "figure3"


def test_run_names():
    assert figure3.expand(["dense", "nats_l0.05"], [1, 2]) == ["dense_s1", "dense_s2", "nats_l0.05_s1", "nats_l0.05_s2"]
    assert figure3.expand(["dense_s3"], [1]) == ["dense_s3"]
    assert figure3.parse_run("nats_l1_exact_s2") == ("nats_l1_exact", 2)
    for bad in (["nats_l0.07"], ["dense_sx"]):
        with pytest.raises(SystemExit, match="unknown run"):
            figure3.expand(bad, [1])


def test_train_command_composes_the_intended_config(tmp_path):
    """The overrides `train` launches (minus Hydra's own run dir) compose to fig3_nats with the run's lambda and
    seed."""
    cmd = figure3.train_cmd("nats_l1_exact_s2", tmp_path, ["data.path=/nowhere"], steps=None)
    overrides = [a for a in cmd[3:] if not a.startswith("hydra.")]
    cfg = compose(overrides, tmp_path)
    att = cfg.model.attention
    assert (att.name, att.sparsity_lambda, att.mask_grad, att.window) == ("nats", 1.0, "exact", 16)
    assert cfg.seed == 2 and cfg.trainer.max_steps == 1000 and cfg.data.source == "pg19"
    assert cfg.callbacks.tau_schedule.steps == 1000 and cfg.optim.clip_mode == "separate"
    dense = compose(
        [a for a in figure3.train_cmd("dense_s1", tmp_path, [], 300)[3:] if not a.startswith("hydra.")], tmp_path
    )
    assert dense.model.attention.name == "dense" and dense.trainer.max_steps == 300
    assert dense.global_batch_size == dense.data.micro_batch_size == 32 and dense.model.block_size == 1024


def test_eval_commands():
    cmds = dict(figure3.eval_cmds("dense_s1", Path("/r"), [], 512, (128, 16)))
    assert "methods=[full,streaming_llm,h2o]" in cmds["test"] and "batch_size=128" in cmds["test"]
    assert "methods=[full]" in cmds["validation"] and "data=pg19_subset" in cmds["test"]
    nats = dict(figure3.eval_cmds("nats_l0.05_s1", Path("/r"), ["data=gutenberg"], 8, (128, 16)))
    assert "methods=[nats]" in nats["test"] and "batch_size=16" in nats["test"] and "data=gutenberg" in nats["test"]
    assert "data=pg19_subset" not in nats["test"]


@pytest.mark.skipif(not RESULTS.is_dir(), reason="the study's results are not in this checkout")
def test_report_of_the_committed_study(tmp_path):
    """The report of the committed runs: every NAtS point and baseline is there, with the numbers of the raw
    evaluations, and the plots are written."""
    figure3.main(["report", "--root", str(RESULTS), "--out", str(tmp_path)])
    text = (tmp_path / "figure3.md").read_text()
    rows = json.loads((tmp_path / "figure3.json").read_text())["rows"]
    test = {(r["model"], r["setting"]): r for r in rows if r["split"] == "test"}
    assert len(test[("dense", "full")]["seeds"]) == 2
    raw = json.loads((RESULTS / "nats_l0.05_s1" / "eval_test" / "results.json").read_text())["results"][0]
    got = test[("nats_l0.05", "NAtS lambda=0.05")]
    assert got["ppl_mean"] == pytest.approx(raw["ppl"]) and got["area_mean"] == pytest.approx(raw["area"])
    for budget in (2, 4, 8, 16, 32):
        assert ("dense", f"h2o B=N/{budget}") in test and ("dense", f"streaming_llm B=N/{budget}") in test
    assert "| nats_l0.05 | NAtS lambda=0.05 | 1 |" in text
    for name in ("figure3_ppl_vs_area.png", "figure3_ppl_vs_peak.png", "figure3_loss.png", "figure3_kv_layers.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.skipif(not RESULTS.is_dir(), reason="the study's results are not in this checkout")
def test_pack_and_report_round_trip(tmp_path):
    pack = tmp_path / "out" / "figure3.tar.gz"
    figure3.main(["pack", "--root", str(RESULTS), "--out", str(pack)])
    copy = tmp_path / "copy"
    figure3.main(["report", "--root", str(copy), "--packed", str(pack), "--out", str(tmp_path / "rep")])
    for run in RESULTS.iterdir():
        assert (copy / run.name / "csv" / "metrics.csv").read_bytes() == (run / "csv" / "metrics.csv").read_bytes()
    assert (tmp_path / "rep" / "figure3.md").read_text() == _report_text(RESULTS, tmp_path / "rep2")


def _report_text(root, out):
    figure3.main(["report", "--root", str(root), "--out", str(out)])
    return (out / "figure3.md").read_text()


@pytest.mark.slow
def test_tiny_study_end_to_end_on_cpu(tmp_path):
    """train --eval (background processes), status, report: a tiny dense and NAtS model on Gutenberg (~2 min)."""
    extra = [
        "model=tiny",
        "trainer=cpu",
        "compile=false",
        "data=gutenberg",
        "data.micro_batch_size=4",
        "global_batch_size=4",
        "trainer.max_steps=6",
        "eval_every=3",
        "data.max_eval_windows=4",
        "data.num_workers=0",
        "trainer.log_every_n_steps=1",
        f"paths.data_dir={REPO / 'data'}",
    ]
    root = tmp_path / "runs"
    figure3.main(
        [
            "train",
            "--eval",
            "--root",
            str(root),
            "--runs",
            "dense",
            "nats_l0.05",
            "--budget-s",
            "400",
            "--max-windows",
            "4",
            "--batch-size-dense",
            "4",
            "--batch-size-nats",
            "4",
            "--extra",
            *extra,
        ]
    )
    for run in ("dense_s1", "nats_l0.05_s1"):
        assert (root / run / "metrics.json").is_file(), (root / run / "train.out").read_text()[-2000:]
        for split in ("validation", "test"):
            assert (root / run / f"eval_{split}" / "results.json").is_file()
    figure3.main(["report", "--root", str(root), "--out", str(tmp_path / "rep")])
    assert "NAtS lambda=0.05" in (tmp_path / "rep" / "figure3.md").read_text()
