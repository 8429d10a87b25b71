"""notebooks/kv_budget_analysis.ipynb: stored without outputs, and it runs (nbclient) on the output of a real
pipeline: a tiny NAtS model trained for a few steps by nats-train, then evaluated by nats-eval."""

from __future__ import annotations

import os

import nbformat
import pytest
import torch

from conftest import REPO, compose

NOTEBOOK = REPO / "notebooks" / "kv_budget_analysis.ipynb"


@pytest.mark.parametrize("path", sorted(NOTEBOOK.parent.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    """Every notebook (hf_kv_budgets.ipynb runs in tests/test_hf_analysis.py)."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells)


def test_notebook_runs_on_a_trained_and_evaluated_model(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    from nats.evaluation import run as run_eval
    from nats.train import run as run_train

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_dir = tmp_path / "train"
        run_train(
            compose(
                [
                    "model/attention=nats",
                    "model.attention.window=4",
                    "model.block_size=32",
                    "model.n_layer=2",
                    "data.micro_batch_size=2",
                    "global_batch_size=2",
                    "trainer.max_steps=3",
                    "eval_every=3",
                    "data.max_eval_windows=2",
                    "logger=none",
                    "callbacks.throughput=null",
                    "callbacks.progress_bar=null",
                    "final_validation=false",
                ],
                train_dir,
            )
        )
        ckpt = train_dir / "checkpoints" / "last.ckpt"
        eval_dir = tmp_path / "eval"
        report = run_eval(
            compose(
                [f"ckpt_path={ckpt}", "max_windows=2", "batch_size=2", "progress=false"], eval_dir, config_name="eval"
            )
        )
    finally:
        torch.set_num_threads(n)
    assert {r["method"] for r in report["results"]} == {"full", "streaming_llm", "h2o", "nats"}

    nb = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("NATS_EVAL_DIR", str(eval_dir))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert str(eval_dir) in text and "layer 1: global" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 3  # perplexity curves, KV heatmap, type fractions
    # `jupyter execute` keeps no outputs: the plots must also be on disk, in the evaluation's folder
    saved = sorted(p.name for p in eval_dir.glob("analysis_*.png"))
    assert saved == ["analysis_kv_per_head.png", "analysis_ppl_vs_kv.png", "analysis_token_types.png"]
    assert all((eval_dir / name).stat().st_size > 1000 for name in saved)


if os.environ.get("NATS_SKIP_NOTEBOOK"):  # pragma: no cover - an escape hatch for machines without a kernel
    pytestmark = pytest.mark.skip(reason="NATS_SKIP_NOTEBOOK is set")
