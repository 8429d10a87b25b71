"""Packaging: what pyproject.toml installs (every package folder, the Hydra configs as package data), the config
lookup of an installed nats, a wheel that runs from another folder (slow), and nats without triton (macOS)."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def folder_of(package: str) -> Path:
    """The checkout folder that pyproject.toml installs as ``package`` (its package-dir mapping applied)."""
    mapping = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in mapping:
            return REPO / mapping[prefix] / Path(*parts[i:])
    return REPO / Path(*parts)


def test_every_package_folder_is_installed():
    """Every folder of Python files under nats/ and kernels/ is a package that pyproject.toml lists (a folder
    missing from `packages` would be absent from a wheel and fail only when installed), and each listed one
    exists."""
    listed = set(SETUPTOOLS["packages"])
    installed_as = {folder_of(p).resolve(): p for p in listed}
    for p in listed:
        assert folder_of(p).is_dir(), f"pyproject.toml lists {p}, but {folder_of(p)} does not exist"
    for top in ("nats", "kernels"):
        for folder in [REPO / top, *(d for d in (REPO / top).rglob("*") if d.is_dir())]:
            if "__pycache__" in folder.parts or not any(folder.glob("*.py")):
                continue
            assert folder.resolve() in installed_as, (
                f"{folder.relative_to(REPO)}/ holds Python files but is not in [tool.setuptools] packages "
                "of pyproject.toml: add it there"
            )


def test_kernels_and_configs_are_mapped():
    """The two top-level folders installed inside packages: kernels/ as nats_kernels, conf/ as nats/conf."""
    assert folder_of("nats_kernels") == REPO / "kernels"
    assert folder_of("nats.conf") == REPO / "conf"
    import nats_kernels

    assert Path(nats_kernels.__file__).resolve().parent == REPO / "kernels"


def test_every_config_is_package_data():
    """Every file of conf/ matches the package-data patterns of nats.conf, so the wheel's nats/conf is the whole
    config tree (the slow wheel test below builds one and runs from it)."""
    patterns = SETUPTOOLS["package-data"]["nats.conf"]
    files = [
        p.relative_to(REPO / "conf").as_posix()
        for p in (REPO / "conf").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    assert "train.yaml" in files and len(files) > 20
    missing = [
        f
        for f in files
        if not any(
            fnmatch.fnmatch(f, pat) if "/" in pat else "/" not in f and fnmatch.fnmatch(f, pat) for pat in patterns
        )
    ]
    assert not missing, f"conf/ files outside the package data of nats.conf in pyproject.toml: {missing}"


def test_conf_dir_lookup(tmp_path, monkeypatch):
    """An installed nats (nats/conf present) reads its own configs; a checkout or an editable install reads
    conf/ beside the nats folder."""
    import nats.utils as U

    assert Path(U.CONF_DIR) == REPO / "conf"  # this checkout (editable install): the top-level conf/
    site = tmp_path / "site" / "nats"
    (site / "conf").mkdir(parents=True)
    (site / "conf" / "train.yaml").write_text("x: 1\n")
    monkeypatch.setattr(U.resources, "files", lambda pkg: site)
    assert Path(U.find_conf_dir()) == site / "conf"


@pytest.mark.slow
def test_wheel_runs_from_another_folder(tmp_path):
    """`pip wheel` builds nats from this checkout; installed (without dependencies, those of .venv serve) into a
    folder of its own, `nats-train --cfg job` run from another folder composes the config from the wheel's
    nats/conf, with nats imported from the wheel and not from this checkout."""
    src, wheels, site, work = (tmp_path / d for d in ("src", "wheels", "site", "elsewhere"))
    work.mkdir()
    # built from a copy of what the wheel is made of: no stale build/ folder of the checkout gets in
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("nats", "kernels", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert (site / "nats" / "conf" / "train.yaml").is_file() and (site / "nats_kernels" / "__init__.py").is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("PROJECT_ROOT", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import nats, nats_kernels, nats.utils as u; "
            "print(nats.__file__); print(nats_kernels.__file__); print(u.CONF_DIR)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split()), where.stdout
    script = site / "bin" / "nats-train"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "nats.train"]
    job = subprocess.run([*cmd, "--cfg", "job"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "model:" in job.stdout and "data:" in job.stdout and "trainer:" in job.stdout
    assert not (work / "logs").exists() or not any((work / "logs").rglob("*.ckpt"))


BLOCK_TRITON = textwrap.dedent("""
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: a machine without triton)")
            return None

    sys.meta_path.insert(0, NoTriton())
""")


def test_nats_works_without_triton(tmp_path):
    """Triton is optional (macOS has no wheels): without it, nats and its entry points import and a NAtS model
    trains a step on the PyTorch reference."""
    code = BLOCK_TRITON + textwrap.dedent("""
        import torch
        import nats, nats.functional, nats.ops, nats.models.gpt, nats.attention, nats.cache, nats.lit
        import nats.train, nats.eval, nats.prepare, nats_kernels.nats_attention, nats_kernels.cross_entropy
        from nats.models.gpt import GPT, GPTConfig
        from nats.train import compose_config

        cfg = compose_config(["model/attention=nats"])
        attention = dict(cfg.model.attention, window=4)
        assert attention["backend"] == "auto"
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, attention=attention,
                              fused_cross_entropy=True))
        x = torch.randint(0, 64, (2, 16))
        loss = model(x, targets=x).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert "triton" not in sys.modules
        print("ok", float(loss))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
