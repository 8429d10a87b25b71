"""Repeated launches of one compiled Triton kernel without Triton's Python launcher.

``kernel[grid](*args)`` runs Triton's launcher in Python at every call: it binds the arguments, works out their
specialisation (dtypes, 16-byte alignment, divisibility and size of the integers), builds the cache key, looks the
compiled kernel up and then calls the binary's launcher. On an H100 host the cache's pool write (one allocation, one
launch) took 52.6 us of host time per call through Triton's launcher and 28.1 launched directly
(``python benchmarks/bench_hf_host.py --prompt 8192``, its pieces table). A
batch-1 prefill is bound by its host time, and NAtS' makes four Triton launches per layer.

`Bound` takes its first launch through Triton (which compiles or autotunes, and launches), keeps the compiled kernel
and calls the binary's launcher directly afterwards. It serves calls whose arguments differ only in their tensors'
data: the same dtypes, shapes, strides and integers, tensors aligned alike (as the layers of one prefill, which
`prefill_cache.PrefillKernels` checks before it uses its `Bound` launches); Triton's specialisation is then the
first call's.

The direct call uses Triton's private API: the compiled kernel's ``run`` (the binary's launcher) called with the
positional arguments Triton's own launcher (``JITFunction.run``) passes, ``Autotuner.best_config``,
``driver.active``. It is used only with a Triton in the range it was written against (`TESTED_TRITON`: 3.4 to 3.9;
``pyproject.toml`` bounds Triton below 3.10 too); with any other version every call goes through Triton's launcher
and one warning says why. Within that range, at its first direct launch `Bound` checks (`mismatch`) what can be
checked without reading Triton's source: the binary launcher takes the grid, stream, function and metadata before
the kernel's arguments (its signature), the compiled kernel expects as many arguments as `Bound` passes and every
private attribute used is there. Where anything differs, or a direct call raises, every later call of that `Bound`
goes through Triton's launcher (same results, the host time of Triton's launcher) and the reason is logged once
(logger ``nats_kernels``). Every call goes through Triton's launcher too under Triton's interpreter, with a Triton
without ``triton.knobs`` (before 3.4), with a launch hook installed (e.g. by a profiler), or with
``NATS_KERNELS_DIRECT_LAUNCH=0`` (read at import; `DIRECT`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re

from ._env import INTERPRET, triton

try:
    from triton import knobs as _knobs
    from triton.runtime.autotuner import Autotuner as _Autotuner
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # Triton < 3.4: no direct launches
    _knobs = _driver = _Autotuner = _JITFunction = None

log = logging.getLogger("nats_kernels")

# NATS_KERNELS_DIRECT_LAUNCH=0: every launch goes through Triton's launcher (e.g. to time both, or if a Triton
# version misbehaves in a way the checks do not see)
DIRECT = os.environ.get("NATS_KERNELS_DIRECT_LAUNCH", "1") != "0"

# The direct launch stays rather than torch.library.triton_op / wrap_triton or Triton's public launcher: those run
# Triton's Python launcher at every call (the host time measured above, 52.6 against 28.1 us); their cost in this
# path has not been measured on a GPU against the direct launch's, so there is no figure yet to trade it for.
#
# The Triton versions the direct call was written against: from 3.4 (the first with triton.knobs, whose runtime
# hooks Triton's launcher passes to the binary's launcher) to 3.9, as [lowest, first not tested). Their launcher
# (JITFunction.run), as read in their sources when the direct call was written, calls
#     kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
#                knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())
# which `Bound.__call__` repeats with its own grid, stream, no launch metadata and no hooks. 3.6 ran the direct
# launch on the GPUs, 3.9 in the CPU interpreter (where launches go through Triton's launcher, but its
# JITFunction.run makes that call and its CUDA launcher has the signature `launcher_mismatch` accepts). The range is
# a version check, not a reading of Triton's source: a newer Triton may call its launcher differently in ways no
# signature shows, so it gets Triton's own launcher until it is tested and the range (and pyproject.toml's bound,
# <3.10) moved.
TESTED_TRITON = ((3, 4), (3, 10))
TRITON_VERSION = getattr(triton, "__version__", "?")
# the binary launcher's (``kernel.run``'s) leading parameters: (grid x, y, z, stream, function, *args) in
# Triton 3.4-3.6's CUDA launcher, the same plus (metadata, launch metadata, enter hook, exit hook) in later ones
LAUNCHER_HEAD = ("gridx", "gridy", "gridz", "stream", "function")
LAUNCHER_PARAMS = (5, 9)

_logged: set[str] = set()


def triton_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string ("3.6.0", "3.10.0+git1234"); None where it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def version_mismatch(version: str) -> str | None:
    """Why Triton ``version`` is outside `TESTED_TRITON`, the versions the direct launch was written against (None:
    it is inside)."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TRITON
    tested = f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    parsed = triton_version(version)
    if parsed is None:
        return f"Triton's version {version!r} cannot be read (direct launches are tested with Triton {tested})"
    if not TESTED_TRITON[0] <= parsed < TESTED_TRITON[1]:
        return f"Triton {version} is outside the versions direct launches are tested with ({tested})"
    return None


def _say(reason: str, level: int = logging.WARNING) -> None:
    """Log why launches go through Triton's launcher, once per reason and process."""
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "Triton kernels are launched through Triton's launcher, not directly: %s", reason)


@functools.cache
def triton_mismatch() -> str | None:
    """Why the installed Triton does not take direct launches (None: it does), checked once: its version outside
    `TESTED_TRITON`, or no ``triton.knobs`` with the launch hooks."""
    reason = version_mismatch(TRITON_VERSION)
    if reason is not None:
        return reason
    if _knobs is None:
        return f"Triton {TRITON_VERSION} has no triton.knobs (direct launches need 3.4 or later)"
    runtime = getattr(_knobs, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        if not hasattr(runtime, name):
            return f"Triton {TRITON_VERSION} has no triton.knobs.runtime.{name}"
    return None


def launcher_mismatch(run) -> str | None:
    """Why a compiled kernel's binary launcher (``kernel.run``) does not take (grid x, y, z, stream, function, ...,
    *args) as `Bound` passes them (None: it does)."""
    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError) as e:
        return f"the compiled kernel's launcher has no readable signature ({e})"
    positional = [p.name.lower() for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = any(p.kind is p.VAR_POSITIONAL for p in params)
    if not rest or len(positional) not in LAUNCHER_PARAMS or tuple(positional[:5]) != LAUNCHER_HEAD:
        return f"the compiled kernel's launcher takes ({', '.join(str(p) for p in params)})"
    return None


def mismatch(kernel, n_args: int) -> str | None:
    """Why `Bound` should not launch ``kernel`` (a compiled kernel taking ``n_args`` arguments) directly: the
    installed Triton (`triton_mismatch`), a missing private attribute, the launcher's signature or the number of
    arguments. None where the direct launch matches Triton's."""
    reason = triton_mismatch()
    if reason is not None:
        return reason
    missing = [a for a in ("run", "function", "packed_metadata") if not hasattr(kernel, a)]
    if missing:
        return f"the compiled kernel has no {', '.join(missing)}"
    for name in ("get_current_device", "get_current_stream"):
        if not callable(getattr(_driver.active, name, None)):
            return f"Triton's active driver has no {name}"
    reason = launcher_mismatch(kernel.run)
    if reason is not None:
        return reason
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if isinstance(signature, dict) and len(signature) != n_args:
        return f"the compiled kernel takes {len(signature)} arguments, {n_args} would be passed"
    return None


def _hooked() -> bool:
    """Whether a launch hook is installed (then Triton's launcher must run: it calls the hooks)."""
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Bound:
    """``fn[grid](*args, **meta)`` for repeated calls with arguments of the same kinds (module docstring).

    ``fn``: a ``@triton.jit`` function or an ``@triton.autotune`` over one; ``grid``: a tuple, or a function of the
    meta-parameters (``meta`` and the chosen autotune config's); ``meta``: the constexpr parameters and launch
    options (``num_warps``), fixed for every call. ``bound(*args)`` launches with the non-constexpr arguments, in
    the kernel's order. ``direct``: False launches every call through Triton's launcher; None (the default) follows
    `DIRECT`. After the first call, `direct` says whether later calls launch directly and `reason` why not."""

    def __init__(self, fn, grid, *, direct: bool | None = None, **meta):
        self.fn, self.grid, self.meta = fn, grid, meta
        self._kernel = None  # the compiled kernel, after the first launch, where direct launches apply
        # a Triton without knobs (< 3.4) is left to `triton_mismatch` at the first call, which says why once
        self._direct = (DIRECT if direct is None else direct) and not INTERPRET
        self.reason: str | None = None  # why calls go through Triton's launcher, where a check or a call failed

    @property
    def direct(self) -> bool:
        """Whether calls after the first launch the compiled kernel directly."""
        return self._kernel is not None

    def __call__(self, *args) -> None:
        kernel = self._kernel
        if kernel is None or _hooked():
            self._first(args)
            return
        try:
            kernel.run(*self._grid, self._stream(self._device), kernel.function, kernel.packed_metadata, None, None,
                       None, *args, *self._tail)  # fmt: skip
        except Exception as e:  # noqa: BLE001  (Triton's launcher below raises again if the launch itself fails)
            self._fall_back(f"a direct launch raised {type(e).__name__}: {e}")
            self.fn[self.grid](*args, **self.meta)

    def _fall_back(self, reason: str) -> None:
        self._kernel, self._direct, self.reason = None, False, reason
        _say(reason)

    def _first(self, args) -> None:
        kernel = self.fn[self.grid](*args, **self.meta)
        if not self._direct or self._kernel is not None or kernel is None:
            return
        reason = triton_mismatch()
        if reason is not None:
            self._fall_back(reason)
            return
        if _hooked():
            return
        jit, config = self.fn, {}
        if isinstance(jit, _Autotuner):  # the config it chose (for these arguments' autotune key)
            best = getattr(jit, "best_config", None)
            if not isinstance(getattr(best, "kwargs", None), dict):
                self._fall_back("the autotuner has no best_config with its kwargs")
                return
            config, jit = dict(best.kwargs), jit.fn
        if not isinstance(jit, _JITFunction):  # e.g. heuristics, which choose per call: keep Triton's launcher
            self._direct = False
            return
        names = jit.arg_names
        full = {**self.meta, **config}
        if len(args) > len(names) or any(n not in full for n in names[len(args) :]):
            self._direct = False  # defaults or unexpected parameters: keep Triton's launcher
            return
        reason = mismatch(kernel, len(names))
        if reason is not None:
            self._fall_back(reason)
            return
        self._tail = tuple(full[n] for n in names[len(args) :])
        grid = self.grid(full) if callable(self.grid) else tuple(self.grid)
        self._grid = (*grid, 1, 1)[:3]
        self._device = _driver.active.get_current_device()
        self._stream = _driver.active.get_current_stream
        self._kernel = kernel


__all__ = [
    "DIRECT",
    "TESTED_TRITON",
    "Bound",
    "launcher_mismatch",
    "mismatch",
    "triton",
    "triton_mismatch",
    "triton_version",
    "version_mismatch",
]
