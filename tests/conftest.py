"""Shared test set-up: `slow` tests run only with --runslow; `gpu` tests only where CUDA is present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton's settings, made before any test (as the console scripts make them, nats.cli.guarded): without a GPU the
# kernels run in Triton's interpreter, which must be chosen before any kernel is defined (TRITON_INTERPRET=1, read
# when @triton.jit decorates a kernel); the test processes' subprocesses inherit it.
import nats_kernels

nats_kernels.configure_triton()

REPO = Path(__file__).resolve().parents[1]
# the Gutenberg cache that nats-train uses (prepared once, reused by later runs)
DATA_DIR = Path(os.environ.get("NATS_TEST_DATA_DIR", REPO / "data"))

# two threads per process; one per test process where pytest -n spreads the suite over the cores (make test)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_itemcollected(item):
    """The tests of the local SLURM cluster run in one test process (make test's -n ... --dist loadgroup): marked
    as they are collected, before pytest-xdist groups them. They are slow (a real cluster's jobs: `make test-all`)."""
    if "slurm_cluster" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("slurm"))
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own (see _xdist_group_suffix)
def pytest_collection_modifyitems(config, items):
    _xdist_group_suffix(config, items)
    run_slow = config.getoption("--runslow")
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _prepare_gutenberg() -> Exception | None:
    """The embedded Gutenberg corpus downloaded and tokenised into DATA_DIR once (what nats-train's first run does),
    under a file lock: parallel test processes (pytest -n) wait for the one that prepares it. The error where it
    cannot be had (no network on a fresh checkout), else None."""
    from filelock import FileLock

    from nats.data.datamodule import TokenDataModule

    DATA_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DATA_DIR / ".prepare.lock")):
        try:
            TokenDataModule("gutenberg", str(DATA_DIR), block_size=64, micro_batch_size=1).prepare_data()
        except Exception as exc:  # noqa: BLE001 - the tests that need it say why
            return exc
    return None


@pytest.fixture(scope="session", autouse=True)
def _gutenberg_prepared_first():
    """Before any test: the shared Gutenberg cache, so that no two test processes tokenise it at once and no test
    finds it missing because another one downloads it later (a failure here is reported by those tests)."""
    _prepare_gutenberg()


@pytest.fixture(scope="session")
def gutenberg_cache() -> Path:
    """DATA_DIR holding the prepared Gutenberg corpus; skips the test, with the reason, where it cannot be had."""
    exc = _prepare_gutenberg()
    if exc is not None:
        pytest.skip(f"the Gutenberg corpus cannot be prepared here ({type(exc).__name__}: {exc})")
    return DATA_DIR


def local_corpus(folder: Path) -> list[str]:
    """Overrides that train on a small text_dir corpus written into ``folder`` from the repository's own docs
    (no download: for tests that must run on a machine without network, e.g. a GPU machine), its token cache
    in ``folder/cache``."""
    docs = sorted(REPO.glob("docs/*.md"))
    for i, path in enumerate(docs):
        split = {0: "validation", 1: "test"}.get(i % 5, "train")
        (folder / "corpus" / split).mkdir(parents=True, exist_ok=True)
        (folder / "corpus" / split / f"{path.stem}.txt").write_text(path.read_text())
    return ["data=text_dir", f"data.path={folder / 'corpus'}", f"paths.data_dir={folder / 'cache'}"]


def _xdist_group_suffix(config, items) -> None:
    """--dist loadgroup groups tests by the ``@<group>`` suffix pytest-xdist gives their node ids; pytest 9 keeps
    node ids in ``_id``, which pytest-xdist 3.8 does not set: the suffix is given here where it is missing."""
    if not getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers under --dist loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        marks = item.iter_markers("xdist_group")
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        if groups and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


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
