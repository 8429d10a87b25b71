"""experiments/gate_study_gpt2.py: the models compose to the intended configs, the evaluation jobs,
the measurements against hand-made examples (first-token share, globals at position 0) and a direct softmax,
the report (a row per model, mean ± sample std over seeds), resuming skips finished work, and (slow) the whole
study end to end with --smoke on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import DATA_DIR, REPO, compose

spec = importlib.util.spec_from_file_location("gate_study_gpt2", REPO / "experiments" / "gate_study_gpt2.py")
gs = importlib.util.module_from_spec(spec)
sys.modules["gate_study_gpt2"] = gs
spec.loader.exec_module(gs)

from nats.functional import TOKEN_GLOBAL as G  # noqa: E402
from nats.functional import TOKEN_LOCAL as L  # noqa: E402
from nats.functional import TOKEN_SLIDING as S  # noqa: E402
from nats.models.gpt import GPT, GPTConfig  # noqa: E402

MODELS = ["dense", "dense_headwise", "dense_elementwise", "nats", "nats_headwise"]


def test_run_names():
    assert list(gs.RUNS) == MODELS
    assert gs.expand(["dense", "nats_headwise"], [0, 1]) == [
        "dense_s0",
        "dense_s1",
        "nats_headwise_s0",
        "nats_headwise_s1",
    ]
    assert gs.expand(["dense_elementwise_s3"], [0]) == ["dense_elementwise_s3"]
    assert gs.parse_run("nats_headwise_s1") == ("nats_headwise", 1)
    for bad in (["nats_l0.05"], ["dense_sx"], ["gated"]):
        with pytest.raises(SystemExit, match="unknown run"):
            gs.expand(bad, [0])


@pytest.mark.parametrize(
    "model, core, gate",
    [
        ("dense", "dense", "none"),
        ("dense_headwise", "dense", "headwise"),
        ("dense_elementwise", "dense", "elementwise"),
        ("nats", "nats", "none"),
        ("nats_headwise", "nats", "headwise"),
    ],
)
def test_train_command_composes_the_fig3_recipe_with_the_gate(tmp_path, model, core, gate):
    """What `train` launches (minus Hydra's run dir) is fig3_dense / fig3_nats (GPT-2-small, N = 1024, the PG-19
    subset, 2000 steps of 32 x 1024), with the run's gate and seed, lambda 0.05 and W = 16 for NAtS."""
    cmd = gs.train_cmd(f"{model}_s1", tmp_path, ["data.path=/nowhere"], steps=None)
    cfg = compose([a for a in cmd[3:] if not a.startswith("hydra.")], tmp_path)
    att = cfg.model.attention
    assert (att.name, att.get("output_gate", "none"), cfg.seed) == (core, gate, 1)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    assert cfg.trainer.max_steps == 2000 and cfg.global_batch_size == cfg.data.micro_batch_size == 32
    assert cfg.data.source == "pg19" and cfg.data.cache_name == "pg19-subset" and cfg.ckpt_path == "auto"
    if core == "nats":
        assert (att.sparsity_lambda, att.window, att.mask_grad) == (0.05, 16, "dense")


def test_smoke_composes_a_tiny_model_that_keeps_the_gate_and_nats(tmp_path):
    args = gs.argparse.Namespace(smoke=True, extra=[], cmd="train", root=None, max_train=None, max_windows=None)
    gs.resolve_defaults(args)
    assert args.max_train == 2 and args.max_windows == 4 and args.root == str(gs.SMOKE_ROOT)
    cmd = gs.train_cmd("nats_headwise_s0", tmp_path, args.extra, None)
    cfg = compose([a for a in cmd[3:] if not a.startswith("hydra.")], tmp_path)
    assert (cfg.model.attention.name, cfg.model.attention.output_gate, cfg.model.n_layer) == ("nats", "headwise", 4)
    assert cfg.trainer.max_steps == 4 and cfg.data.source == "gutenberg" and cfg.trainer.accelerator == "cpu"


def _args(**kw):
    base = dict(
        extra=[], max_windows=512, batch_size_dense=128, batch_size_nats=16, analysis_windows=64, analysis_batch_size=8
    )
    return gs.argparse.Namespace(skip=16, **{**base, **kw})


def test_eval_jobs():
    root = Path("/r")
    jobs = {j.label: j for j in gs.eval_jobs("dense_headwise_s0", root, _args())}
    test, val = (" ".join(jobs[f"dense_headwise_s0 eval {s}"].cmd) for s in ("test", "validation"))
    assert "methods=[full,streaming_llm,h2o]" in test and "budgets=[0.125,0.0625]" in test and "batch_size=128" in test
    assert "methods=[full]" in val and "split=validation" in val and "data=pg19_subset" in val
    analysis = jobs["dense_headwise_s0 analysis"]
    assert analysis.output == root / "dense_headwise_s0" / "analysis.json" and "--skip" in analysis.cmd
    assert all(j.after == root / "dense_headwise_s0" / "metrics.json" and j.kind == "eval" for j in jobs.values())
    nats = {j.label: j for j in gs.eval_jobs("nats_s1", root, _args(extra=["data=gutenberg", "model=tiny"]))}
    for split in ("validation", "test"):
        cmd = nats[f"nats_s1 eval {split}"].cmd
        assert "methods=[nats]" in cmd and "batch_size=16" in cmd and "data=gutenberg" in cmd
        assert "model=tiny" not in cmd and "data=pg19_subset" not in cmd
    # the dense models' nats-eval (full-cache logits) is heavy; the NAtS models' and the analyses are not
    assert [j.heavy for j in jobs.values()] == [True, True, False]
    assert not any(j.heavy for j in nats.values())


def test_schedule_runs_a_heavy_job_alone(tmp_path, monkeypatch):
    """A heavy job waits while a training or another heavy job runs (one H200 ran out of memory with two dense
    full-cache evaluations at once, and with one beside five trainings); light ones start beside them."""
    running: set[str] = set()
    started: list[str] = []
    monkeypatch.setattr(gs, "alive", lambda pid_file: pid_file.name.removesuffix(".pid") in running)

    def launch(cmd, folder, log_name):
        started.append(log_name)
        running.add(log_name)

    monkeypatch.setattr(gs, "launch", launch)

    def job(kind, name, heavy=False):
        return gs.Job(kind, name, tmp_path, name, [], tmp_path / f"{name}.done", None, heavy)

    jobs = [job("train", "train"), job("eval", "heavy1", True), job("eval", "heavy2", True), job("eval", "light")]
    running.add("train")  # a training from an earlier call is still running
    gs.schedule(jobs, tmp_path, budget_s=0.0, limits={"train": 5, "eval": 6})
    assert started == ["light"]  # the heavy ones wait for the training
    running.clear()
    started.clear()
    gs.schedule(jobs, tmp_path, budget_s=0.0, limits={"train": 5, "eval": 6})
    assert started == ["train", "light"]  # the training starts again (no output yet), so the heavy ones wait
    (tmp_path / "train.done").touch()
    running.clear()
    started.clear()
    gs.schedule(jobs, tmp_path, budget_s=0.0, limits={"train": 5, "eval": 6})
    assert started == ["heavy1", "light"]  # one heavy job at a time


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
    share = gs.first_token_share(p0, skip=1)
    torch.testing.assert_close(share, torch.tensor([(1 / 2 + 1 / 3 + 1 / 4) / 3, (3 / 4 + 3 / 5 + 3 / 6) / 3]).double())
    torch.testing.assert_close(gs.first_token_share(p0, skip=2)[1].item(), (3 / 5 + 3 / 6) / 2)
    assert gs.first_token_share(p0)[0].item() == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert gs.uniform_first_token_share(n, 1) == pytest.approx(share[0].item())
    # the batch is averaged too
    two = torch.stack([p0[0], torch.ones_like(p0[0])])
    torch.testing.assert_close(gs.first_token_share(two, 1), (share + 1) / 2)
    with pytest.raises(ValueError, match="skip"):
        gs.first_token_share(p0, skip=4)


def test_globals_at_position0_by_hand():
    types = torch.tensor(
        [
            [[G, S, G, L, G], [G, S, S, S, S]],
            [[G, L, L, S, S], [G, G, G, G, L]],
        ]
    )  # [B = 2, H = 2, N = 5]
    at0, total = gs.globals_at_position0(types)
    torch.testing.assert_close(at0, torch.tensor([2.0, 2.0]).double())
    torch.testing.assert_close(total, torch.tensor([4.0, 5.0]).double())  # head 0: 3 + 1, head 1: 1 + 4
    share = at0 / total
    assert share.tolist() == pytest.approx([0.5, 0.4])
    # a head whose only global is token 0 has share 1; one without token 0 global has share 0
    at0, total = gs.globals_at_position0(torch.tensor([[[G, S, L], [S, G, G]]]))
    assert (at0 / total).tolist() == [1.0, 0.0]


def _tiny(attention: dict, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, attention=attention)
    return GPT(cfg).eval()


def test_layer_probes_match_a_direct_softmax_and_the_gate():
    model = _tiny({"name": "dense", "output_gate": "elementwise"})
    idx = torch.randint(0, 64, (3, 32))
    records = gs.layer_probes(model, idx)
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
    records = gs.layer_probes(nats, idx)
    assert records[0]["gate"].shape == (3, 32, 2) and records[0]["types"].shape == (3, 2, 32)
    assert (records[0]["types"][..., 0] == G).all()
    assert torch.allclose(records[1]["p0"][..., 0], torch.ones(3, 2))  # query 0 sees only key 0


def test_measure_on_a_tiny_nats_model_with_a_gate():
    model = _tiny({"name": "nats", "window": 4, "output_gate": "headwise"}, seed=1)
    batches = [(torch.randint(0, 64, (3, 32)), None), (torch.randint(0, 64, (2, 32)), None)]
    m = gs.measure(model, batches, skip=4)
    assert (m["windows"], m["N"], m["skip"]) == (5, 32, 4)
    assert m["uniform_share"] == pytest.approx(gs.uniform_first_token_share(32, 4))
    for layer in m["layers"]:
        assert 0 <= layer["first_token_share"] <= 1 and all(0 <= v <= 1 for v in layer["first_token_share_heads"])
        assert 0 < layer["gate_mean"] < 1
        assert 0 <= layer["global_pos0_share"] <= 1 and 0 < layer["area"] <= 1 and 0 < layer["peak"] <= 1
        assert sum(layer["type_fractions"]) == pytest.approx(1.0)
        # token 0 is global in every head and window, so the share is 1 / (globals per head and window)
        assert layer["global_pos0_share"] == pytest.approx(1 / layer["globals_per_head"])
        assert layer["globals_pos0"] == 5 * 2
    # batches are weighted by their size: the same windows in one batch give the same numbers
    one = gs.measure(model, [(torch.cat([b[0] for b in batches]), None)], skip=4)
    for a, b in zip(m["layers"], one["layers"]):
        assert a["first_token_share"] == pytest.approx(b["first_token_share"])
        assert a["area"] == pytest.approx(b["area"]) and a["gate_mean"] == pytest.approx(b["gate_mean"])


# ----------------------------------------------------------------------------------------------------
# report and resume
# ----------------------------------------------------------------------------------------------------
def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _fake_run(root: Path, model: str, seed: int, ppl: float, sink: float) -> None:
    """The files a finished run leaves behind, with made-up numbers (2 layers)."""
    folder = root / f"{model}_s{seed}"
    nats = gs.RUNS[model][0] == "fig3_nats"
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


def test_report_has_a_row_per_model_with_mean_and_std_over_seeds(tmp_path):
    root = tmp_path / "runs"
    for i, model in enumerate(MODELS):
        _fake_run(root, model, 0, ppl=40.0 + i, sink=0.30)
        if model in ("dense", "nats"):  # a second seed for two of them
            _fake_run(root, model, 1, ppl=42.0 + i, sink=0.40)
    (root / "not_a_run").mkdir()
    gs.main(["report", "--root", str(root), "--out", str(tmp_path / "rep"), "--device", "one test GPU"])
    text = (tmp_path / "rep" / "gate_study_gpt2.md").read_text()
    rows = {r["model"]: r for r in json.loads((tmp_path / "rep" / "gate_study_gpt2.json").read_text())["rows"]}
    assert list(rows) == MODELS
    for model in MODELS:  # the main table: label, then the seeds
        assert text.count(f"| {gs.RUNS[model][2]} | {'0, 1' if model in ('dense', 'nats') else '0'} |") == 1, model
    dense = rows["dense"]["stats"]
    assert dense["test_ppl"]["mean"] == pytest.approx(41.0) and dense["test_ppl"]["std"] == pytest.approx(math.sqrt(2))
    assert "| dense | 0, 1 | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3500 ± 0.0707 |" in text
    assert dense["sink_layers"]["mean"] == pytest.approx([0.35, 0.35])
    assert dense["h2o N/16 rel"]["mean"] == pytest.approx((5 / 40 + 5 / 42) / 2)
    nats = rows["nats_headwise"]["stats"]
    assert nats["pos0_share"]["mean"] == 0.25 and nats["gate"]["mean"] == 0.3 and "h2o N/8" not in nats
    assert "dense + headwise gate" in text and "## Mean gate per layer" in text and "globals at position 0" in text
    for name in ("sink", "kv", "ppl_vs_area"):
        assert (tmp_path / "rep" / f"gate_study_gpt2_{name}.png").stat().st_size > 10_000


def test_report_adds_run_folders_from_elsewhere_as_seeds(tmp_path):
    """--add RUN=FOLDER: an earlier run of the same recipe (e.g. Figure 3's dense_s1, without an analysis) counts
    as one more seed of its model; the measurements it lacks come from the other seeds only."""
    root, other = tmp_path / "runs", tmp_path / "figure3"
    _fake_run(root, "dense", 0, ppl=40.0, sink=0.30)
    _fake_run(other, "dense", 0, ppl=42.0, sink=0.99)
    (other / "dense_s0" / "analysis.json").unlink()
    (other / "dense_s0").rename(other / "dense_l0_s7")  # the folder's own name does not matter
    out = tmp_path / "rep"
    gs.main(["report", "--root", str(root), "--out", str(out), "--add", f"dense_s7={other / 'dense_l0_s7'}"])
    text = (out / "gate_study_gpt2.md").read_text()
    assert "| dense | 0, 7 | 42.00 ± 1.41 | 41.00 ± 1.41 | +0.0% | 0.3000 |" in text
    assert f"dense_s7 ({other / 'dense_l0_s7'}, no analysis)" in text
    with pytest.raises(SystemExit, match="RUN=FOLDER"):
        gs.main(["report", "--root", str(root), "--out", str(out), "--add", f"dense_s7={other / 'missing'}"])
    with pytest.raises(SystemExit, match="both in"):
        gs.main(["report", "--root", str(root), "--out", str(out), "--add", f"dense_s0={other / 'dense_l0_s7'}"])


def test_train_skips_finished_runs_and_starts_the_others(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    _fake_run(root, "dense", 0, ppl=40.0, sink=0.3)
    launched = []
    monkeypatch.setattr(gs, "launch", lambda cmd, folder, log_name: launched.append((folder.name, log_name)))
    gs.main(["train", "--root", str(root), "--runs", "dense", "nats", "--no-prepare", "--eval", "--budget-s", "5"])
    # dense_s0 is trained and evaluated: nothing of it starts again; nats_s0 starts training (its evaluations
    # wait for its metrics.json)
    assert launched == [("nats_s0", "train.out")]
    out = capsys.readouterr().out
    assert "dense_s0 train: done, skipped" in out and "dense_s0 analysis: done, skipped" in out
    assert "nats_s0 train: stopped without metrics.json" in out  # the stand-in process never ran
    launched.clear()
    gs.main(["eval", "--root", str(root), "--runs", "dense", "nats", "--budget-s", "5"])
    assert launched == [] and "nats_s0: not trained yet, skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_study_end_to_end_on_cpu(tmp_path):
    """train --smoke --eval (background processes: 5 tiny models, their nats-eval runs and analyses), report,
    then train again: everything is skipped (~3-5 min on 2 shared cores)."""
    root = tmp_path / "runs"
    common = ["--smoke", "--root", str(root), "--extra", f"paths.data_dir={DATA_DIR}"]
    gs.main(["train", "--eval", "--budget-s", "900", *common])
    for model in MODELS:
        folder = root / f"{model}_s0"
        assert (folder / "metrics.json").is_file(), (folder / "train.out").read_text()[-2000:]
        for name in ("eval_validation/results.json", "eval_test/results.json", "analysis.json"):
            assert (folder / name).is_file(), [p.read_text()[-1500:] for p in folder.glob("*.out")]
    gs.main(["report", "--smoke", "--root", str(root), "--out", str(tmp_path / "rep")])
    rows = {r["model"]: r for r in json.loads((tmp_path / "rep" / "gate_study_gpt2.json").read_text())["rows"]}
    assert list(rows) == MODELS
    text = (tmp_path / "rep" / "gate_study_gpt2.md").read_text()
    for model, row in rows.items():
        s = row["stats"]
        assert f"| {gs.RUNS[model][2]} | 1 |" in text
        assert s["test_ppl"]["mean"] > 1 and s["val_ppl"]["mean"] > 1
        assert all(0 <= v <= 1 for v in s["sink_layers"]["mean"]) and len(s["sink_layers"]["mean"]) == 4
        gated = "headwise" in model or "elementwise" in model
        assert ("gate_layers" in s) == gated
        if gated:
            assert all(0 < v < 1 for v in s["gate_layers"]["mean"])
        if row["nats"]:
            assert all(0 <= v <= 1 for v in s["global_pos0_share_layers"]["mean"]) and 0 <= s["pos0_share"]["mean"] <= 1
            assert 0 < s["area"]["mean"] <= 1
        else:
            assert {"streaming_llm N/8", "streaming_llm N/16", "h2o N/8", "h2o N/16"} <= set(s)
    # resuming: a second call starts nothing
    heads = {f: f.read_text().count("\n### ") for f in root.glob("*/*.out")}
    gs.main(["train", "--eval", "--budget-s", "60", *common])
    assert {f: f.read_text().count("\n### ") for f in root.glob("*/*.out")} == heads
