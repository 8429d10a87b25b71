"""benchmarks/bench_nats_train.py --smoke: nats-train (dense, NAtS) and the isolated step on the CPU, read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_bench_nats_train_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_nats_train.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_nats_train_cpu.json").read_text())
    table = (tmp_path / "bench_nats_train_cpu.md").read_text()
    assert [r["experiment"] for r in data["results"]] == ["fig3_dense", "fig3_nats"]
    for r in data["results"]:
        assert r["monitor"]["after_warmup"] and r["monitor"]["median"] > 0  # the ThroughputMonitor's tokens/s
        assert r["timer"]["steps"] == 6 and r["timer"]["tokens_per_s"] > 0  # the StepTimer
        assert r["timer"]["first_step_s"] > 0 and r["timer"]["first_val_s"] > 0
        assert r["recompiles"]["count"] == 0  # eager: nothing compiles
        assert r["isolated"]["tokens_per_s"] > 0
        assert r["model"]["n_layer"] == 4  # model=tiny
    assert data["results"][1]["attention"] == "nats" and data["results"][0]["attention"] == "dense"
    assert "fig3_nats / fig3_dense" in table and "| fig3_dense |" in table
