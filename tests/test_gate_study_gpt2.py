"""The gate study at GPT-2-small scale as it runs: its experiment configs compose to the Figure 3 recipe with the
gate, the evaluations and the analysis; the measurements of nats.analysis (what LayerAnalysis writes into
analysis.json) against hand-made examples and a direct softmax; experiments/gate_study_gpt2.py's report (a row
per model, mean ± sample std over seeds, runs of other folders as further seeds); and a tiny version of the study
through `nats-train -m` (the basic launcher) and the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_figure3 import nats_train_multirun

from conftest import REPO, compose, load_script
from nats.analysis import first_token_share, globals_at_position0, layer_probes, measure, uniform_first_token_share
from nats.functional import TOKEN_GLOBAL as G
from nats.functional import TOKEN_LOCAL as L
from nats.functional import TOKEN_SLIDING as S
from nats.models.gpt import GPT, GPTConfig

# the study reports import experiments/collect.py from beside them, as `python experiments/<script>.py` does
sys.path.insert(0, str(REPO / "experiments"))
gs = load_script("experiments/gate_study_gpt2.py")

MODELS = ["dense", "dense_headwise", "dense_elementwise", "nats", "nats_headwise"]
LABELS = {
    "dense": "dense",
    "dense_headwise": "dense + headwise gate",
    "dense_elementwise": "dense + elementwise gate",
    "nats": "NAtS λ=0.05",
    "nats_headwise": "NAtS λ=0.05 + headwise gate",
}


@pytest.mark.parametrize(
    "experiment, gate, core",
    [
        ("study_gate_gpt2_dense", "elementwise", "dense"),
        ("study_gate_gpt2_nats", "headwise", "nats"),
    ],
)
def test_study_configs_are_the_fig3_recipe_with_the_gate_and_the_analysis(tmp_path, experiment, gate, core):
    cfg = compose([f"experiment={experiment}", f"model.attention.output_gate={gate}"], tmp_path)
    fig3 = compose([f"experiment=study_fig3_{core}"], tmp_path)
    att = cfg.model.attention
    assert (att.name, att.output_gate) == (core, gate)
    assert cfg.optim == fig3.optim and cfg.trainer == fig3.trainer and cfg.data.source == "pg19"
    assert cfg.trainer.max_steps == 2000 and cfg.model.n_layer == 12 and cfg.model.block_size == 1024
    assert cfg.callbacks.layer_analysis.windows == 64 and cfg.callbacks.layer_analysis.skip == 16
    assert set(cfg.callbacks.eval_after.evals) == {"validation", "test"}
    if core == "nats":
        assert att.sparsity_lambda == 0.05 and att.window == 16 and "tau_schedule" in cfg.callbacks
    else:
        assert list(cfg.callbacks.eval_after.common.budgets) == [0.125, 0.0625]
    assert cfg.task_name == "gate_study_gpt2"


# ----------------------------------------------------------------------------------------------------
# the measurements
# ----------------------------------------------------------------------------------------------------
def test_first_token_share_by_hand():
    """Head 0 attends uniformly (P[i, 0] = 1/(i+1)); head 1 scores key 0 at log 3 and the others at 0, so
    P[i, 0] = 3/(3+i). N = 4."""
    n = 4
    scores = torch.zeros(1, 2, n, n)
    scores[0, 1, :, 0] = math.log(3.0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    p0 = p[..., 0]
    torch.testing.assert_close(p0[0, 1], torch.tensor([1.0, 3 / 4, 3 / 5, 3 / 6]))
    share = first_token_share(p0, skip=1)
    torch.testing.assert_close(share, torch.tensor([(1 / 2 + 1 / 3 + 1 / 4) / 3, (3 / 4 + 3 / 5 + 3 / 6) / 3]).double())
    torch.testing.assert_close(first_token_share(p0, skip=2)[1].item(), (3 / 5 + 3 / 6) / 2)
    assert first_token_share(p0)[0].item() == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert uniform_first_token_share(n, 1) == pytest.approx(share[0].item())
    # the batch is averaged too
    two = torch.stack([p0[0], torch.ones_like(p0[0])])
    torch.testing.assert_close(first_token_share(two, 1), (share + 1) / 2)
    with pytest.raises(ValueError, match="skip"):
        first_token_share(p0, skip=4)


def test_globals_at_position0_by_hand():
    types = torch.tensor(
        [
            [[G, S, G, L, G], [G, S, S, S, S]],
            [[G, L, L, S, S], [G, G, G, G, L]],
        ]
    )  # [B = 2, H = 2, N = 5]
    at0, total = globals_at_position0(types)
    torch.testing.assert_close(at0, torch.tensor([2.0, 2.0]).double())
    torch.testing.assert_close(total, torch.tensor([4.0, 5.0]).double())  # head 0: 3 + 1, head 1: 1 + 4
    share = at0 / total
    assert share.tolist() == pytest.approx([0.5, 0.4])
    # a head whose only global is token 0 has share 1; one without token 0 global has share 0
    at0, total = globals_at_position0(torch.tensor([[[G, S, L], [S, G, G]]]))
    assert (at0 / total).tolist() == [1.0, 0.0]


def _tiny(attention: dict, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, attention=attention)
    return GPT(cfg).eval()


def test_layer_probes_match_a_direct_softmax_and_the_gate():
    model = _tiny({"name": "dense", "output_gate": "elementwise"})
    idx = torch.randint(0, 64, (3, 32))
    records = layer_probes(model, idx)
    pos = torch.arange(32)
    x = model.embed(idx, pos)
    for block, rec in zip(model.blocks, records):
        h = block.ln_1(x)
        q, k, _ = block.attn.project(h, model.rope, pos)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        p = scores.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        torch.testing.assert_close(rec["p0"], p[..., 0])
        gate = torch.sigmoid(block.attn.gate(h)).view(3, 32, 2, 8).mean(-1)  # per head: the mean of its channels
        torch.testing.assert_close(rec["gate"], gate)
        assert "types" not in rec
        x, _ = block(x, model.rope, pos)
    nats = _tiny({"name": "nats", "window": 4, "output_gate": "headwise"})
    records = layer_probes(nats, idx)
    assert records[0]["gate"].shape == (3, 32, 2) and records[0]["types"].shape == (3, 2, 32)
    assert (records[0]["types"][..., 0] == G).all()
    assert torch.allclose(records[1]["p0"][..., 0], torch.ones(3, 2))  # query 0 sees only key 0


def test_measure_on_a_tiny_nats_model_with_a_gate():
    model = _tiny({"name": "nats", "window": 4, "output_gate": "headwise"}, seed=1)
    batches = [(torch.randint(0, 64, (3, 32)), None), (torch.randint(0, 64, (2, 32)), None)]
    m = measure(model, batches, skip=4)
    assert (m["windows"], m["N"], m["skip"]) == (5, 32, 4)
    assert m["uniform_share"] == pytest.approx(uniform_first_token_share(32, 4))
    for layer in m["layers"]:
        assert 0 <= layer["first_token_share"] <= 1 and all(0 <= v <= 1 for v in layer["first_token_share_heads"])
        assert 0 < layer["gate_mean"] < 1
        assert 0 <= layer["global_pos0_share"] <= 1 and 0 < layer["area"] <= 1 and 0 < layer["peak"] <= 1
        assert sum(layer["type_fractions"]) == pytest.approx(1.0)
        # token 0 is global in every head and window, so the share is 1 / (globals per head and window)
        assert layer["global_pos0_share"] == pytest.approx(1 / layer["globals_per_head"])
        assert layer["globals_pos0"] == 5 * 2
    # batches are weighted by their size: the same windows in one batch give the same numbers
    one = measure(model, [(torch.cat([b[0] for b in batches]), None)], skip=4)
    for a, b in zip(m["layers"], one["layers"]):
        assert a["first_token_share"] == pytest.approx(b["first_token_share"])
        assert a["area"] == pytest.approx(b["area"]) and a["gate_mean"] == pytest.approx(b["gate_mean"])


# ----------------------------------------------------------------------------------------------------
# the report, and the study end to end
# ----------------------------------------------------------------------------------------------------
def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _fake_run(root: Path, model: str, seed: int, ppl: float, sink: float, folder_name: str | None = None) -> Path:
    """The files a finished run leaves behind (its config as nats-train writes it), with made-up numbers (2
    layers)."""
    folder = root / (folder_name or f"{model}_s{seed}")
    nats = model.startswith("nats")
    gate = model.split("_")[1] if "_" in model else "none"
    attention = {"name": "nats", "sparsity_lambda": 0.05, "window": 16} if nats else {"name": "dense"}
    cfg = {
        "seed": seed,
        "global_batch_size": 32,
        "data": {"source": "pg19"},
        "trainer": {"max_steps": 2000},
        "model": {
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 64,
            "block_size": 1024,
            "attention": {**attention, "output_gate": gate},
        },
    }
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    _write(folder / "metrics.json", {"global_step": 2000})
    own = {"policy": "nats" if nats else "full", "budget": None, "budget_fraction": None, "ppl": ppl}
    own.update(area=0.08 if nats else 1.0, peak=0.07 if nats else 1.0)
    _write(folder / "eval_validation" / "results.json", {"N": 1024, "results": [{**own, "ppl": ppl + 1}]})
    test = [own]
    if not nats:
        for policy in ("streaming_llm", "h2o"):
            for frac, extra in ((0.125, 2.0), (0.0625, 5.0)):
                b = {"policy": policy, "budget": int(1024 * frac), "budget_fraction": frac}
                test.append({**b, "ppl": ppl + extra, "area": 2 * frac - frac * frac, "peak": frac})
    _write(folder / "eval_test" / "results.json", {"N": 1024, "results": test})
    layer = {"first_token_share": sink, "first_token_share_heads": [sink, sink]}
    if "headwise" in model or "elementwise" in model:
        layer.update(gate_mean=0.3, gate_heads=[0.3, 0.3])
    if nats:
        layer.update(
            area=0.1,
            peak=0.08,
            type_fractions=[0.02, 0.03, 0.95],
            global_pos0_share=0.25,
            globals_total=8.0,
            globals_pos0=2.0,
            globals_per_head=4.0,
        )
    _write(folder / "analysis.json", {"uniform_share": 0.0045, "skip": 16, "device": "cuda", "layers": [layer, layer]})
    return folder


def test_report_has_a_row_per_model_with_mean_and_std_over_seeds(tmp_path):
    root = tmp_path / "runs"
    for i, model in enumerate(MODELS):
        _fake_run(root, model, 0, ppl=40.0 + i, sink=0.30)
        if model in ("dense", "nats"):  # a second seed for two of them
            _fake_run(root, model, 1, ppl=42.0 + i, sink=0.40)
    (root / "not_a_run").mkdir()
    rows = gs.main([str(root), "--out", str(tmp_path / "rep"), "--device", "one test GPU"])
    text = (tmp_path / "rep" / "gate_study_gpt2.md").read_text()
    assert [r["model"] for r in rows] == MODELS
    assert rows == json.loads((tmp_path / "rep" / "gate_study_gpt2.json").read_text())["rows"]
    rows = {r["model"]: r for r in rows}
    for model in MODELS:  # the main table: label, then the seeds
        assert text.count(f"| {LABELS[model]} | {'0, 1' if model in ('dense', 'nats') else '0'} |") == 1, model
    dense = rows["dense"]["stats"]
    assert dense["test_ppl"]["mean"] == pytest.approx(41.0) and dense["test_ppl"]["std"] == pytest.approx(math.sqrt(2))
    assert "| dense | 0, 1 | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3500 ± 0.0707 |" in text
    assert dense["sink_layers"]["mean"] == pytest.approx([0.35, 0.35])
    assert dense["h2o N/16 rel"]["mean"] == pytest.approx((5 / 40 + 5 / 42) / 2)
    nats = rows["nats_headwise"]["stats"]
    assert nats["pos0_share"]["mean"] == 0.25 and nats["gate"]["mean"] == 0.3 and "h2o N/8" not in nats
    assert "dense + headwise gate" in text and "## Mean gate per layer" in text and "globals at position 0" in text
    assert "Setting: 2 layers x 2 heads, d = 64, N = 1024, data pg19, 2000 steps of 32 x 1024 tokens" in text
    for name in ("sink", "kv", "ppl_vs_area"):
        assert (tmp_path / "rep" / f"gate_study_gpt2_{name}.png").stat().st_size > 10_000


def test_report_takes_runs_of_other_folders_as_further_seeds(tmp_path):
    """A run of the same recipe elsewhere (e.g. the Figure 3 study's dense model, without an analysis) is one more
    seed of its model; the measurements it lacks come from the other seeds only. The same model and seed twice
    is refused."""
    root, other = tmp_path / "runs", tmp_path / "figure3"
    _fake_run(root, "dense", 0, ppl=40.0, sink=0.30)
    extra = _fake_run(other, "dense", 7, ppl=42.0, sink=0.99, folder_name="3")  # a multirun's job folder
    (extra / "analysis.json").unlink()
    out = tmp_path / "rep"
    gs.main([str(root), str(extra), "--out", str(out)])
    assert "| dense | 0, 7 | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3000 |" in (out / "gate_study_gpt2.md").read_text()
    # a run stopped during its test evaluation: not counted as a seed of the perplexities, and said so
    stopped = _fake_run(other, "dense", 8, ppl=99.0, sink=0.30, folder_name="5")
    (stopped / "eval_test" / "results.json").unlink()
    (stopped / "eval_validation" / "results.json").unlink()
    gs.main([str(root), str(extra), str(stopped), "--out", str(out)])
    text = (out / "gate_study_gpt2.md").read_text()
    row = "| dense | 0, 7 (8: trained, not evaluated) | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3000 ± 0.0000 |"
    assert row in text
    _fake_run(other, "dense", 0, ppl=42.0, sink=0.99, folder_name="4")
    with pytest.raises(SystemExit, match="dense_s0 twice"):
        gs.main([str(root), str(other), "--out", str(out)])


def test_report_pools_the_runs_of_an_earlier_report_with_new_folders(tmp_path):
    """--runs-from: the runs of an earlier report's JSON (folders no longer at hand) join new run folders; a new
    folder's run replaces the report's run of the same model and seed (e.g. a seed evaluated later)."""
    root = tmp_path / "runs"
    _fake_run(root, "dense", 0, ppl=40.0, sink=0.30)
    stopped = _fake_run(root, "dense", 1, ppl=99.0, sink=0.30)
    (stopped / "eval_test" / "results.json").unlink()
    (stopped / "eval_validation" / "results.json").unlink()
    gs.main([str(root), "--out", str(tmp_path / "first")])
    assert "| dense | 0 (1: trained, not evaluated) |" in (tmp_path / "first" / "gate_study_gpt2.md").read_text()
    later = _fake_run(tmp_path / "later", "dense", 1, ppl=42.0, sink=0.40)
    report = str(tmp_path / "first" / "gate_study_gpt2.json")
    gs.main([str(later), "--runs-from", report, "--out", str(tmp_path / "pooled")])
    text = (tmp_path / "pooled" / "gate_study_gpt2.md").read_text()
    assert "| dense | 0, 1 | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3500 ± 0.0707 |" in text
    assert gs.main(["--runs-from", report, "--out", str(tmp_path / "again")]) == gs.main(
        [str(root), "--out", str(tmp_path / "first")]
    )


@pytest.mark.slow
def test_tiny_study_multirun_then_report(tmp_path):
    """nats-train -m over the two study experiments with the headwise gate: each run leaves its evaluations and
    its analysis.json; the report has the two models with their gate per layer (~20 s on 2 idle cores, twice
    that on shared ones)."""
    sweep = tmp_path / "gate_study_gpt2"
    overrides = [
        "experiment=study_gate_gpt2_dense,study_gate_gpt2_nats",
        "model.attention.output_gate=headwise",
        "seed=0",
        "++callbacks.layer_analysis.windows=2",
        "++callbacks.layer_analysis.skip=4",
    ]
    # N = 128: StreamingLLM's 4 sinks leave recent tokens at the study's budgets N/8 and N/16
    tiny = {"model.block_size": "128", "++callbacks.eval_after.common.budgets": "[0.125,0.0625]"}
    nats_train_multirun(overrides, sweep, tmp_path, tiny)
    for run in ("0", "1"):
        analysis = json.loads((sweep / run / "analysis.json").read_text())
        assert analysis["windows"] == 2 and analysis["step"] == 2 and len(analysis["layers"]) == 2
        assert all(0 < layer["gate_mean"] < 1 for layer in analysis["layers"])
    rows = {r["model"]: r for r in gs.main([str(sweep), "--out", str(tmp_path / "report")])}
    assert list(rows) == ["dense_headwise", "nats_headwise"]
    dense, nats = rows["dense_headwise"]["stats"], rows["nats_headwise"]["stats"]
    assert dense["test_ppl"]["mean"] > 1 and {"streaming_llm N/8", "h2o N/8"} <= set(dense)
    assert 0 < nats["area"]["mean"] <= 1 and 0 <= nats["pos0_share"]["mean"] <= 1
    assert len(nats["gate_layers"]["mean"]) == 2
    text = (tmp_path / "report" / "gate_study_gpt2.md").read_text()
    assert "| NAtS λ=0.05 + headwise gate | 0 |" in text and "evaluated on cpu" in text


def test_the_analysis_measures_before_lightning_moves_the_model_off_its_device(tmp_path, monkeypatch):
    """Lightning's teardown (which moves the model to the CPU) runs before on_fit_end: the analysis measures at
    on_train_end, while the trained model is still on the device it trained on."""
    import lightning.pytorch.strategies.single_device as single

    import nats.analysis as A
    from conftest import compose
    from nats.train import run

    events = []
    real_teardown, real_measure = single.SingleDeviceStrategy.teardown, A.measure
    monkeypatch.setattr(single.SingleDeviceStrategy, "teardown", lambda self: events.append("teardown") or
                        real_teardown(self))  # fmt: skip
    monkeypatch.setattr(A, "measure", lambda *a, **k: events.append("measure") or real_measure(*a, **k))
    overrides = [
        "model.block_size=32", "data.micro_batch_size=2", "global_batch_size=2", "trainer.max_steps=2",
        "eval_every=2", "data.max_eval_windows=2", "logger=csv", "callbacks=[default,layer_analysis]",
        "callbacks.layer_analysis.windows=2", "callbacks.layer_analysis.skip=2",
    ]  # fmt: skip
    run(compose(overrides, tmp_path))
    assert events.index("measure") < events.index("teardown")
    assert json.loads((tmp_path / "analysis.json").read_text())["windows"] == 2
