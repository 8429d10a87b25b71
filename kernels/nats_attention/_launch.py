"""Repeated launches of one compiled Triton kernel without Triton's Python launcher.

``kernel[grid](*args)`` runs Triton's launcher in Python at every call: it binds the arguments, works out their
specialisation (dtypes, 16-byte alignment, divisibility and size of the integers), builds the cache key, looks the
compiled kernel up and then calls the binary's launcher. On an H100 host the cache's pool write (one allocation, one
launch) took 52.6 us of host time per call through Triton's launcher and 28.1 launched directly
(``python benchmarks/bench_hf_host.py --prompt 8192``, its pieces table). A batch-1 prefill is bound by its host
time, and NAtS' makes four Triton launches per layer.

`Bound` takes its first launch through Triton (which compiles or autotunes, and launches), keeps the compiled kernel
and calls the binary's launcher directly afterwards. It serves calls whose arguments differ only in their tensors'
data: the same dtypes, shapes, strides and integers, tensors aligned alike (as the layers of one prefill, which
`prefill_cache.PrefillKernels` checks before it uses its `Bound` launches); Triton's specialisation is then the
first call's. Where direct launching does not apply (Triton's interpreter, a Triton without ``triton.knobs``, or a
launch hook installed, e.g. by a profiler) every call goes through Triton's launcher.
"""

from __future__ import annotations

from ._env import INTERPRET, triton

try:
    from triton import knobs as _knobs
    from triton.runtime.autotuner import Autotuner as _Autotuner
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # Triton < 3.4: no direct launches
    _knobs = _driver = None


def _hooked() -> bool:
    """Whether a launch hook is installed (then Triton's launcher must run: it calls the hooks)."""
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Bound:
    """``fn[grid](*args, **meta)`` for repeated calls with arguments of the same kinds (module docstring).

    ``fn``: a ``@triton.jit`` function or an ``@triton.autotune`` over one; ``grid``: a tuple, or a function of the
    meta-parameters (``meta`` and the chosen autotune config's); ``meta``: the constexpr parameters and launch
    options (``num_warps``), fixed for every call. ``bound(*args)`` launches with the non-constexpr arguments, in
    the kernel's order."""

    def __init__(self, fn, grid, **meta):
        self.fn, self.grid, self.meta = fn, grid, meta
        self._kernel = None  # the compiled kernel, after the first launch, where direct launches apply
        self._direct = not INTERPRET and _knobs is not None

    def __call__(self, *args) -> None:
        kernel = self._kernel
        if kernel is None or _hooked():
            self._first(args)
            return
        kernel.run(*self._grid, self._stream(self._device), kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *self._tail)  # fmt: skip

    def _first(self, args) -> None:
        kernel = self.fn[self.grid](*args, **self.meta)
        if not self._direct or self._kernel is not None or kernel is None or _hooked():
            return
        jit, config = self.fn, {}
        if isinstance(jit, _Autotuner):  # the config it chose (for these arguments' autotune key)
            config, jit = dict(jit.best_config.kwargs), jit.fn
        if not isinstance(jit, _JITFunction):  # e.g. heuristics, which choose per call: keep Triton's launcher
            self._direct = False
            return
        names = jit.arg_names
        full = {**self.meta, **config}
        if len(args) > len(names) or any(n not in full for n in names[len(args) :]):
            self._direct = False  # defaults or unexpected parameters: keep Triton's launcher
            return
        self._tail = tuple(full[n] for n in names[len(args) :])
        grid = self.grid(full) if callable(self.grid) else tuple(self.grid)
        self._grid = (*grid, 1, 1)[:3]
        self._device = _driver.active.get_current_device()
        self._stream = _driver.active.get_current_stream
        self._kernel = kernel


__all__ = ["Bound", "triton"]
