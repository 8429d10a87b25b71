"""Shared test set-up: `slow` tests run only with --runslow; `gpu` tests only where CUDA is present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter, which must be chosen before anything imports triton
# (Lightning or torch.compile may import it before a kernel module gets the chance): the kernels package
# chooses it (kernels/__init__.py), imported here before any test.
import nats_kernels  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
# the Gutenberg cache that nats-train uses (prepared once, reused by later runs)
DATA_DIR = Path(os.environ.get("NATS_TEST_DATA_DIR", REPO / "data"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow")
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def compose(overrides: list[str], tmp_path: Path, config_name: str = "train"):
    """Compose a real config from conf/ with outputs under tmp_path and the shared data cache."""
    from nats.train import compose_config

    return compose_config(
        [f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs", f"paths.data_dir={DATA_DIR}", *overrides],
        config_name,
    )


def load_script(path: str):
    """A script of the repository that is not a package module (``experiments/<name>.py``, ``benchmarks/...``),
    imported from its file."""
    import importlib.util

    file = REPO / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    """Decode loops run many tiny ops: one thread avoids OpenMP spin overhead on shared cores.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node SLURM cluster on this machine for the whole session (``slurm/local_cluster.py``: installs the
    Debian packages when missing, as root); the tests that use it are skipped, with the reason, where it cannot
    run. Afterwards: every job cancelled, the daemons it started stopped by pid, its folder removed."""
    import shutil
    import tempfile

    lc = load_script("slurm/local_cluster.py")
    folder = Path(tempfile.mkdtemp(prefix="nats-slurm-"))
    cluster = lc.LocalCluster(folder, log=lambda msg: print(msg, flush=True))
    try:
        cluster.start()
    except lc.Unavailable as exc:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no local SLURM cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
