"""The Figure 3 study as it runs: its experiment configs compose to the recipe with the end-of-run evaluations, the
evaluation settings are checked before a training starts, and a tiny version of the study (2 points x 2 seeds,
the basic launcher, the real `nats-train -m` entry point, each run evaluating itself at its end) is collected by
experiments/figure3.py into a table with mean ± std over the seeds."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_DIR, REPO, compose, load_script
from helpers import TINY_GPT, nats_train

# the study reports import experiments/collect.py from beside them, as `python experiments/figure3.py` does
sys.path.insert(0, str(REPO / "experiments"))
figure3 = load_script("experiments/figure3.py")

# a tiny GPT on the embedded Gutenberg corpus, 2 steps, every evaluation on 2 windows
TINY = [
    "hydra/launcher=basic",
    "model=tiny",
    *TINY_GPT,
    "trainer=cpu",
    "compile=false",
    "data=gutenberg",
    "data.micro_batch_size=2",
    "global_batch_size=2",
    "data.max_eval_windows=2",
    "data.num_workers=0",
    "trainer.max_steps=2",
    "eval_every=2",
    "trainer.log_every_n_steps=1",
    "logger=csv",
    "callbacks.progress_bar=null",
    "callbacks.throughput=null",
    "trainer.enable_progress_bar=false",
    f"paths.data_dir={DATA_DIR}",
    # `++`: the sweep over experiment= composes without the experiment first, where these keys do not exist
    "++callbacks.eval_after.common.max_windows=2",
    "++callbacks.eval_after.common.batch_size=2",
    "++callbacks.eval_after.common.budgets=[0.25]",
]


def nats_train_multirun(
    overrides: list[str], sweep: Path, cwd: Path, tiny: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`nats-train -m` with the overrides and TINY (`tiny` changes values of TINY: {key: value})."""
    tiny = tiny or {}
    settings = [f"{k}={tiny.pop(k)}" if k in tiny else o for o in TINY for k in [o.split("=", 1)[0]]]
    assert not tiny, f"not keys of TINY: {tiny}"
    return nats_train(["-m", *overrides, *settings, f"hydra.sweep.dir={sweep}"], cwd, timeout=900)


def test_study_configs_are_the_recipe_plus_the_evaluations(tmp_path):
    dense = compose(["experiment=study_fig3_dense"], tmp_path)
    recipe = compose(["experiment=fig3_dense"], tmp_path)
    assert dense.model == recipe.model and dense.optim == recipe.optim and dense.trainer == recipe.trainer
    assert dense.data.source == "pg19" and dense.trainer.max_steps == 2000 and dense.global_batch_size == 32
    assert "eval_after" not in recipe.callbacks  # the recipe alone (benchmarks) trains only
    ev = dense.callbacks.eval_after
    assert ev._target_ == "nats.callbacks.EvalAfterTraining" and ev.common.max_windows == 512
    assert list(ev.common.budgets) == [0.5, 0.25, 0.125, 0.0625, 0.03125]
    assert {k: list(v.methods) for k, v in ev.evals.items()} == {
        "validation": ["full"],
        "test": ["full", "streaming_llm", "h2o"],
    }
    nats = compose(["experiment=study_fig3_nats", "model.attention.sparsity_lambda=0.3"], tmp_path)
    att = nats.model.attention
    assert (att.name, att.window, att.sparsity_lambda, att.mask_grad) == ("nats", 16, 0.3, "dense")
    assert nats.callbacks.tau_schedule.steps == 2000 and nats.callbacks.eval_after.common.batch_size == 16
    assert {k: list(v.methods) for k, v in nats.callbacks.eval_after.evals.items()} == {
        "validation": ["nats"],
        "test": ["nats"],
    }
    assert nats.task_name == dense.task_name == "figure3"


def test_eval_after_checks_its_settings_before_training(tmp_path):
    from nats.callbacks import EvalAfterTraining

    data = {"_target_": "nats.data.datamodule.TokenDataModule"}
    with pytest.raises(ValueError, match="unknown nats-eval settings.*max_window"):
        EvalAfterTraining({"test": {"max_window": 4}}, data, str(tmp_path))
    # N/32 of N = 32 is one token: no StreamingLLM budget is left
    with pytest.raises(ValueError, match="evals.test: streaming_llm: no usable budget"):
        EvalAfterTraining(
            {"test": {"methods": ["streaming_llm"], "budgets": [0.03125]}}, data, str(tmp_path), block_size=32
        )
    ok = EvalAfterTraining({"test": {"split": "test"}}, data, str(tmp_path), common={"max_windows": 2}, block_size=32)
    assert ok.settings("test") == {"max_windows": 2, "split": "test"}


def test_eval_after_evaluates_the_best_checkpoint_where_asked(tmp_path):
    """An entry with checkpoint=best evaluates the run's best checkpoint by validation loss (ModelCheckpoint's);
    the key is the callback's, not passed to nats-eval; a wrong value or a run without a best checkpoint fails
    with a message naming the fix."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from nats.callbacks import EvalAfterTraining

    data = {"_target_": "nats.data.datamodule.TokenDataModule"}
    with pytest.raises(ValueError, match=r"evals.test.checkpoint='first': choose last or best"):
        EvalAfterTraining({"test": {"checkpoint": "first"}}, data, str(tmp_path))
    ev = EvalAfterTraining({"test": {"split": "test"}, "test_best": {"split": "test", "checkpoint": "best"}}, data,
                           str(tmp_path))  # fmt: skip
    assert ev.settings("test_best") == {"split": "test"} and ev.checkpoints == {"test": "last", "test_best": "best"}
    mc = ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), monitor="val/loss")
    trainer = SimpleNamespace(checkpoint_callback=mc)
    final = tmp_path / "checkpoints" / "last.ckpt"
    assert ev.checkpoint_for("test", trainer, final) == final
    with pytest.raises(ValueError, match="checkpoint=best needs the run's best checkpoint"):
        ev.checkpoint_for("test_best", trainer, final)
    best = tmp_path / "checkpoints" / "best-step500-val3.5900.ckpt"
    best.parent.mkdir()
    best.write_bytes(b"")
    mc.best_model_path = str(best)
    assert ev.checkpoint_for("test_best", trainer, final) == best


def test_model_names_from_the_config():
    def cfg(**att):
        return {"model": {"attention": att}}

    assert figure3.model_name(cfg(name="dense")) == "dense"
    assert figure3.model_name(cfg(name="dense", output_gate="headwise")) == "dense_headwise"
    assert figure3.model_name(cfg(name="nats", sparsity_lambda=0.05, mask_grad="dense")) == "nats_l0.05"
    assert figure3.model_name(cfg(name="nats", sparsity_lambda=1, mask_grad="exact")) == "nats_l1_exact"


@pytest.mark.slow  # four trainings and their evaluations (tests/test_sweeps.py runs a multirun by default)
def test_tiny_study_multirun_then_report(tmp_path):
    """nats-train -m experiment=study_fig3_dense,study_fig3_nats seed=1,2: four runs, each with its evaluations;
    the report has a row per (model, method) with the mean ± sample std over the two seeds."""
    sweep = tmp_path / "figure3"
    nats_train_multirun(["experiment=study_fig3_dense,study_fig3_nats", "seed=1,2"], sweep, tmp_path)
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["0", "1", "2", "3"]
    for run in runs:
        assert (run / "metrics.json").is_file()
        for split in ("validation", "test"):
            res = json.loads((run / f"eval_{split}" / "results.json").read_text())
            assert res["checkpoint"] == str(run / "checkpoints" / "last.ckpt") and res["windows"] == 2

    out = tmp_path / "report"
    report = figure3.main([str(sweep), "--out", str(out), "--device", "a CPU"])
    assert sorted(report["runs"]) == ["dense_s1", "dense_s2", "nats_l0.05_s1", "nats_l0.05_s2"]
    test = {(r["model"], r["setting"]): r for r in report["rows"] if r["split"] == "test"}
    assert sorted(test) == [
        ("dense", "full"),
        ("dense", "h2o B=N/4"),
        ("dense", "streaming_llm B=N/4"),
        ("nats_l0.05", "NAtS lambda=0.05"),
    ]

    def own(run: str, split: str = "test") -> dict:
        folder = Path(report["runs"][run]["dir"])
        return json.loads((folder / f"eval_{split}" / "results.json").read_text())["results"][0]

    for model, setting in (("dense", "full"), ("nats_l0.05", "NAtS lambda=0.05")):
        row = test[(model, setting)]
        ppl = [own(f"{model}_s{seed}")["ppl"] for seed in (1, 2)]
        assert sorted(row["seeds"]) == [1, 2]
        assert row["ppl_mean"] == pytest.approx(statistics.fmean(ppl))
        assert row["ppl_std"] == pytest.approx(statistics.stdev(ppl)) and row["ppl_std"] > 0
    text = (out / "figure3.md").read_text()
    nats = test[("nats_l0.05", "NAtS lambda=0.05")]
    assert (
        f"| nats_l0.05 | NAtS lambda=0.05 | 2 | {nats['area_mean']:.4f} ± {nats['area_std']:.4f} | "
        f"{nats['peak_mean']:.4f} ± {nats['peak_std']:.4f} | "
        f"{nats['ppl_mean']:.2f} ± {nats['ppl_std']:.2f} |"
    ) in text
    assert "## validation split" in text and "N = 32, data gutenberg, 2 steps of 2 x 32 tokens" in text
    (pair,) = [c for c in report["comparisons"] if c["a"] == ("nats_l0.05", "NAtS lambda=0.05")]
    dense = test[("dense", "full")]
    assert pair["b"] == ("dense", "full") and pair["seeds"] == (2, 2)
    assert pair["diff"] == pytest.approx(nats["ppl_mean"] - dense["ppl_mean"])
    assert pair["se"] == pytest.approx((nats["ppl_std"] ** 2 / 2 + dense["ppl_std"] ** 2 / 2) ** 0.5)
    assert "## Which differences exceed the seed spread" in text
    assert "| nats_l0.05 NAtS lambda=0.05 | dense full | 2 / 2 |" in text
    for name in ("figure3_ppl_vs_area.png", "figure3_ppl_vs_peak.png", "figure3_loss.png", "figure3_kv_layers.png"):
        assert (out / name).stat().st_size > 10_000

    # seeds whose run folders are gone, pooled from the report's JSON with the folders at hand: the same rows;
    # a folder's run replaces the report's run of the same name
    pooled = figure3.main([str(runs[0]), "--runs-from", str(out / "figure3.json"), "--out", str(tmp_path / "pooled")])
    assert pooled["rows"] == json.loads(json.dumps(report["rows"]))
    assert (
        pooled["runs"]["dense_s1"]["dir"] == str(runs[0])
        and "from_report" not in json.loads((tmp_path / "pooled" / "figure3.json").read_text())["runs"]["dense_s2"]
    )
    assert "| dense_s2 | 2 |" in (tmp_path / "pooled" / "figure3.md").read_text()  # its training row
    with pytest.raises(SystemExit, match="not a readable report JSON"):
        figure3.main(["--runs-from", str(out / "figure3.md"), "--out", str(tmp_path / "bad")])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit, match="no 'runs' in it"):
        figure3.main(["--runs-from", str(tmp_path / "other.json"), "--out", str(tmp_path / "bad")])


def test_a_difference_exceeds_the_spread_only_beyond_two_standard_errors_without_overlap():
    def row(model, ppl):
        m = statistics.fmean(ppl)
        return {"model": model, "setting": "full", "ppl": ppl, "ppl_mean": m,
                "ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0}  # fmt: skip

    far = figure3.compare(row("a", [47.1, 47.2, 47.0]), row("b", [48.3, 48.5, 48.0]))
    assert far["exceeds"] and not far["overlap"] and far["diff"] == pytest.approx(47.1 - 48.2667, abs=1e-3)
    assert not figure3.compare(row("a", [47.1, 48.1]), row("b", [48.0, 48.5]))["exceeds"]  # the values overlap
    close = figure3.compare(row("a", [47.0, 47.4]), row("b", [47.5, 48.3]))  # no overlap, but within 2 SE
    assert not close["overlap"] and abs(close["diff"]) < 2 * close["se"] and not close["exceeds"]
    one = figure3.compare(row("a", [40.0]), row("b", [48.0, 48.2]))
    assert not one["judged"] and not one["exceeds"] and one["se"] is None


def test_report_refuses_a_model_and_seed_twice_and_an_empty_folder(tmp_path):
    import yaml

    for folder in ("a", "b"):
        (tmp_path / folder / ".hydra").mkdir(parents=True)
        cfg = {"seed": 1, "model": {"attention": {"name": "dense"}}}
        (tmp_path / folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="dense_s1 twice"):
        figure3.main([str(tmp_path), "--out", str(tmp_path / "out")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no training runs"):
        figure3.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")])


def test_a_run_stopped_before_its_end_shows_how_far_it_trained(tmp_path):
    """A run without metrics.json (stopped, e.g. by a time limit) is listed with the steps and the last
    validation perplexity of its CSV log, marked stopped; it adds nothing to the tables of evaluations."""
    import yaml

    run = tmp_path / "long" / "dense"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "model": {"attention": {"name": "dense"}}}))
    (run / "csv").mkdir()
    (run / "csv" / "metrics.csv").write_text("step,train/loss,val/ppl\n24,4.0,\n499,,76.5\n8999,,41.9\n9049,2.2,\n")
    report = figure3.main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert report["rows"] == []
    assert "| dense_s0 | 9050 (stopped) | 41.9 | - | - |" in (tmp_path / "out" / "figure3.md").read_text()


def test_a_run_evaluates_its_best_checkpoint_end_to_end(tmp_path):
    """nats-train with an eval_after entry checkpoint=best: the entry's nats-eval reads the best-by-validation
    checkpoint (ModelCheckpoint's best-step*.ckpt), the other entries the final one."""
    sweep = tmp_path / "runs"
    best_entry = "++callbacks.eval_after.evals.test_best={split:test,methods:[full],checkpoint:best}"
    nats_train_multirun(["experiment=study_fig3_dense", "seed=1", best_entry], sweep, tmp_path, {"eval_every": "1"})
    run = sweep / "0"
    best = json.loads((run / "eval_test_best" / "results.json").read_text())
    final = json.loads((run / "eval_test" / "results.json").read_text())
    assert Path(best["checkpoint"]).name.startswith("best-step") and Path(final["checkpoint"]).name == "last.ckpt"
    assert [r["policy"] for r in best["results"]] == ["full"]
    report = figure3.main([str(sweep), "--out", str(tmp_path / "rep"), "--checkpoint", "best"])
    (row,) = [r for r in report["rows"] if r["split"] == "test"]  # eval_test_best: full only; eval_test has more
    assert row["setting"] == "full" and row["ppl_mean"] == pytest.approx(best["results"][0]["ppl"])
    assert "best checkpoint by validation loss" in (tmp_path / "rep" / "figure3.md").read_text()


@pytest.mark.slow  # a GPU script's CPU smoke run: make test-all
def test_long_training_script_on_cpu(tmp_path):
    """experiments/gpu_long_training.sh end to end at a tiny scale (STEPS=2, the tiny model, on the CPU): both
    runs train, evaluate their final and their best checkpoints, and both reports are written; an unknown MODELS
    entry stops it before anything runs."""
    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "eval_every", "hydra/launcher"))]
    env = dict(os.environ, STEPS="2", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PROJECT_ROOT"] = str(tmp_path / "project")  # nats-prepare's run folder there, not in the checkout
    script = str(REPO / "experiments" / "gpu_long_training.sh")
    out = tmp_path / "long"
    res = subprocess.run(["bash", script, str(out), *tiny, "eval_every=1"], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("dense", "nats"):
        best = json.loads((out / "runs" / name / "eval_test_best" / "results.json").read_text())
        assert Path(best["checkpoint"]).name.startswith("best-step"), name
        assert (out / "runs" / name / "eval_test" / "results.json").is_file()
    assert "best checkpoint by validation loss" in (out / "report_best" / "figure3.md").read_text()
    assert (out / "report" / "figure3_loss.png").is_file()
    along = (out / "report" / "figure3.md").read_text().split("## Validation along the training")[1]
    assert "nats_l0.05_s" in along and "| 2 |" in along  # the second validation's row, NAtS beside dense
    bad = subprocess.run(["bash", script, str(tmp_path / "bad")], env={**env, "MODELS": "dense sparse"}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "MODELS: unknown run 'sparse' (dense, nats)" in bad.stderr
    assert not (tmp_path / "bad").exists()
