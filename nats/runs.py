"""Run folders that survive pre-emption: checkpoint auto-resume, SLURM requeue wiring, and ``metrics.json``.

``ckpt_path=auto`` (the default of ``conf/train.yaml``)
    resumes from the newest checkpoint in the run folder (``${paths.output_dir}``), if there is one:
    ``checkpoints/last.ckpt`` (written every ``checkpoint_every`` steps, at the last step, on SIGTERM and on
    SLURM's requeue signal) or a ``hpc_ckpt_<n>.ckpt`` of Lightning's (nats-train writes none), whichever was
    modified last; otherwise the run starts from scratch. A requeued SLURM job runs again with the same config and
    the same folder, so it continues where it stopped. ``ckpt_path=null`` always starts fresh; a path resumes from
    that file.

SLURM requeue
    Under SLURM (Lightning's ``SLURMEnvironment.detect()``) SLURM sends the requeue signal before a pre-emption or
    the time limit (``sbatch --signal=USR2@<signal_delay_s>``: submitit's ``SUBMITIT_PREEMPT_SIGNAL``, USR2 by
    default). `nats.callbacks.InterruptCheckpoint` handles it during ``fit`` as SIGTERM: the current optimizer step
    ends, ``checkpoints/last.ckpt`` is saved, and then :func:`requeue_job` calls ``scontrol requeue <job>``
    (rank 0); the restarted job finds the checkpoint through ``ckpt_path=auto`` and continues exactly. (Lightning's
    own handler, :func:`cluster_plugins` turns it off, would save ``hpc_ckpt_<n>.ckpt`` in the middle of a step;
    submitit's would requeue without saving anything.)

Run folders
    ``logs/<task>/runs/<date>_<time>_<id>``: ``<id>`` (:func:`run_id`) is random per process, so that runs started
    in the same second (a sweep launched by a script) never share a folder. Multirun folders are named the same way.

Resuming a local run
    ``nats-train resume=<run folder>`` (or ``resume=latest``: the newest folder under ``logs/train/runs`` that holds
    a checkpoint) runs again with the overrides the run was started with (``<run>/.hydra/overrides.yaml``) plus any
    given after ``resume=``, in the same folder, with ``ckpt_path=auto``: it continues from the folder's newest
    checkpoint. Every run says which: "resuming from <file> at step N" or "no checkpoint in <folder>: starting
    fresh". A checkpoint that cannot be read stops the run with a message naming the file and what to do.

Failed runs
    A run that raises writes ``failed.json`` (error, type, traceback) into its folder; ``experiments/collect.py``
    lists it as failed with its error. A later successful (resumed) run removes it.

``metrics.json``
    :func:`write_metrics` writes the final metrics (validation loss, perplexity, KV density for NAtS, ...) and
    the run's size (steps, processes, accumulation, tokens seen) into the run folder, atomically, on rank 0;
    ``experiments/collect.py`` turns a multirun folder of them into one table.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# conf/hydra/launcher/submitit_{slurm,local}.yaml carry the plugin's names on purpose (hydra/launcher=submitit_slurm)
# and are checked against the plugin's schema of that name; Hydra 1.3 warns about that on every start
warnings.filterwarnings(
    "ignore",
    category=UserWarning,
    message=r"\s*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore",
)

# torch 2.10+ deprecates `isinstance(x, LeafSpec)`, which Lightning's pytree helper still calls on every batch
# transfer (lightning/pytorch/utilities/_pytree.py): a FutureWarning that is Lightning's to fix, not the user's
warnings.filterwarnings(
    "ignore",
    category=FutureWarning,
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    module=r"lightning\.pytorch\.utilities\._pytree",
)

# a resumed run continues in its own folder, whose checkpoints/ is not empty: that is the point, not a mistake
warnings.filterwarnings("ignore", category=UserWarning, message=r"Checkpoint directory .* exists and is not empty")

AUTO = "auto"
METRICS_FILE = "metrics.json"
FAILED_FILE = "failed.json"


class _DropLightningTip(logging.Filter):
    """Drops Lightning's advertisement for its cloud logger ("💡 Tip: For seamless cloud logging ... litlogger"),
    logged at INFO whenever a Trainer is built without that logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


#: lines that go to the run's log file only, not the console: Lightning's device report and its srun hint (which
#: nats.train logs instead of warning)
LOG_FILE_ONLY = ("GPU available:", "TPU available:", "HPU available:", "The `srun` command is available")


class _LogFileOnly(logging.Filter):
    """On the console's handler: drops the records of :data:`LOG_FILE_ONLY` (the run's log file keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(p in message for p in LOG_FILE_ONLY)


def quiet_libraries() -> None:
    """Keep the libraries' noise off the console (idempotent): Lightning's litlogger tip; its device report ("GPU
    available: ...") and srun hint go to the run's log only. (The LeafSpec FutureWarning is filtered where this
    module is imported.)"""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info logs
    if not any(isinstance(f, _DropLightningTip) for f in logger.filters):
        logger.addFilter(_DropLightningTip())
    for handler in logging.getLogger().handlers:  # Hydra's console handler (its file handler is a FileHandler)
        if type(handler) is logging.StreamHandler and not any(isinstance(f, _LogFileOnly) for f in handler.filters):
            handler.addFilter(_LogFileOnly())
    _srun_hint_to_log()


_SRUN_HINT = r"The `srun` command is available on your system but is not used"


def _srun_hint_to_log() -> None:
    """Lightning warns (at every Trainer and fit) that ``srun`` exists but the process was not started by it; on a
    login or cluster node that is what a local run looks like: the hint goes to the run's log once instead."""
    import shutil
    import sys

    if any(f[1] is not None and f[1].pattern.startswith(_SRUN_HINT) for f in warnings.filters):
        return
    warnings.filterwarnings("ignore", message=_SRUN_HINT)
    if shutil.which("srun") and "SLURM_NTASKS" not in os.environ:
        logging.getLogger("nats").info(
            f"{_SRUN_HINT} (Lightning's hint): to run Lightning on SLURM, start it with srun, e.g. srun python "
            f"{' '.join(sys.argv)}; for a local run nothing needs doing"
        )


class RunInterrupted(Exception):
    """A fit stopped by SIGTERM or Ctrl-C at optimizer step ``step`` (``reason``: "SIGTERM" or "Ctrl-C")."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"interrupted at step {step} ({reason})")
        self.step, self.reason = step, reason


# mistakes in what the user asked for (a setting, a path, a file): one line, and no run folder when nothing ran
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, KeyError)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (truncated, corrupt, not a checkpoint)."""


def checkpoint_step(path: str | os.PathLike) -> int:
    """The optimizer step a Lightning checkpoint was saved at (``global_step``), reading it memory-mapped (cheap
    for large files). Raises :class:`CheckpointError` naming the file, what is wrong and what to do."""
    import torch

    path = Path(path)
    folder = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    others = sorted(
        {
            p
            for p in [*folder.glob("*.ckpt"), *folder.glob("checkpoints/*.ckpt")]
            if p.is_file() and p.resolve() != path.resolve()
        }
    )
    advice = (
        f"Move it away or delete it, then resume from another checkpoint with ckpt_path=<file>"
        f"{' (this run has ' + ', '.join(p.name for p in others) + ')' if others else ''}, or start fresh "
        f"with ckpt_path=null."
    )
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read is the same problem for the user
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"cannot resume from {path} ({size:,} bytes): torch.load cannot read it ({type(err).__name__}); it "
            f"may be truncated or corrupt, e.g. written by a run that was killed while saving. {advice}"
        ) from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(
            f"cannot resume from {path}: it holds no Lightning training state (no 'state_dict'). {advice}"
        )
    return int(ckpt.get("global_step", 0))


def read_model_checkpoint(path: str | os.PathLike | None, name: str, hint: str) -> tuple[dict, dict]:
    """(model config dict, model weights without their ``model.`` prefix) of a nats-train (LitGPT) checkpoint,
    read with ``weights_only=True``; clear errors otherwise. ``name`` names the file in the messages (e.g.
    ``ckpt_path=<path>``), ``hint`` says what to pass instead. Used by nats-eval and nats.hub."""
    import torch

    if path is None or str(path) in ("", "None", "null"):
        raise ValueError(f"no checkpoint given: {hint}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{name} does not exist: {hint}")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, or pickled objects beyond tensors and containers
        # torch's own text advises weights_only=False, i.e. running the file's pickled code: not what to do here
        raise ValueError(
            f"{name} is not a readable nats-train checkpoint ({p.stat().st_size:,} bytes): torch.load cannot read "
            f"it ({type(err).__name__}); it may be truncated or corrupt, e.g. written by a run that was killed "
            f"while saving, or not a checkpoint at all: {hint}"
        ) from err
    hp = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if (
        not isinstance(hp, dict)
        or not isinstance(hp.get("model"), Mapping)
        or not isinstance(state, dict)
        or not any(k.startswith("model.") for k in state)
    ):
        raise ValueError(
            f"{name} is not a nats-train checkpoint (it needs hyper_parameters['model'], the GPT config, "
            f"and a state_dict with 'model.*' weights, as nats.lit.LitGPT writes): {hint}"
        )
    weights = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    return dict(hp["model"]), weights


def _last_written(folder: Path) -> float:
    """When anything in a run folder (its log, checkpoints, logger files) was last written (``st_mtime``)."""
    return max((p.stat().st_mtime for p in folder.rglob("*") if p.is_file()), default=folder.stat().st_mtime)


def pick_latest_run(runs_dir: str | os.PathLike) -> tuple[Path, str]:
    """The run that ``resume=latest`` continues, and why, in words: of the run folders that hold a checkpoint
    (under ``runs_dir``, or, for a logs root, every task's ``<task>/runs/``: ``logs/train/runs``,
    ``logs/finetune_smollm2_nats/runs``, ...), the one written to most recently (its log, a checkpoint, its
    logger's files), i.e. the run that was active last, whether it was stopped, killed or finished; newer folders
    without a checkpoint (a run stopped before its first checkpoint) are named in the reason."""
    runs_dir = Path(runs_dir)
    folders = [*runs_dir.iterdir(), *runs_dir.glob("*/runs/*")] if runs_dir.is_dir() else []
    folders = [d for d in folders if d.is_dir() and ((d / ".hydra").is_dir() or checkpoint_candidates(d))]
    runs = [d for d in folders if checkpoint_candidates(d)]
    if not runs:
        raise FileNotFoundError(
            f"resume=latest: no run folder with a checkpoint under {runs_dir}; pass the run "
            f"folder itself (resume=logs/train/runs/<date>_<time>_<id>)"
        )
    written = {d: _last_written(d) for d in folders}
    best = max(runs, key=lambda d: written[d])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written[best]))
    done = " (it had finished: metrics.json)" if (best / METRICS_FILE).is_file() else ""
    newer = sorted(d.name for d in folders if written[d] > written[best] and d not in runs)
    skipped = f"; newer runs without a checkpoint to resume from: {', '.join(newer)}" if newer else ""
    return best, f"the run with a checkpoint that was written to last, at {when}{done}{skipped}"


def latest_run(runs_dir: str | os.PathLike) -> Path:
    """The run folder ``resume=latest`` continues (:func:`pick_latest_run`)."""
    return pick_latest_run(runs_dir)[0]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def resume_argv(
    argv: list[str],
    runs_dir: str | os.PathLike | None,
    notes: list[str] | None = None,
    *,
    program: str = "nats-train",
    checkpoint: bool = True,
) -> list[str]:
    """Command-line arguments with ``resume=<run folder>`` (or ``resume=latest``) replaced by the run's own
    overrides (``<run>/.hydra/overrides.yaml``), the given ones (which win over the saved ones of the same key),
    ``hydra.run.dir=<run folder>`` and, for a run that resumes from a checkpoint (``checkpoint``: nats-train),
    ``ckpt_path=auto``. Without ``resume=``: ``argv`` unchanged. ``resume=latest`` takes the newest run with a
    checkpoint under ``runs_dir`` (None: not offered); ``notes`` gets which run it took and why. Every console
    script that continues a run in its folder (``nats-train``, ``nats-eval-hf``) reads ``resume=`` here."""
    import yaml

    values = [a.split("=", 1)[1] for a in argv if a.startswith("resume=")]
    if not values:
        return argv
    if len(values) > 1:
        raise ValueError(f"resume= given {len(values)} times: {values}; give one run folder")
    if any(a in ("-m", "--multirun") for a in argv):
        raise ValueError(
            "resume= resumes one run and cannot be combined with -m/--multirun; a multirun job "
            "resumes with hydra.run.dir=<its folder> ckpt_path=auto, or rerun the sweep"
        )
    if values[0] == "latest":
        if runs_dir is None:
            raise ValueError(f"resume=latest is not offered by {program}: pass the run folder (resume=<run folder>)")
        folder, why = pick_latest_run(runs_dir)
        if notes is not None:
            notes.append(f"resume=latest: {folder}, {why}")
    else:
        folder = Path(values[0])
    saved_file = folder / ".hydra" / "overrides.yaml"
    if not saved_file.is_file():
        how = (
            "Pass a run folder (logs/train/runs/<date>_<time>_<id>), or resume a checkpoint file directly "
            "with ckpt_path=<file> (new run folder, same step)"
            if checkpoint
            else "Pass the folder of one of its runs (logs/<task>/runs/<date>_<time>_<id>)"
        )
        raise FileNotFoundError(
            f"resume={values[0]}: {saved_file} not found, so {folder} is not the folder of a {program} run. {how}"
        )
    given = [a for a in argv if not a.startswith("resume=")]
    given_keys = {_override_key(a) for a in given if "=" in a and not a.startswith("-")}
    saved = [str(o) for o in (yaml.safe_load(saved_file.read_text()) or [])]
    kept = [o for o in saved if _override_key(o) not in given_keys | {"ckpt_path", "hydra.run.dir"}]
    if "hydra.run.dir" in given_keys:
        raise ValueError("resume= sets hydra.run.dir to the run folder; do not give both")
    extra = [] if "ckpt_path" in given_keys or not checkpoint else ["ckpt_path=auto"]
    return kept + given + extra + [f"hydra.run.dir={folder}"]


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


def cluster_plugins() -> list[Any]:
    """``[SLURMEnvironment(auto_requeue=False, requeue_signal())]`` when this process runs under SLURM, else ``[]``
    (Lightning then picks its default environment). Lightning's own requeue handler saves ``hpc_ckpt_<n>.ckpt`` the
    moment the signal comes, in the middle of an optimizer step if that is where the process is: the project's
    `nats.callbacks.InterruptCheckpoint` handles the signal instead, at the end of the step."""
    if os.name == "nt":
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=False, requeue_signal=requeue_signal())]


def slurm_job_to_requeue() -> str | None:
    """This process' SLURM job as ``scontrol requeue`` names it (``<array>_<task>`` for a task of a job array), or
    None outside SLURM."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array is not None:
        return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job(job: str) -> None:
    """``scontrol requeue <job>``: SLURM ends the job and queues it again with the same id and command."""
    import subprocess

    res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job} failed ({res.returncode}): {res.stderr.strip()}")


def write_metrics(output_dir: str | os.PathLike, metrics: Mapping[str, float], **info: Any) -> Path:
    """Write ``{"metrics": {...}, **info}`` to ``<output_dir>/metrics.json`` atomically; returns the path."""
    payload = {"metrics": {k: float(v) for k, v in sorted(metrics.items())}, **info}
    return _write_json(Path(output_dir) / METRICS_FILE, payload)


def _write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    from nats.utils import atomic_write

    return atomic_write(path, json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def write_failure(output_dir: str | os.PathLike, err: BaseException) -> Path:
    """Record a failed run: ``<output_dir>/failed.json`` with the error, its type and the traceback."""
    import traceback

    payload = {
        "error": str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
        "type": type(err).__name__,
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
    }
    return _write_json(Path(output_dir) / FAILED_FILE, payload)


def clear_failure(output_dir: str | os.PathLike) -> None:
    (Path(output_dir) / FAILED_FILE).unlink(missing_ok=True)


def read_metrics(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The content of ``<run_dir>/metrics.json``, or ``None`` when the run has not finished."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def run_folder_is_new(output_dir: str | os.PathLike) -> bool:
    """Whether ``output_dir`` is the folder Hydra has just made for this single run (a fresh name, only
    ``.hydra/`` and the run's log in it): such a folder is removed again when the run's configuration fails its
    checks (:func:`report_failure`). A folder named with ``hydra.run.dir=`` (``resume=`` sets it), a multirun
    job's folder or one holding anything else is never removed."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.RUN:
            return False
        if any(str(o).lstrip("+~").startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra):
            return False
    except Exception:  # noqa: BLE001 - not under Hydra
        return False
    folder = Path(output_dir)
    return folder.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in folder.iterdir())


def one_line(err: BaseException) -> str:
    """An error's message on one line (its lines joined), or its type when it has none."""
    lines = [" ".join(line.split()) for line in str(err).splitlines() if line.strip()]
    text = " ".join(line if line[-1] in ".:;,!?" or i == len(lines) - 1 else line + "." for i, line in enumerate(lines))
    if isinstance(err, KeyError) and text.startswith("'"):
        text = f"missing key {text}"
    return text or type(err).__name__


def _shown(path: Path) -> str:
    """``path`` relative to the current folder when it is below it (as the user would type it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _remove_run_folder(folder: Path, stop_at: str | os.PathLike | None = None) -> None:
    """Close the log files that write into ``folder`` (the run's log), then remove it, and the folders above it
    that are left empty (``logs/<task>/runs``, ``logs/<task>``, ``logs``) up to ``stop_at`` (not included; without
    it, the two above: ``runs`` and its task)."""
    import shutil

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder.resolve():
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    stop = Path(stop_at).resolve() if stop_at is not None else folder.resolve().parents[2]
    parent = folder.resolve().parent
    while parent != stop and stop in parent.parents:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent


def report_failure(
    err: BaseException,
    output_dir: str | os.PathLike,
    *,
    program: str,
    new_folder: bool,
    root: str | os.PathLike | None = None,
) -> int:
    """Say what stopped a run in one line on the console (and the run's log) and return the exit status.

    * :class:`RunInterrupted` (SIGTERM, Ctrl-C): "interrupted at step N; resume with <program> resume=<run>";
      status 143 (SIGTERM) or 130.
    * a mistake in the configuration or the inputs (:data:`USER_ERRORS`, a checkpoint or token cache that
      cannot be read) before any optimizer step of this run: the message alone; the run folder is removed when
      Hydra made it for this run (``new_folder``, :func:`run_folder_is_new`), with the folders above it that are
      left empty, up to ``root`` (``paths.root_dir``); status 1.
    * anything else: "run failed after N steps (<type>): <message> (traceback in <run>/failed.json)"; status 1.

    ``HYDRA_FULL_ERROR=1`` prints the traceback as well."""
    out = Path(output_dir)
    log = logging.getLogger("nats")
    if isinstance(err, RunInterrupted):
        newest = resolve_ckpt_path(AUTO, out)
        try:
            saved = checkpoint_step(newest) if newest else None
        except CheckpointError:
            saved = None
        state = (
            f"state saved in {_shown(Path(newest))}"
            if saved == err.step
            else (f"newest checkpoint: step {saved}" if saved is not None else "no checkpoint written yet")
        )
        log.error(f"{program}: interrupted at step {err.step} ({err.reason}; {state}); resume with {program} "
                  f"resume={_shown(out)}")  # fmt: skip
        return 143 if err.reason == "SIGTERM" else 130
    if isinstance(err, KeyboardInterrupt):
        log.error(f"{program}: interrupted")
        return 130
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        import traceback

        traceback.print_exception(type(err), err, err.__traceback__)
    from nats.data.token_file import TokenCacheError

    message = one_line(err)
    mistake = isinstance(err, (*USER_ERRORS, CheckpointError, TokenCacheError))
    if mistake and getattr(err, "nats_steps_run", 0) <= 0:
        log.error(f"{program}: {message}")
        if new_folder and out.is_dir():
            _remove_run_folder(out, root)
        else:
            write_failure(out, err)
        return 1
    path = write_failure(out, err)
    step = getattr(err, "nats_steps_run", None)
    where = f" after {step} steps" if step else ""
    log.error(f"{program}: run failed{where} ({type(err).__name__}): {message} (traceback in {_shown(path)})")
    return 1
