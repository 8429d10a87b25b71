"""benchmarks/bench_turn.py --smoke: a conversation's next turn on a tiny model on the CPU, continued through the cache
that holds the history against re-prefilling the whole conversation, at two batch sizes."""

import json
import math

import pytest

pytest.importorskip("transformers")

from conftest import load_script  # noqa: E402

TURN, CONVERSATION = 8, 64 + 1 + 8  # the smoke turn, and history + answer + turn


def test_bench_turn_smoke(tmp_path):
    bench = load_script("benchmarks/bench_turn.py")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_turn.json").read_text())
    assert data["complete"] is True
    rows = {(r["batch"], r["row"]): r for r in data["rows"]}
    kinds = ("nats, continued", "nats, re-prefilled", "full, re-prefilled", "full, continued")
    assert set(rows) == {(b, k) for b in (1, 2) for k in kinds}
    for (batch, kind), r in rows.items():
        assert "failed" not in r, r
        assert r["conversation"] == CONVERSATION and r["generated"] == r["new_tokens"]
        # a continued cache prefilled only the answer's last token and the turn, a fresh one the whole conversation
        assert r["prefilled"] == (TURN + 1 if r["continued"] else CONVERSATION), (batch, kind)
        assert isinstance(r["ttft_s"], float) and math.isfinite(r["ttft_s"]) and r["ttft_s"] > 0
        assert r["tokens_per_s"] > 0 and r["ttft_x"] > 0 and r["new_graphs"] == 0
        assert r["seen"] == CONVERSATION + r["new_tokens"] - 1
        assert (r["kept_share"] < 1.0) == (r["policy"] == "nats")
        assert (r["reallocations"] > 0) == r["continued"]  # the held pools grew for the turn and the new tokens
    assert rows[(1, "full, re-prefilled")]["ttft_x"] == 1.0
    text = (tmp_path / "bench_turn.md").read_text()
    assert text.startswith("# ") and "The next turn's first token" in text.splitlines()[2]
    assert "Command: `python benchmarks/bench_turn.py --smoke" in text and "torch " in text
    for kind in kinds:
        assert f"| 2 | {kind} | {CONVERSATION} |" in text
