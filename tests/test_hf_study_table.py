"""experiments/hf_study_table.py: several nats-eval-hf runs put together, and the KV target checked."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import hf_study_table  # noqa: E402


def row(method, budget, index, score, kv, prompt=100):
    return {
        "method": method,
        "label": method,
        "policy": method,
        "budget": budget,
        "task": "passkey",
        "index": index,
        "prompt_tokens": prompt,
        "score": score,
        "nll": None,
        "area": kv,
        "peak": kv,
        "kv_fraction": kv,
        "per_head": {"area": [[kv, kv]]},
    }


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_later_files_replace_rows_and_the_target_is_checked(tmp_path, capsys):
    first = write(
        tmp_path / "a" / "results.jsonl",
        [row("full", None, i, 1.0, 1.0) for i in range(2)]
        + [row("nats", None, i, 0.0, 0.6) for i in range(2)]
        + [row("snapkv", 0.25, i, s, 0.25) for i, s in enumerate((1.0, 0.0))],
    )
    second = write(tmp_path / "b" / "results.jsonl", [row("nats", None, i, 1.0, 0.2) for i in range(2)])
    assert hf_study_table.main([str(first), str(second), "--out", str(tmp_path / "out"), "--name", "t"]) == 0
    text = (tmp_path / "out" / "t.md").read_text()
    # NAtS from the second file (score 100 at KV 0.2): holds; SnapKV @ 0.25 loses 50 points
    nats_line = next(line for line in text.splitlines() if line.startswith("| nats | 100.0 | +0.0 |"))
    assert nats_line == "| nats | 100.0 | +0.0 | +0.0 .. +0.0 | 0.200 | 0.200 | 0.200 | yes |"
    # paired differences 0 and -100 points: the bootstrap interval spans them
    assert "| snapkv @ 0.25 | 50.0 | -50.0 | -100.0 .. +0.0 |" in text and "yes (loses >= the margin)" in text
    assert (tmp_path / "out" / "t.png").stat().st_size > 0
    fr = json.loads((tmp_path / "out" / "t_kv_fractions.json").read_text())
    assert fr["methods"]["nats"]["area"] == [[pytest.approx(0.2), pytest.approx(0.2)]]
    # the first file alone: NAtS misses on both counts
    hf_study_table.main([str(first), "--out", str(tmp_path / "out1"), "--name", "t"])
    assert "no: KV kept 0.600 > 0.25, 100.0 points lost" in (tmp_path / "out1" / "t.md").read_text()


def test_several_nats_scorers_as_methods(tmp_path):
    """--nats LABEL=FILE: each file's NAtS rows become the method LABEL, checked against the target on its own;
    the positional files' NAtS rows are left out, their other rows kept."""
    base = write(
        tmp_path / "a" / "results.jsonl",
        [row("full", None, i, 1.0, 1.0) for i in range(2)]
        + [row("nats", None, i, 0.0, 0.6) for i in range(2)]
        + [row("snapkv", 0.25, i, 0.0, 0.25) for i in range(2)],
    )
    (tmp_path / "a" / "summary.json").write_text(json.dumps({"header": "m: 2 examples, NAtS scorers x.pt (W = 4)"}))
    dense_ = write(tmp_path / "b" / "results.jsonl", [row("nats", None, i, 1.0, 0.4) for i in range(2)])
    sparse = write(tmp_path / "c" / "results.jsonl", [row("nats", None, i, 1.0, 0.2) for i in range(2)])
    out = tmp_path / "out"
    args = [str(base), "--out", str(out), "--name", "t", "--nats", f"lam=0.3={dense_}", "--nats", f"lam 0.6={sparse}"]
    assert hf_study_table.main(args) == 0
    text = (out / "t.md").read_text()
    assert "| lam=0.3 | 100.0 | +0.0 | +0.0 .. +0.0 | 0.400 | 0.400 | 0.400 | no: KV kept 0.400 > 0.25 |" in text
    assert "| lam 0.6 | 100.0 | +0.0 | +0.0 .. +0.0 | 0.200 | 0.200 | 0.200 | yes |" in text
    assert "| nats |" not in text and "| snapkv @ 0.25 | 0.0 | -100.0 |" in text
    assert "NAtS scorers" not in text  # the positional run's scorers are not in the table
    assert set(json.loads((out / "t_kv_fractions.json").read_text())["methods"]) == {
        "full",
        "lam=0.3",
        "lam 0.6",
        "snapkv @ 0.25",
    }
    with pytest.raises(SystemExit, match="expected LABEL=FILE"):
        hf_study_table.main([str(base), "--out", str(out), "--nats", str(sparse)])


def test_runs_on_other_examples_are_refused(tmp_path):
    a = write(tmp_path / "a" / "results.jsonl", [row("full", None, 0, 1.0, 1.0, prompt=100)])
    b = write(tmp_path / "b" / "results.jsonl", [row("full", None, 0, 1.0, 1.0, prompt=120)])
    with pytest.raises(ValueError, match="not on the same examples"):
        hf_study_table.main([str(a), str(b), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="does not exist"):
        hf_study_table.main([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "out")])
