"""benchmarks/limit_targets.py: each target is read from bench_hf_decode.py's rows and flips with them."""

from __future__ import annotations

import json

import pytest

from conftest import load_script

targets = load_script("benchmarks/limit_targets.py")


def row(method, tokens, share, prompt=32768, batch=1, **extra):
    return {"method": method, "prompt": prompt, "batch": batch, "tokens_per_s": tokens, "share_of_measured": share,
            "prefill_s": extra.pop("prefill_s", 1.0), "new_graphs": 0, "cudagraphs_recorded": 0, **extra}  # fmt: skip


def result(rows, shape="llama-3.1-8b"):
    """The rows as bench_hf_decode.py writes them: each names the fastest full cache of its setting (here `full`)."""
    for r in rows:
        if not r.get("mixed"):
            r.setdefault("full_method", "full")
    return {"args": {"model_shape": shape}, "device": "GPU", "rows": rows}


def met(res) -> dict[str, bool]:
    return {(t, s.split(" (")[0]): m for t, s, _, _, m in targets.checks(res)}


def test_each_target_follows_its_rows():
    rows = [
        row("flex_static", 150, 0.71),
        row("full", 160, 0.74),  # the fastest full cache: its share is the one checked
        row("nats", 176, 0.68, x_full=1.10, limit_x_full=1.20, prefill_s=0.84),
        row("full", 470, 0.72, batch=7, equal_memory_gib=32),
        row("nats", 1600, 0.6, batch=31, equal_memory_gib=32, x_full=3.4, limit_x_full=3.9),
    ]
    got = met(result(rows))
    s = "llama-3.1-8b, 32768 prompt, batch 1"
    assert got[("fastest full cache at the bandwidth", f"{s}, full")] is True
    assert got[("NAtS at the bandwidth for its bytes", s)] is False  # 68% < 70%
    assert got[("NAtS over the fastest full cache, of the bytes' bound", s)] is True  # 1.10 >= 0.9 x 1.20
    assert got[("NAtS prefill over the fastest full cache's", s)] is True  # 0.84 / 1.0
    eq = "llama-3.1-8b, 32768 prompt, batch 31, 32 GiB of KV"
    assert got[("NAtS at equal KV memory", eq)] is False  # 3.4 < 3.5
    assert got[("NAtS over the fastest full cache, of the bytes' bound", eq)] is False  # 3.4 < 3.51
    rows[2]["share_of_measured"], rows[4]["x_full"], rows[2]["prefill_s"] = 0.71, 3.6, 0.9
    got = met(result(rows))
    assert got[("NAtS at the bandwidth for its bytes", s)] is True
    assert (
        got[("NAtS at equal KV memory", eq)] is True and got[("NAtS prefill over the fastest full cache's", s)] is False
    )


def test_smollm2_mixed_and_graph_targets():
    rows = [row("full", 791, 0.09, prompt=8192), row("nats", 580, 0.05, prompt=8192, x_full=0.73, limit_x_full=1.45),
            {"method": "nats", "mixed": True, "requests": 50, "batches": "1-16", "prompts": "1k-32k", "ratio": 1.41,
             "new_graphs": 0, "cudagraphs_recorded": 2},
            row("static", 300, 0.03, prompt=8192, cudagraphs_recorded=5)]  # fmt: skip
    got = met(result(rows, "smollm2-135m"))
    assert got[("SmolLM2 decoding speed", "smollm2-135m, 8192 prompt, batch 1, full")] is True
    assert got[("SmolLM2 decoding speed", "smollm2-135m, 8192 prompt, batch 1, nats")] is False
    mixed = "smollm2-135m, 50 requests, batch 1-16, prompts 1k-32k, nats"
    assert got[("changing workload against the same requests again", mixed)] is False  # 1.41: outside 15%
    every = "smollm2-135m, all 3 rows but transformers' caches"  # its StaticCache's recordings are not counted
    assert got[("no graph compiled while timed", every)] is True
    assert got[("no CUDA graph recorded while timed", every)] is False
    recorded = [c for c in targets.checks(result(rows, "smollm2-135m")) if c[0].startswith("no CUDA graph")]
    assert recorded[0][2] == "2 (nats)"  # the methods that recorded are named


def test_the_script_writes_its_table_and_names_a_bad_file(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result([row("full", 160, 0.74)])))
    assert targets.main([str(path), "--out", str(tmp_path / "t.md")]) == 0
    assert "| fastest full cache at the bandwidth |" in (tmp_path / "t.md").read_text()
    other = tmp_path / "run_b.json"
    other.write_text(json.dumps(result([row("full", 150, 0.65)])))
    assert targets.main([str(path), str(other), "--out", str(tmp_path / "t.md")]) == 0
    lines = (tmp_path / "t.md").read_text().splitlines()  # several results: a first column names each line's
    assert lines[0].startswith("| result | target |") and lines[1].count("|---") == 6
    theirs = [line for line in lines if line.startswith("| run_b | fastest full cache at the bandwidth")]
    assert lines[2].startswith("| r | fastest full") and len(theirs) == 1 and theirs[0].endswith("| **no** |")
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        targets.main([str(tmp_path / "missing.json")])
