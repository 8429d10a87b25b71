"""experiments/ (studies) and benchmarks/ (speed): scripts that do not lean on tests/, and docs whose script paths
exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    [
        *REPO.glob("experiments/*.py"),
        *REPO.glob("experiments/*.sh"),
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("benchmarks/*.sh"),
    ]
)
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "slurm" / "README.md",
    *REPO.glob("docs/*.md"),
    *REPO.glob("benchmarks/*.md"),
    *REPO.glob("experiments/*.md"),
    *REPO.glob("*/results/README.md"),
]


def test_both_folders_have_scripts_and_a_readme():
    for folder in ("experiments", "benchmarks"):
        assert (REPO / folder / "README.md").is_file()
        assert any(p.parent.name == folder for p in SCRIPTS)
    for results in ("experiments/results", "docs/results"):
        assert (REPO / results / "README.md").is_file()


def test_no_script_imports_tests():
    for path in SCRIPTS:
        text = path.read_text()
        assert not re.search(r"""["'/]tests["']\)|/ ["']tests["']|from conftest|import conftest""", text), (
            f"{path.relative_to(REPO)} uses tests/: compose configs with nats.train.compose_config instead"
        )


def test_no_machine_specific_checkout_paths():
    """Scripts and docs name paths of the checkout, never /work/... or /opt/... of the machine they were written
    on (scratch folders under /tmp that a script creates itself are fine)."""
    for path in [*SCRIPTS, *DOCS]:
        for line in path.read_text().splitlines():
            assert not re.search(r"(?<![\w.])/(work|opt|root|home)/", line), f"{path.relative_to(REPO)}: {line}"


def test_script_paths_in_docs_exist():
    pattern = re.compile(r"\b((?:experiments|benchmarks)/[\w./-]+\.(?:py|sh))")
    for path in DOCS + SCRIPTS:
        for ref in pattern.findall(path.read_text()):
            assert (REPO / ref).is_file(), f"{path.relative_to(REPO)} names {ref}, which does not exist"
