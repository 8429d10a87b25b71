"""Conventions researchers expect: nats.__version__, the W&B logger config, datasets as an optional
extra, one atomic-write helper, LICENSE and CITATION.cff."""

from __future__ import annotations

import builtins
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import nats
from nats.utils import atomic_path, atomic_write

REPO = Path(__file__).resolve().parents[1]


def test_version_is_the_distributions():
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert nats.__version__ == version


def test_wandb_logger_composes_offline_and_says_what_is_missing(tmp_path):
    from nats.train import compose_config, instantiate

    cfg = compose_config(["logger=wandb", f"paths.output_dir={tmp_path}"])
    node = cfg.logger.wandb
    assert node._target_ == "lightning.pytorch.loggers.WandbLogger" and node.offline is True
    assert node.save_dir == str(tmp_path)
    both = compose_config(["logger=[wandb,csv]", f"paths.output_dir={tmp_path}"])
    assert set(both.logger) == {"wandb", "csv"}
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(Exception, match=r"(?s)wandb.*pip install"):
            instantiate(node, "logger.wandb")


def test_datasets_is_an_extra_and_only_the_hub_path_imports_it(tmp_path, monkeypatch):
    text = (REPO / "pyproject.toml").read_text()
    deps = text[text.index("dependencies = [") : text.index("]", text.index("dependencies = ["))]
    assert "datasets" not in deps and "pyyaml" in deps
    assert re.search(r'^datasets = \["datasets', text, re.M)
    for path in (REPO / "nats").rglob("*.py"):  # no module-level import of datasets anywhere in nats
        for line in path.read_text().splitlines():
            assert not re.match(r"(import datasets|from datasets)\b", line), f"{path}: {line}"

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ModuleNotFoundError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    from nats.data.sources import get_source

    src = get_source("pg19", tmp_path, hf_name="emozilla/pg19")
    with pytest.raises(ImportError, match=r"nats-attention\[datasets\]"):
        next(iter(src.documents("train")))


def test_atomic_write_text_bytes_and_failure(tmp_path):
    p = tmp_path / "sub" / "a.json"
    assert atomic_write(p, '{"a": 1}\n') == p and p.read_text() == '{"a": 1}\n'
    atomic_write(p, b"\x00\x01", fsync=True)
    assert p.read_bytes() == b"\x00\x01"
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert p.read_bytes() == b"\x00\x01"  # left as it was
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.json"]  # no temporary file left behind


def test_no_second_atomic_write_in_nats():
    """Files are replaced atomically through nats.utils.atomic_write / atomic_path only."""
    exempt = {"utils.py", "evaluation.py"}  # the helper; nats-eval swaps its output files from a temporary folder
    for path in (REPO / "nats").rglob("*.py"):
        if path.name not in exempt:
            assert "os.replace(" not in path.read_text(), f"{path}: use nats.utils.atomic_write / atomic_path"


def test_license_and_citation():
    lic = (REPO / "LICENSE").read_text()
    assert lic.startswith("MIT License") and "Copyright (c) 2022 Andrej Karpathy" in lic and "nats/models/gpt.py" in lic
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT"
    titles = [r["title"] for r in cff["references"]]
    assert "Neural Attention Search" in titles and any(t.startswith("Gated Attention") for t in titles)
    assert len(titles) == 3


def test_the_repository_speaks_of_the_project_alone():
    """Docs, code and results name the date or commit, the machine and the command of a number, never how the work
    was organised (tracker numbers, work sessions, borrowed machines and their time budget)."""
    import re
    import subprocess

    pattern = re.compile(
        r"\b[Ii]ssues? #?\d+\b|\b[Ss]ession \d+\b|\b[Dd]evice[- ]time\b|\blent\b|\$OUT\b|\bcarried (?:folder|path)s?\b"
    )
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        if path.suffix in (".png", ".gz") or name == "tests/test_conventions.py" or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        lines = enumerate(text.splitlines(), 1)
        found += [f"{name}:{i}: {m.group(0)}" for i, line in lines if (m := pattern.search(line))]
    assert not found, "\n".join(found[:20])
