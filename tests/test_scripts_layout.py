"""The checkout's layout: experiments/ (studies) and benchmarks/ (speed) scripts that do not lean on tests/, docs
whose script paths exist, CONTRIBUTING.md's map of where each kind of thing goes, and small tracked results."""

from __future__ import annotations

import re
import subprocess
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


def _contributing_map() -> str:
    text = (REPO / "CONTRIBUTING.md").read_text()
    start = text.index("## Where each kind of thing goes")
    return text[start : text.index("\n## ", start + 1)]


def test_contributing_map_names_every_top_level_folder():
    """CONTRIBUTING.md's map says where each kind of thing goes: every top-level folder of the checkout appears in
    it (a new folder needs a row), and every folder or file it names exists."""
    table = _contributing_map()
    ignored = {"data", "logs", "outputs", "multirun", "build", "wheels"}
    for folder in sorted(p for p in REPO.iterdir() if p.is_dir()):
        name = folder.name
        if name in ignored or name.startswith(".") and name != ".ci" or name.endswith(".egg-info"):
            continue
        assert f"`{name}/" in table, f"CONTRIBUTING.md's map does not say what goes in {name}/"
    for ref in re.findall(r"`(\.?[\w.-]+/(?:[\w.-]+/)*[\w.-]*)`", table):
        if "<" in ref or "{" in ref or ref.split("/")[0] in ignored:
            continue
        assert (REPO / ref).exists(), f"CONTRIBUTING.md's map names {ref}, which does not exist"


def _tracked(folder: str) -> list[Path] | None:
    """The files git tracks under folder, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", folder], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [REPO / p for p in out.split("\0") if p]


def test_results_are_small_and_raw_outputs_untracked():
    """docs/results/ holds small tables and plots (at most 3 MB, no binaries but plots); raw run outputs are not
    tracked (experiments/results/ holds only its README)."""
    allowed = {".md", ".json", ".csv", ".png", ".log", ".txt"}
    files = [p for p in (REPO / "docs" / "results").rglob("*") if p.is_file()]
    tracked = _tracked("docs/results")
    if tracked is not None:
        files = [p for p in files if p in set(tracked)]
    assert files
    for p in files:
        assert p.suffix in allowed, f"{p.relative_to(REPO)}: docs/results/ holds tables and plots, not {p.suffix}"
    total = sum(p.stat().st_size for p in files)
    assert total <= 3 * 1024 * 1024, f"docs/results/ holds {total / 2**20:.1f} MB (at most 3 MB)"
    raw = _tracked("experiments/results")
    if raw is not None:
        assert [p.relative_to(REPO).as_posix() for p in raw] == ["experiments/results/README.md"]


def test_readme_links_every_doc():
    """Every page of docs/ is reachable from the README (its "Documentation" table), as CONTRIBUTING.md asks."""
    readme = (REPO / "README.md").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
