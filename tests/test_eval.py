"""nats-eval: perplexity vs KV budget of a checkpoint (spec sections 6-8), its outputs, and clear errors that
leave nothing written."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DATA_DIR, compose
from nats import functional as NF
from nats.evaluation import OUTPUT_FILES, run
from nats.lit import LitGPT

TINY = {"vocab_size": 50304, "n_head": 4, "n_kv_head": 2, "n_embd": 32}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def make_checkpoint(path: Path, attention: dict, block_size: int = 32, n_layer: int = 2, **model) -> Path:
    """A checkpoint as nats-train writes it (LitGPT state_dict + hyper_parameters), with random weights."""
    torch.manual_seed(0)
    lit = LitGPT(
        model={**TINY, "block_size": block_size, "n_layer": n_layer, "attention": attention, **model},
        optim={"lr": 1e-3},
    )
    if attention["name"] == "nats":  # spread the scorer so that all three token types occur
        with torch.no_grad():
            for block in lit.model.blocks:
                block.attn.core.scorer.weight.normal_(0, 1.0)
    torch.save(
        {"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams), "pytorch-lightning_version": "2.0"},
        path,
    )
    return path


def eval_cfg(ckpt, out: Path, overrides=()):
    return compose([f"ckpt_path={ckpt}", "progress=false", *overrides], out, config_name="eval")


def reference_ppl(ckpt: Path, n: int, windows: int, split: str = "test") -> tuple[float, torch.Tensor]:
    """exp(mean NLL) of the checkpoint's own parallel forward over the first `windows` windows; and the windows."""
    from nats.data.datamodule import TokenDataModule
    from nats.hub import load_checkpoint

    model = load_checkpoint(ckpt)
    model.eval()
    dm = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=n, max_eval_windows=windows)
    ds = dm.eval_dataset(split)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.stack([ds[i][1] for i in range(len(ds))])
    with torch.no_grad():
        logits = model(x).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    return math.exp(float(nll)), x


def test_eval_nats_checkpoint_all_methods(tmp_path):
    ckpt = make_checkpoint(tmp_path / "nats.ckpt", {"name": "nats", "window": 4})
    out = tmp_path / "out"
    report = run(
        eval_cfg(
            ckpt,
            out,
            ["max_windows=3", "batch_size=2", "budgets=[0.5,8]", "methods=[full,streaming_llm,h2o,h2o_dense,nats]"],
        )
    )
    assert {p.name for p in out.iterdir()} == set(OUTPUT_FILES)  # no temporary leftovers
    rows = {(r["method"], r["budget"]): r for r in report["results"]}
    assert set(rows) == {("full", None), ("nats", None)} | {
        (m, b) for m in ("streaming_llm", "h2o", "h2o_dense") for b in (16, 8)
    }
    # spec section 8: windows of N + 1 tokens, ppl = exp(mean NLL); nats and full equal the model's own forward
    ppl, x = reference_ppl(ckpt, 32, 3)
    assert rows[("nats", None)]["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert rows[("full", None)]["area"] == 1.0 and rows[("full", None)]["peak"] == 1.0
    for m in ("streaming_llm", "h2o", "h2o_dense"):
        for b in (16, 8):
            area, peak = NF.budget_fractions(b, 32)
            assert rows[(m, b)]["area"] == pytest.approx(area) and rows[(m, b)]["peak"] == pytest.approx(peak)
    assert rows[("h2o", 16)]["sequential"] and not rows[("streaming_llm", 16)]["sequential"]
    assert rows[("h2o", 16)]["decode"] == "eager" and rows[("streaming_llm", 16)]["decode"] == "parallel"  # CPU
    # nats: measured fractions = mean over layers, heads and windows of kv_cache_sizes of its types
    from nats.attention.nats import collect_types
    from nats.hub import load_checkpoint

    model = load_checkpoint(ckpt)
    types = collect_types(model, x)
    sizes = torch.stack([NF.kv_cache_sizes(t, 4).double() for t in types.values()])  # [L, B, H, N]
    assert rows[("nats", None)]["area"] == pytest.approx(float((sizes.sum(-1) / (32 * 33 / 2)).mean()))
    assert rows[("nats", None)]["peak"] == pytest.approx(float((sizes.amax(-1) / 32).mean()))
    # files
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(report["results"]) and float(table[0]["ppl"]) > 1
    saved = json.loads((out / "results.json").read_text())
    assert saved["N"] == 32 and saved["windows"] == 3 and len(saved["results"]) == 8
    md = (out / "results.md").read_text()
    assert "| nats |" in md and "dense-softmax approx." in md and "h2o (sequential)" in md
    kv = json.loads((out / "kv_fractions.json").read_text())
    nats_kv = kv["methods"]["nats"]
    assert torch.tensor(nats_kv["area"]).shape == (2, 2)
    tf = torch.tensor(nats_kv["type_fractions"])
    assert tf.shape == (2, 2, 3) and torch.allclose(tf.sum(-1), torch.ones(2, 2), atol=1e-6)
    assert (out / "ppl_vs_area.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_sequential_paths_equal_parallel(tmp_path):
    ckpt = make_checkpoint(tmp_path / "nats.ckpt", {"name": "nats", "window": 4}, block_size=24)
    common = ["max_windows=2", "batch_size=2", "budgets=[10]", "methods=[full,streaming_llm,h2o,nats]"]
    par = run(eval_cfg(ckpt, tmp_path / "par", common + ["policies.h2o.sequential=false"]))
    seq = run(
        eval_cfg(
            ckpt,
            tmp_path / "seq",
            common
            + [
                "policies.full.sequential=true",
                "policies.streaming_llm.sequential=true",
                "policies.nats.sequential=true",
            ],
        )
    )
    for a, b in zip(par["results"], seq["results"]):
        assert a["method"] == b["method"] and a["sequential"] != b["sequential"]
        assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)
        assert a["area"] == pytest.approx(b["area"]) and a["peak"] == pytest.approx(b["peak"])


def test_eval_dense_checkpoint_skips_nats_with_a_note(tmp_path, caplog):
    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"}, block_size=64)
    with caplog.at_level("INFO", logger="nats.evaluation"):
        report = run(eval_cfg(ckpt, tmp_path / "out", ["max_windows=1", "methods=[full,streaming_llm,nats]"]))
    # with the bar off (progress=false, as in callbacks.eval_after) a line per evaluated method and budget
    done = [m for m in caplog.messages if m.startswith("nats-eval test ")]
    assert len(done) == 4 and done[0].startswith("nats-eval test 1/4: full") and "4/4: streaming_llm" in done[3]
    # B = 32, 16, 8; N/16 = 4 and N/32 = 2 tokens leave no room besides the 4 sinks: skipped with a note
    assert [r["method"] for r in report["results"]] == ["full"] + ["streaming_llm"] * 3
    assert any("nats: skipped" in n for n in report["notes"])
    assert any("budget 0.0625 x N = 4 skipped" in n for n in report["notes"])
    ppl, _ = reference_ppl(ckpt, 64, 1)
    assert report["results"][0]["ppl"] == pytest.approx(ppl, rel=1e-5)


def test_cli_with_defaults(tmp_path):
    """`nats-eval ckpt_path=...` (the console script, default config) on a small NAtS checkpoint."""
    ckpt = make_checkpoint(tmp_path / "nats.ckpt", {"name": "nats", "window": 8}, block_size=64, n_layer=1)
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("nats-eval")
    cmd = [
        str(exe) if exe.exists() else sys.executable,
        *([] if exe.exists() else ["-m", "nats.eval"]),
        f"ckpt_path={ckpt}",
        "max_windows=1",
        f"hydra.run.dir={out}",
        f"paths.data_dir={DATA_DIR}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| nats |" in proc.stdout and "| h2o (sequential) | 32 |" in proc.stdout
    assert all((out / name).is_file() for name in OUTPUT_FILES)
    assert "| h2o (sequential) | 32 |" in (out / "eval.log").read_text()  # the run's log, not an empty file


# ----------------------------------------------------------------------------------------------------
# bad input: clear errors, nothing written
# ----------------------------------------------------------------------------------------------------
def assert_nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_missing_checkpoint(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no checkpoint given.*ckpt_path="):
        run(compose(["progress=false"], out, config_name="eval"))
    with pytest.raises(FileNotFoundError, match="does not exist.*last.ckpt"):
        run(eval_cfg(tmp_path / "nope.ckpt", out))
    assert_nothing_written(out)


def test_not_a_nats_checkpoint(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "text.ckpt").write_text("hello")
    with pytest.raises(ValueError, match="not a readable nats-train checkpoint"):
        run(eval_cfg(tmp_path / "text.ckpt", out))
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="is not a nats-train checkpoint.*hyper_parameters"):
        run(eval_cfg(tmp_path / "other.ckpt", out))
    assert_nothing_written(out)


def test_checkpoint_of_another_architecture(tmp_path):
    out = tmp_path / "out"
    ckpt = make_checkpoint(tmp_path / "anna.ckpt", {"name": "anna"}, block_size=16, n_layer=1)
    with pytest.raises(ValueError, match="another architecture.*'anna'"):
        run(eval_cfg(ckpt, out))
    lit = torch.load(make_checkpoint(tmp_path / "d.ckpt", {"name": "dense"}), weights_only=True)
    lit["state_dict"] = {k: v for k, v in lit["state_dict"].items() if "mlp" not in k}
    torch.save(lit, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="weights do not match"):
        run(eval_cfg(tmp_path / "broken.ckpt", out))
    assert_nothing_written(out)


def test_bad_budgets(tmp_path):
    out = tmp_path / "out"
    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"})
    with pytest.raises(ValueError, match=r"budget B=32 >= N=32"):
        run(eval_cfg(ckpt, out, ["budgets=[32]"]))
    with pytest.raises(ValueError, match="too small for 4 attention sinks"):
        run(eval_cfg(ckpt, out, ["budgets=[4]", "methods=[streaming_llm]"]))
    with pytest.raises(ValueError, match="must be a whole number of tokens >= 1 .* or a fraction in"):
        run(eval_cfg(ckpt, out, ["budgets=[1.5]"]))
    with pytest.raises(ValueError, match="not one of the configured policies"):
        run(eval_cfg(ckpt, out, ["methods=[bogus]"]))
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        run(eval_cfg(ckpt, out, ["block_size=64"]))
    with pytest.raises(ValueError, match="graph='sometimes' must be auto, true or false"):
        run(eval_cfg(ckpt, out, ["graph=sometimes"]))
    assert_nothing_written(out)


def test_empty_test_split(tmp_path):
    books = tmp_path / "books"
    for split, text in (
        ("train", "the quick brown fox " * 200),
        ("validation", "the lazy dog " * 100),
        ("test", "end"),
    ):
        (books / split).mkdir(parents=True)
        (books / split / "a.txt").write_text(text)
    out = tmp_path / "out"
    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"})
    with pytest.raises(ValueError, match="test split has no window of N \\+ 1 = 33 tokens"):
        run(
            eval_cfg(
                ckpt,
                out,
                ["data=text_dir", f"data.path={books}", f"paths.data_dir={tmp_path / 'data'}", "data.num_workers=0"],
            )
        )
    assert_nothing_written(out)


def test_max_windows_are_spread_evenly_over_the_split():
    """max_windows=m takes m windows spread over the whole split (deterministic), not the first m (the first
    book): window i is window floor(i * n / m) of the split's n."""
    from nats.data.datamodule import TokenDataModule

    dm = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32)
    every = dm.eval_dataset("test")
    n = len(every)
    capped = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32, max_eval_windows=5)
    ds = capped.eval_dataset("test")
    assert len(ds) == 5 and [ds.window_index(i) for i in range(5)] == [i * n // 5 for i in range(5)]
    assert ds.window_index(4) > n * 3 // 4  # the last part of the split (its last book) is sampled
    for i in range(5):
        assert torch.equal(ds[i][0], every[ds.window_index(i)][0])
    assert torch.equal(torch.from_numpy(ds.targets().astype("int64")), torch.cat([ds[i][1] for i in range(5)]))
    again = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32, max_eval_windows=5)
    assert [again.eval_dataset("test").window_index(i) for i in range(5)] == [ds.window_index(i) for i in range(5)]


def test_windows_first_takes_the_first_windows_of_the_split(tmp_path):
    """windows=first (data.eval_windows) takes the split's first max_windows windows, the protocol of the studies'
    tables: nats-eval's perplexity is then that of windows 0 .. m-1, and differs from the spread choice's; an unknown
    choice is one line naming the two."""
    from nats.data.datamodule import TokenDataModule

    first = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32, max_eval_windows=5,
                            eval_windows="first").eval_dataset("test")  # fmt: skip
    every = TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32).eval_dataset("test")
    assert [first.window_index(i) for i in range(5)] == list(range(5))
    assert torch.equal(torch.cat([first[i][1] for i in range(5)]), torch.cat([every[i][1] for i in range(5)]))
    with pytest.raises(ValueError, match="eval_windows='last' is not a window choice: use spread .* or first"):
        TokenDataModule(source="gutenberg", cache_dir=str(DATA_DIR), block_size=32, eval_windows="last")

    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"})
    common = ["max_windows=3", "batch_size=3", "methods=[full]"]
    spread = run(eval_cfg(ckpt, tmp_path / "spread", common))["results"][0]["ppl"]
    head = run(eval_cfg(ckpt, tmp_path / "first", [*common, "windows=first"]))["results"][0]["ppl"]
    assert head != pytest.approx(spread, rel=1e-6)
    with pytest.raises(ValueError, match="windows='middle' is not a window choice"):
        run(eval_cfg(ckpt, tmp_path / "bad", [*common, "windows=middle"]))


def test_the_studies_evaluate_the_first_windows():
    """The Figure 3 and gate studies evaluate (and validate during training) on the first windows of each split,
    as their committed tables were computed: new seeds stay comparable with the old ones."""
    from hydra import compose, initialize_config_dir

    from nats.utils import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for exp in ("study_fig3_dense", "study_fig3_nats", "study_gate_gpt2_dense", "study_gate_gpt2_nats"):
            cfg = compose("train", overrides=[f"experiment={exp}"])
            assert cfg.data.eval_windows == "first" and cfg.callbacks.eval_after.common.windows == "first", exp


def test_the_loss_of_a_batch_is_computed_in_chunks(tmp_path, monkeypatch):
    """A batch whose logits would exceed LOGITS_BYTES runs as chunks of windows: the same perplexity, and the
    policy never sees more windows at once than fit."""
    import nats.evaluation as E

    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"})
    common = ["max_windows=4", "batch_size=4", "methods=[full]"]
    whole = run(eval_cfg(ckpt, tmp_path / "whole", common))
    seen = []
    real = E.policy_logits

    def spy(model, x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(model, x, *args, **kwargs)

    monkeypatch.setattr(E, "policy_logits", spy)
    monkeypatch.setattr(E, "LOGITS_BYTES", 32 * 50304 * 4 * 3)  # three windows of N = 32 at a time
    chunked = run(eval_cfg(ckpt, tmp_path / "chunked", common))
    assert seen == [3, 1]
    assert chunked["results"][0]["ppl"] == pytest.approx(whole["results"][0]["ppl"], rel=1e-6)
    assert chunked["results"][0]["windows"] == 4


def test_out_of_memory_names_the_setting_to_lower(tmp_path, monkeypatch):
    import nats.evaluation as E

    ckpt = make_checkpoint(tmp_path / "dense.ckpt", {"name": "dense"})

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB")

    monkeypatch.setattr(E, "policy_logits", oom)
    with pytest.raises(ValueError, match=r"out of memory .* lower batch_size=16 \(e\.g\. batch_size=4\)"):
        run(eval_cfg(ckpt, tmp_path / "out", ["max_windows=2", "batch_size=16", "methods=[full]"]))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_carry_over_script_compares_two_versions(tmp_path):
    """experiments/carry_over.py runs nats-eval through two versions of the code and tabulates both: given this
    checkout as the earlier version too, every number agrees; a version without the packages is refused."""
    (tmp_path / "nats" / "checkpoints").mkdir(parents=True)  # a run's layout: the table is labelled "nats"
    ckpt = make_checkpoint(tmp_path / "nats" / "checkpoints" / "last.ckpt", {"name": "nats", "window": 8},
                           block_size=64, n_layer=1)  # fmt: skip
    script = Path(__file__).resolve().parents[1] / "experiments" / "carry_over.py"
    out = tmp_path / "out"
    cmd = [sys.executable, str(script), "--base", str(script.parents[1]), "--out", str(out), "gpt", str(ckpt), "--",
           "max_windows=1", f"paths.data_dir={DATA_DIR}", "methods=[nats,full,streaming_llm]",
           "budgets=[16]"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in (out / "carry_over_gpt.md").read_text().splitlines() if line.startswith("| nats |")]
    rows += [line for line in proc.stdout.splitlines() if line.startswith(("| full |", "| streaming_llm |"))]
    assert len(rows) == 3 and all(line.rstrip().endswith("| 0 |") for line in rows), rows
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, str(script), "--base", str(tmp_path / "empty"), "--out", str(out), "gpt",
                          str(ckpt)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "has no nats/" in bad.stderr
