"""Run folders that survive pre-emption: checkpoint auto-resume, SLURM requeue wiring, and ``metrics.json``.

``ckpt_path=auto`` (the default of ``conf/train.yaml``)
    resumes from the newest checkpoint in the run folder (``${paths.output_dir}``), if there is one: Lightning's
    ``hpc_ckpt_<n>.ckpt`` (written when SLURM signals a pre-emption or the time limit) or
    ``checkpoints/last.ckpt`` (written at every validation), whichever was modified last; otherwise the run
    starts from scratch. A requeued SLURM job runs again with the same config and the same folder, so it
    continues where it stopped. ``ckpt_path=null`` always starts fresh; a path resumes from that file.

SLURM requeue
    Under SLURM (Lightning's ``SLURMEnvironment.detect()``) the trainer gets
    ``SLURMEnvironment(auto_requeue=True, requeue_signal=<the signal submitit asks SLURM to send>)``:
    ``sbatch --signal=USR2@<signal_delay_s>`` (submitit's ``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default). On that
    signal Lightning saves ``hpc_ckpt_<n>.ckpt`` into the run folder and calls ``scontrol requeue <job>``;
    the restarted job finds it through ``ckpt_path=auto``. submitit installs its own handler for the same
    signal (it requeues without saving anything); :func:`lightning_handles_requeue` sets it aside during
    ``fit``/``validate`` so that Lightning's handler, which saves the state first, is the one that runs.

``metrics.json``
    :func:`write_metrics` writes the final metrics (validation loss, perplexity, KV density for NAtS, ...) and
    the run's size (steps, processes, accumulation, tokens seen) into the run folder, atomically, on rank 0;
    ``experiments/collect.py`` turns a multirun folder of them into one table.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

# conf/hydra/launcher/submitit_{slurm,local}.yaml carry the plugin's names on purpose (hydra/launcher=submitit_slurm)
# and are checked against the plugin's schema of that name; Hydra 1.3 warns about that on every start
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"\s*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore")

AUTO = "auto"
METRICS_FILE = "metrics.json"


def checkpoint_candidates(output_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints a run folder may be resumed from: ``hpc_ckpt_*.ckpt`` and ``checkpoints/last.ckpt``."""
    root = Path(output_dir)
    found = sorted(root.glob("hpc_ckpt_*.ckpt"))
    last = root / "checkpoints" / "last.ckpt"
    if last.is_file():
        found.append(last)
    return [p for p in found if p.is_file()]


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str | os.PathLike) -> str | None:
    """``None`` -> ``None``; ``"auto"`` -> the newest checkpoint in ``output_dir`` (or ``None``); else the path,
    which must exist."""
    if ckpt_path is None:
        return None
    if str(ckpt_path) == AUTO:
        candidates = checkpoint_candidates(output_dir)
        if not candidates:
            return None
        return str(max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name.startswith("hpc"))))
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path} does not exist: pass the path of a .ckpt file to resume from "
            f"(or ckpt_path=auto to resume from the run folder when it holds a checkpoint)"
        )
    return str(ckpt_path)


def requeue_signal() -> signal.Signals:
    """The signal SLURM sends before a pre-emption or the time limit: submitit's ``--signal=<SIG>@<delay>``
    (``SUBMITIT_PREEMPT_SIGNAL``, default USR2; a plain ``sbatch`` script should ask for the same)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError as exc:
        raise ValueError(f"SUBMITIT_PREEMPT_SIGNAL={name!r} is not a signal name (e.g. USR2)") from exc


def cluster_plugins(auto_requeue: bool = True) -> list[Any]:
    """``[SLURMEnvironment(auto_requeue, requeue_signal())]`` when this process runs under SLURM, else ``[]``
    (Lightning then picks its default environment)."""
    if os.name == "nt":
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=bool(auto_requeue), requeue_signal=requeue_signal())]


def _is_submitit_handler(handler: Any) -> bool:
    owner = getattr(handler, "__self__", None)
    module = getattr(type(owner), "__module__", "") if owner is not None else getattr(handler, "__module__", "")
    return str(module).startswith("submitit")


@contextlib.contextmanager
def lightning_handles_requeue(trainer: Any) -> Iterator[bool]:
    """Within the block, Lightning's requeue handler (save ``hpc_ckpt_<n>.ckpt``, then ``scontrol requeue``)
    replaces submitit's handler of the requeue signal; submitit's is put back afterwards.

    Only when the trainer runs under SLURM with auto-requeue and submitit's handler is installed (the job was
    started by submitit); yields whether it swapped. Lightning does not replace a handler that is already there,
    hence the removal before ``fit``/``validate`` (which install Lightning's and restore the removed state)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    env = getattr(trainer._accelerator_connector, "cluster_environment", None)
    sig = getattr(env, "requeue_signal", None)
    handler = signal.getsignal(sig) if sig is not None else None
    swap = (isinstance(env, SLURMEnvironment) and env.auto_requeue and sig is not None
            and _is_submitit_handler(handler))
    if swap:
        signal.signal(sig, signal.SIG_DFL)
    try:
        yield swap
    finally:
        if swap:
            signal.signal(sig, handler)


def write_metrics(output_dir: str | os.PathLike, metrics: Mapping[str, float], **info: Any) -> Path:
    """Write ``{"metrics": {...}, **info}`` to ``<output_dir>/metrics.json`` atomically; returns the path."""
    path = Path(output_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"metrics": {k: float(v) for k, v in sorted(metrics.items())}, **info}
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_metrics(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The content of ``<run_dir>/metrics.json``, or ``None`` when the run has not finished."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())
