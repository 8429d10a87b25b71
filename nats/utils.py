"""Small helpers shared by the entry points."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any


def find_conf_dir() -> str:
    """The folder of the Hydra config tree (the one with train.yaml): ``nats/conf`` where nats is installed from a
    wheel or ``pip install .`` (package data, pyproject.toml maps the checkout's ``conf/`` there), else ``conf/``
    beside the ``nats`` folder (a checkout or an editable install)."""
    installed = Path(str(resources.files("nats") / "conf"))
    checkout = Path(__file__).resolve().parent.parent / "conf"
    return str(installed if (installed / "train.yaml").is_file() else checkout)


CONF_DIR = find_conf_dir()  # the Hydra config tree, for @hydra.main(config_path=CONF_DIR)
_RUN_ID = uuid.uuid4().hex[:6]


def run_id() -> str:
    """A random id, fixed for this process: the suffix of run and multirun folder names (``${run_id:}`` in
    conf/hydra/default.yaml), so that two runs started in the same second get different folders."""
    return _RUN_ID


def register_resolvers() -> None:
    """Register ``${run_id:}`` with OmegaConf (idempotent). Done on import: every Hydra entry point imports
    CONF_DIR from here before it composes a config."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)


register_resolvers()


def grad_accumulation(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Gradient-accumulation steps so that micro_batch x world_size x accumulation == global batch.

    >>> grad_accumulation(480, 24, 4)
    5
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be >= 1 (sequences per optimizer step)")
    if micro_batch_size < 1:
        raise ValueError(
            f"data.micro_batch_size={micro_batch_size} must be >= 1 (sequences per forward pass and process); "
            f"choose one that divides global_batch_size={global_batch_size}, e.g. data.micro_batch_size="
            f"{next(m for m in (8, 4, 2, 1) if global_batch_size % m == 0)}"
        )
    if world_size < 1:
        raise ValueError(f"{world_size} training processes (trainer.devices x trainer.num_nodes): must be >= 1")
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        divisors = [m for m in range(1, global_batch_size + 1) if global_batch_size % (m * world_size) == 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size x world_size = "
            f"{micro_batch_size} x {world_size} = {per_step}. Choose data.micro_batch_size from {divisors} "
            f"for {world_size} process(es), or change global_batch_size."
        )
    return global_batch_size // per_step


def world_size_of(trainer_cfg) -> int:
    """Number of training processes a Trainer config asks for (devices x nodes; 'auto' resolved here)."""
    devices = trainer_cfg.get("devices", "auto")
    accelerator = trainer_cfg.get("accelerator", "auto")
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif devices in ("auto", -1, "-1"):
        import torch

        use_gpu = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        n = torch.cuda.device_count() if use_gpu else 1
    else:
        n = int(devices)
    return n * nodes


def installed_spec(package: str):
    """The import spec of an installed package, found without importing it, or None where it is not installed (a
    parent package that fails to import, or a broken module entry, counts as not installed)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None


def installed_folders(package: str, missing: Exception) -> list[str]:
    """The folders of an installed package (its ``__path__``, or the folder of a single-module one), found without
    importing it; raises ``missing`` (an error that names the install command) where it is not installed."""
    spec = installed_spec(package)
    if spec is None:
        raise missing
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    return folders


def resolve_device(name: str):
    """The ``torch.device`` of a ``device=`` setting: ``auto`` is CUDA when available, else the CPU; a CUDA device
    on a machine without CUDA is an error that says what to set instead."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available: use device=cpu (or auto)")
    return dev


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = False) -> Iterator[Path]:
    """Write a file atomically: yields a temporary path ``.<name>.<random>.tmp`` in the same folder (created if
    missing) for the caller to write, then renames it over ``path``; on any exception (or interrupt) the temporary
    file is removed and ``path`` is left as it was. ``fsync``: flush the file and its folder to disk first (for
    files that must survive a crash, such as token caches)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: str | bytes, fsync: bool = False) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see :func:`atomic_path`); returns the path.

    The one helper for files that readers may open while they are written (metrics.json, cache metadata, ...)."""
    with atomic_path(path, fsync=fsync) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def inductor_settings(words: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` words (a benchmark's ``--inductor``) as ``{KEY: VALUE}``, each KEY a setting of
    ``torch._inductor.config``, each VALUE read as a Python literal, else kept as the string. ValueError, naming the
    word, for a malformed word or a key inductor does not have."""
    import ast

    import torch._inductor.config as inductor_config

    done: dict[str, Any] = {}
    for word in words:
        key, eq, raw = word.partition("=")
        if not eq or not key:
            raise ValueError(f"--inductor {word!r}: give KEY=VALUE, e.g. combo_kernels=True")
        if not hasattr(inductor_config, key):
            raise ValueError(f"--inductor {word!r}: torch._inductor.config has no setting {key!r}")
        try:
            done[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            done[key] = raw
    return done


def settings_key(settings: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...]:
    """``settings`` (e.g. inductor's, `inductor_settings`) as a hashable key of a cache of compiled functions: one
    ``(name, type name, value)`` per setting, sorted by name, a value that cannot be hashed (a list, a dict) by its
    repr. Equal settings give equal keys; settings that differ in a value or its type (``True`` and ``1``) do not."""
    pairs = []
    for name, value in sorted(settings.items()):
        kind = type(value).__qualname__
        try:
            hash(value)
        except TypeError:
            kind, value = f"repr of {kind}", repr(value)
        pairs.append((name, kind, value))
    return tuple(pairs)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """The one writer of Markdown tables (nats-eval's results.md, nats-eval-hf's, the studies' reports): the header
    row, the rule, one line per row (each cell as ``str``), joined by newlines without a final one. ``align``: a
    character per column, ``"r"`` right-aligned (``---:``), anything else plain (``---``); default: the first
    column plain, the others right-aligned (labels, then numbers)."""
    align = align if align is not None else "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns):
        raise ValueError(f"align has {len(align)} characters for {len(columns)} columns")
    lines = ["| " + " | ".join(columns) + " |", "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
