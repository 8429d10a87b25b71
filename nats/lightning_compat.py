"""Every private Lightning attribute the project reads or writes, in one place.

Lightning gives no public way to do a few things the project needs: stop a fit at the end of an optimizer step
rather than in the middle of an accumulated one (`InterruptCheckpoint`), time the throughput exactly at the steps
whose logs are written (`nats.callbacks.TokenThroughput`, `nats.lit.logs_written_now`), stage statistics under
the step number Lightning's logs carry (`nats.lit`), and save an interrupted run with the step count a resume
expects. Each of those reads or writes an attribute whose name starts with ``_``; Lightning may rename or move it
in any release. Here each one is reached through a small named function, and nowhere else in ``nats/``; where an
attribute is missing the function raises `LightningCompatError`, one line naming the installed Lightning and the
supported range, instead of an ``AttributeError`` deep in a fit (or, for a flag that is written, silently
setting an attribute that Lightning never reads).

The supported range is ``SUPPORTED`` (the same bound as pyproject.toml's ``lightning`` dependency, which
``tests/test_lightning_compat.py`` checks): from ``LIGHTNING_MIN`` up to, not including, ``LIGHTNING_BELOW``,
the minor after the newest release tested (``LIGHTNING_MAX_TESTED``, also the newest on PyPI when the bound was
set). `check_lightning` (called by ``nats.train.build``) finds every attribute on a new Trainer before anything
runs, so that a Lightning that moved one fails at once, not at the SIGTERM hours into a run. The tests
(``tests/test_lightning_compat.py``) run each function against the installed Lightning.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: the oldest Lightning the project supports (pyproject.toml's lower bound)
LIGHTNING_MIN = "2.3"
#: the newest Lightning the project was tested with (the newest release on PyPI when the bound was set)
LIGHTNING_MAX_TESTED = "2.6.6"
#: pyproject.toml's upper bound: the minor after ``LIGHTNING_MAX_TESTED`` (its private attributes are untested)
LIGHTNING_BELOW = "2.7"
#: the requirement as pyproject.toml states it
SUPPORTED = f"lightning>={LIGHTNING_MIN},<{LIGHTNING_BELOW}"


class LightningCompatError(RuntimeError):
    """A private Lightning attribute the project needs is not where this module expects it."""


def lightning_version() -> str:
    """The installed Lightning's version string."""
    import lightning

    return str(lightning.__version__)


def _release(version: str) -> tuple[int, ...]:
    """``"2.6.0rc1"`` -> ``(2, 6, 0)``: the leading numeric release (pre-release tags are ignored)."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in match.group(0).split("."))


def version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed Lightning) lies in ``SUPPORTED``."""
    release = _release(version or lightning_version())
    return _release(LIGHTNING_MIN) <= release < _release(LIGHTNING_BELOW)


def _missing(where: str) -> LightningCompatError:
    return LightningCompatError(
        f"lightning {lightning_version()} has no {where}, which nats needs (nats.lightning_compat); "
        f"supported: {SUPPORTED}, tested with {LIGHTNING_MAX_TESTED}"
    )


def _get(obj: Any, name: str, where: str) -> Any:
    """``getattr(obj, name)``, or the clear error naming ``where``."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(where) from None


def _epoch_loop(trainer: Any) -> Any:
    return _get(_get(trainer, "fit_loop", "Trainer.fit_loop"), "epoch_loop", "Trainer.fit_loop.epoch_loop")


def _has_batches_that_stepped(loop: Any) -> None:
    if not hasattr(loop, "_batches_that_stepped"):
        raise _missing("Trainer.fit_loop.epoch_loop._batches_that_stepped")


def should_accumulate(trainer: Any) -> bool:
    """``trainer.fit_loop._should_accumulate()``: whether the current training batch only accumulates gradients
    (no optimizer step at its end). `InterruptCheckpoint` defers a stop requested in mid-step to the step's end (a
    checkpoint in mid-accumulation would not resume exactly), and `ThroughputMonitor` takes its timing point at
    the end of an optimizer step, where Lightning computes the rates."""
    fit_loop = _get(trainer, "fit_loop", "Trainer.fit_loop")
    return bool(_get(fit_loop, "_should_accumulate", "Trainer.fit_loop._should_accumulate()")())


def should_update_logs(trainer: Any) -> bool:
    """``trainer._logger_connector.should_update_logs``: whether Lightning writes this step's logs
    (``log_every_n_steps``, a stopping trainer), the test its own LearningRateMonitor and ThroughputMonitor use.
    The project computes and stages its costlier metrics only on those steps (`nats.lit.logs_written_now`), and
    `ThroughputMonitor` times its rates there."""
    connector = _get(trainer, "_logger_connector", "Trainer._logger_connector")
    if not hasattr(type(connector), "should_update_logs"):
        raise _missing("Trainer._logger_connector.should_update_logs")
    return bool(connector.should_update_logs)


def received_sigterm(trainer: Any) -> bool:
    """``trainer._signal_connector.received_sigterm``: the flag that Lightning's SIGTERM handler raises and its
    training loop reads at the end of every batch (it then stops, raising ``SIGTERMException``).
    `InterruptCheckpoint` reads it to move a stop requested in mid-accumulation to the end of the step."""
    connector = _get(trainer, "_signal_connector", "Trainer._signal_connector")
    return bool(_get(connector, "received_sigterm", "Trainer._signal_connector.received_sigterm"))


def set_received_sigterm(trainer: Any, value: bool = True) -> None:
    """Write ``trainer._signal_connector.received_sigterm``: stop the fit at the end of the current batch as
    SIGTERM does (`InterruptCheckpoint`: Ctrl-C and SLURM's requeue signal; ``False``: lower the flag to defer the
    stop). The attribute must exist already: writing a new one would be silently ignored by Lightning."""
    connector = _get(trainer, "_signal_connector", "Trainer._signal_connector")
    if not hasattr(connector, "received_sigterm"):
        raise _missing("Trainer._signal_connector.received_sigterm")
    connector.received_sigterm = bool(value)


def batches_that_stepped(trainer: Any) -> int:
    """``trainer.fit_loop.epoch_loop._batches_that_stepped``: the count of optimizer steps that Lightning's logs
    carry as their step (it differs from ``global_step`` with several optimizers and around validation). The
    project stages its per-layer statistics under it, so that they are written at the step Lightning writes the
    rest (`nats.lit`)."""
    loop = _epoch_loop(trainer)
    _has_batches_that_stepped(loop)
    return int(loop._batches_that_stepped)


@contextmanager
def batches_that_stepped_shifted(trainer: Any, shift: int) -> Iterator[None]:
    """Lower ``trainer.fit_loop.epoch_loop._batches_that_stepped`` by ``shift`` inside the block, restored after it
    (even on an error). `InterruptCheckpoint` saves a run stopped by SIGTERM right after a validation this way:
    Lightning resumes a checkpoint of a step that validated by counting that step once more (it expects the count
    from before, as a checkpoint saved at the validation's end has it), which would shift the resumed run's logged
    steps by one."""
    loop = _epoch_loop(trainer)
    _has_batches_that_stepped(loop)
    loop._batches_that_stepped -= shift
    try:
        yield
    finally:
        loop._batches_that_stepped += shift


def attached_trainer(module: Any) -> Any:
    """``module._trainer``: the Trainer a LightningModule is attached to, or None. The public ``module.trainer``
    raises when there is none; the project's modules also run bare (tests, benchmarks, evaluation), and then
    skip what only a fit needs."""
    return _get(module, "_trainer", "LightningModule._trainer")


def check_version(version: str | None = None) -> bool:
    """Warn when ``version`` (default: the installed Lightning) lies outside ``SUPPORTED``; returns whether it
    lies inside. A release past the range may still work: `check_lightning` then finds whether the attributes are
    where this module expects them."""
    version = version or lightning_version()
    ok = version_supported(version)
    if not ok:
        warnings.warn(
            f"lightning {version} is outside the range nats supports ({SUPPORTED}, tested with "
            f"{LIGHTNING_MAX_TESTED}): nats.lightning_compat reaches private attributes that may have moved",
            stacklevel=2,
        )
    return ok


def check_lightning(trainer: Any) -> None:
    """Find every attribute this module reaches on ``trainer`` (a new Trainer: nothing is run or changed), after
    `check_version`. Raises `LightningCompatError` for the first one missing."""
    check_version()
    fit_loop = _get(trainer, "fit_loop", "Trainer.fit_loop")
    if not callable(getattr(fit_loop, "_should_accumulate", None)):
        raise _missing("Trainer.fit_loop._should_accumulate()")
    if not hasattr(type(_get(trainer, "_logger_connector", "Trainer._logger_connector")), "should_update_logs"):
        raise _missing("Trainer._logger_connector.should_update_logs")
    received_sigterm(trainer)
    _has_batches_that_stepped(_epoch_loop(trainer))
