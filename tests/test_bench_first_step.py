"""benchmarks/bench_first_step.py --smoke: two nats-train runs on the CPU sharing fresh cache folders, read back."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # two nats-train processes: about 80 s on 2 CPU cores
def test_bench_first_step_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_first_step.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_first_step_cpu.json").read_text())
    assert [r["run"] for r in data["runs"]] == ["first run", "second run"]
    for r in data["runs"]:
        assert r["first_step_s"] > 0 and r["startup_s"] > 0
        assert r["tuning_lines"] == []  # the interpreter never tunes
    assert set(data["caches"]) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}
    table = (tmp_path / "bench_first_step_cpu.md").read_text()
    assert "| first run |" in table and "| second run |" in table
