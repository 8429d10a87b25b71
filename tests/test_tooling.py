"""The test run itself: a test that hangs fails after the per-test limit (pytest-timeout, configured in
pyproject.toml, which `make test` and CI's `.ci/run` read) instead of stalling the suite."""

from __future__ import annotations

import subprocess
import sys


def test_the_suite_has_a_per_test_time_limit(pytestconfig):
    assert "timeout" in pytestconfig.inicfg and float(pytestconfig.getini("timeout")) >= 300


def test_a_hung_test_fails_at_the_limit(tmp_path):
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    time.sleep(60)\n")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "Timeout" in res.stdout + res.stderr, res.stdout[-2000:]
