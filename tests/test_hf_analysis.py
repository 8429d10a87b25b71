"""nats.finetune.analysis: a synthetic nats-eval-hf run folder, written by the runner's own
summary writer (`nats.finetune.evaluate.write_summary`) from rows with known per layer x KV head fractions, and a
synthetic fine-tuning run (csv/metrics.csv, nats_stats.json), read back into tables, arrays and figures; the errors
for folders that are not such runs; notebooks/hf_kv_budgets.ipynb executed headless on its own offline demo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

pytest.importorskip("transformers")

from nats.finetune import analysis as A  # noqa: E402
from nats.finetune import evaluate as E  # noqa: E402

TASKS = ["passkey", "niah"]
NATS_AREA = np.array([[0.5, 0.3], [0.2, 0.3], [0.2, 0.2]])  # [layer, kv_head], the mean of the two rows below
NATS_TYPES = np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [0.0, 0.5, 0.5]])  # [layer, type], the same for both heads
PYRAMID = {0.5: [0.8, 0.5, 0.2], 0.25: [0.4, 0.25, 0.1]}  # per layer, both KV heads
RUNS = [
    {"method": "full", "label": "full", "policy": "full", "budget": None},
    {"method": "nats", "label": "nats", "policy": "nats", "budget": None},
    {"method": "streaming_llm", "label": "streaming_llm", "policy": "streaming_llm", "budget": 0.5},
    {"method": "pyramidkv", "label": "pyramidkv", "policy": "pyramidkv", "budget": 0.5},
    {"method": "pyramidkv", "label": "pyramidkv", "policy": "pyramidkv", "budget": 0.25},
]
#: per run: the scores of (passkey, niah)
SCORES = {("full", None): (1.0, 0.5), ("nats", None): (1.0, 0.0), ("streaming_llm", 0.5): (0.0, 0.0)}


def per_head_of(run: dict, task_index: int) -> dict:
    ones = np.ones((3, 2))
    if run["method"] == "full":
        area = ones
    elif run["method"] == "nats":  # the two rows differ; their mean is NATS_AREA
        delta = np.array([[0.1, 0.1], [0.0, -0.1], [-0.1, 0.1]])
        area = NATS_AREA + (delta if task_index == 0 else -delta)
    elif run["method"] == "streaming_llm":
        area = 0.5 * ones
    else:
        area = np.array(PYRAMID[run["budget"]])[:, None] * ones
    out = {"area": area.tolist(), "peak": area.tolist(), "kv_fraction": (area / 2).tolist()}
    if run["method"] == "nats":
        out["type_fractions"] = np.repeat(NATS_TYPES[:, None, :], 2, axis=1).tolist()
    return out


def write_eval_run(folder: Path, runs=RUNS, scorers: Path | None = None) -> Path:
    rows = []
    for run in runs:
        for i, task in enumerate(TASKS):
            per_head = per_head_of(run, i)
            means = {k: float(np.mean(per_head[k])) for k in ("area", "peak", "kv_fraction")}
            score = SCORES.get((run["method"], run["budget"]), (0.5, 0.5))[i]
            rows.append({"method": run["method"], "budget": run["budget"], "task": task, "index": 0, "score": score})
            rows[-1].update(nll=None, per_head=per_head, **means)
    folder.mkdir(parents=True, exist_ok=True)
    E.write_summary(folder, rows, runs, TASKS, "tiny: accuracy vs KV budget")
    (folder / E.SETTINGS).write_text(json.dumps({"scorers": str(scorers) if scorers else None}))
    return folder


def write_finetune_run(folder: Path) -> Path:
    (folder / "csv").mkdir(parents=True)
    (folder / "csv" / "metrics.csv").write_text(
        "epoch,step,train/mse,train/density,val/mse,val/density\n"
        "0,0,0.9,0.5,,\n"
        "0,1,0.7,0.45,,\n"
        "0,1,,,0.6,0.4\n"
        "0,2,0.5,0.4,,\n"
    )
    stats = {
        "step": 3,
        "window": 16,
        "examples": 4,
        "mean": {"density": 0.3, "peak": 0.25},
        "per_layer": {"density": [0.4, 0.3, 0.2], "peak": [0.35, 0.25, 0.15]},
        "per_layer_head": {
            "density": [[0.5, 0.3], [0.3, 0.3], [0.1, 0.3]],
            "peak": [[0.4, 0.3], [0.2, 0.3], [0.1, 0.2]],
        },
    }
    (folder / "nats_stats.json").write_text(json.dumps(stats))
    return folder


@pytest.fixture
def runs(tmp_path):
    ft = write_finetune_run(tmp_path / "finetune")
    return A.load_eval_run(write_eval_run(tmp_path / "eval", scorers=ft / "scorers.pt")), ft


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def lines_by_label(ax) -> dict[str, np.ndarray]:
    return {line.get_label(): np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()}


# ----------------------------------------------------------------------------------------------------------------
# the eval run
# ----------------------------------------------------------------------------------------------------------------
def test_load_and_tables(runs):
    run, _ = runs
    assert run.names == ["full", "nats", "streaming_llm @ 0.5", "pyramidkv @ 0.5", "pyramidkv @ 0.25"]
    assert run.tasks == TASKS and run.nats == "nats" and run.budgets == [0.5, 0.25] and run.shape == (3, 2)
    np.testing.assert_allclose(run.methods["nats"]["area"], NATS_AREA, atol=1e-6)
    assert run.methods["nats"]["type_fractions"].shape == (3, 2, 3)
    columns, rows = A.accuracy_table(run)
    assert columns == ["method @ budget", "passkey", "niah", "mean", "KV area", "KV peak", "kv_fraction", "examples"]
    full, nats = rows[0], rows[1]
    assert full[:4] == ["full", 100.0, 50.0, 75.0] and full[4:] == [1.0, 1.0, 0.5, 2]
    assert nats[:4] == ["nats", 100.0, 0.0, 50.0] and nats[4] == pytest.approx(NATS_AREA.mean())
    text = A.format_table(run).splitlines()
    assert text[0].split()[:4] == ["method", "@", "budget", "passkey"]
    assert text[2].split() == ["full", "100.0", "50.0", "75.0", "1.000", "1.000", "0.500", "2"]
    assert text[5].split()[:3] == ["pyramidkv", "@", "0.5"] and text[5].split()[-2:] == ["0.250", "2"]


def test_per_layer_and_types(runs):
    run, _ = runs
    layers = A.per_layer(run)  # kv_fraction = area / 2 in the synthetic rows
    np.testing.assert_allclose(layers["nats"], NATS_AREA.mean(1) / 2, atol=1e-6)
    np.testing.assert_allclose(layers["pyramidkv @ 0.25"], np.array(PYRAMID[0.25]) / 2, atol=1e-6)
    np.testing.assert_allclose(A.per_layer(run, "area")["streaming_llm @ 0.5"], [0.5, 0.5, 0.5])
    np.testing.assert_allclose(A.nats_types(run), NATS_TYPES, atol=1e-6)
    text = A.format_layers(run, "area").splitlines()
    assert text[1].split()[:3] == ["layer", "nats", "streaming_llm"] and "full" not in text[1]
    assert text[2].split() == ["0", "0.400", "0.500", "0.800", "0.400"] and len(text) == 5
    with pytest.raises(ValueError, match="key must be one of area, peak, kv_fraction"):
        A.per_layer(run, "density")


def test_nats_heatmaps(runs):
    run, _ = runs
    fig = A.plot_nats_heatmaps(run)
    area_ax, types_ax = fig.axes[:2]  # (then the two colorbars)
    np.testing.assert_allclose(area_ax.images[0].get_array(), NATS_AREA, atol=1e-6)
    np.testing.assert_allclose(types_ax.images[0].get_array(), NATS_TYPES, atol=1e-6)
    assert [t.get_text() for t in types_ax.get_xticklabels()] == ["global", "local", "sliding"]
    assert "nats" in area_ax.get_title() and len(area_ax.texts) == 6 and area_ax.texts[0].get_text() == "0.50"


def test_layer_comparison(runs):
    run, _ = runs
    fig = A.plot_layer_comparison(run)
    half, quarter = fig.axes
    assert half.get_title() == "budget 0.5" and quarter.get_title() == "budget 0.25"
    got = lines_by_label(half)
    assert set(got) == {"streaming_llm", "pyramidkv", "nats (learned)", "budget"}
    np.testing.assert_allclose(got["budget"], [0.5, 0.5])
    np.testing.assert_allclose(got["pyramidkv"], np.array(PYRAMID[0.5]) / 2, atol=1e-6)  # not flat
    np.testing.assert_allclose(got["streaming_llm"], [0.25] * 3, atol=1e-6)
    np.testing.assert_allclose(got["nats (learned)"], NATS_AREA.mean(1) / 2, atol=1e-6)
    assert set(lines_by_label(quarter)) == {"pyramidkv", "nats (learned)", "budget"}
    area = lines_by_label(A.plot_layer_comparison(run, key="area").axes[1])
    np.testing.assert_allclose(area["pyramidkv"], PYRAMID[0.25], atol=1e-6)
    np.testing.assert_allclose(half.collections[0].get_offsets()[:, 1], NATS_AREA[:, 0] / 2, atol=1e-6)  # head 0


def test_a_run_without_nats(tmp_path):
    run = A.load_eval_run(write_eval_run(tmp_path, runs=[RUNS[0], RUNS[2]]))
    assert run.nats is None
    with pytest.raises(ValueError, match="no NAtS method among full, streaming_llm @ 0.5"):
        A.plot_nats_heatmaps(run)
    assert set(lines_by_label(A.plot_layer_comparison(run).axes[0])) == {"streaming_llm", "budget"}


def test_not_an_eval_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        A.load_eval_run(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a nats-eval-hf run folder: no summary.json"):
        A.load_eval_run(tmp_path)
    (tmp_path / "results.jsonl").write_text("")
    with pytest.raises(ValueError, match="no summary.json yet .* resume="):
        A.load_eval_run(tmp_path)
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="a nats-eval run: see notebooks/kv_budget_analysis.ipynb"):
        A.load_eval_run(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ValueError, match="summary.json is not JSON"):
        A.load_eval_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="has no 'tasks' and 'results'"):
        A.load_eval_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"tasks": [], "results": []}))
    with pytest.raises(ValueError, match="but no kv_fractions.json"):
        A.load_eval_run(tmp_path)
    (tmp_path / "kv_fractions.json").write_text(json.dumps({"methods": {"full": {"area": [[1.0]]}}}))
    with pytest.raises(ValueError, match="'full' lacks area/peak/kv_fraction"):
        A.load_eval_run(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# the fine-tuning run
# ----------------------------------------------------------------------------------------------------------------
def test_finetune_run(runs):
    run, folder = runs
    assert A.finetune_dir_of(run) == folder  # the folder of the scorers.pt the eval run names
    ft = A.load_finetune_run(folder)
    assert ft.curves["train/mse"] == {1: 0.9, 2: 0.7, 3: 0.5} and ft.curves["val/mse"] == {2: 0.6}
    assert "epoch" not in ft.curves and ft.stats["window"] == 16
    mse, density = A.plot_distillation(ft).axes
    np.testing.assert_allclose(lines_by_label(mse)["train/mse"], [0.9, 0.7, 0.5])
    np.testing.assert_allclose(mse.get_lines()[0].get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(lines_by_label(density)["val/density"], [0.4])
    (ax,) = A.plot_finetune_layers(ft, run).axes
    got = lines_by_label(ax)
    np.testing.assert_allclose(got["fine-tuning val: area"], [0.4, 0.3, 0.2])
    np.testing.assert_allclose(got["fine-tuning val: peak"], [0.35, 0.25, 0.15])
    np.testing.assert_allclose(got["eval nats: area"], NATS_AREA.mean(1), atol=1e-6)
    assert "step 3, W = 16" in ax.get_title()


def test_not_a_finetune_run(tmp_path, runs):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        A.load_finetune_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a NAtS fine-tuning run folder: no nats_stats.json and no csv"):
        A.load_finetune_run(tmp_path / "empty")
    run, folder = runs
    (folder / "csv" / "metrics.csv").unlink()
    ft = A.load_finetune_run(folder)  # nats_stats.json alone: the layers, no curve
    with pytest.raises(ValueError, match="no train/mse or val/mse logged"):
        A.plot_distillation(ft)
    A.plot_finetune_layers(ft)
    (folder / "nats_stats.json").unlink()
    assert A.finetune_dir_of(run) == folder  # the csv folder is still there
    write_finetune_run(tmp_path / "curves_only")
    (tmp_path / "curves_only" / "nats_stats.json").unlink()
    with pytest.raises(ValueError, match="no nats_stats.json"):
        A.plot_finetune_layers(A.load_finetune_run(tmp_path / "curves_only"))


# ----------------------------------------------------------------------------------------------------------------
# the notebook, headless, on its own demo (tests/test_notebook.py checks that it is stored without outputs)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(bool(os.environ.get("NATS_SKIP_NOTEBOOK")), reason="NATS_SKIP_NOTEBOOK is set")
def test_notebook_runs_on_its_demo(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "hf_kv_budgets.ipynb"
    nb = nbformat.read(notebook, as_version=4)
    for name in ("NATS_HF_EVAL_DIR", "NATS_HF_FINETUNE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NATS_HF_DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert str(tmp_path / "eval") in text and str(tmp_path / "finetune") in text
    assert "pyramidkv @ 0.25" in text and "layer 3" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 5  # accuracy vs KV, NAtS heatmaps, per-layer comparison, distillation, fine-tuning layers
    run = A.load_eval_run(tmp_path / "eval")
    assert run.nats == "nats" and run.shape == (4, 2) and run.budgets == [0.5, 0.25]
