"""Direct launches of compiled Triton kernels (`nats_kernels.nats_attention._launch.Bound`) and their fallback to
Triton's launcher.

The direct path needs a GPU (under Triton's CPU interpreter every call takes Triton's launcher), so on the CPU the
decision is tested with stand-ins for Triton's pieces: a launcher written like Triton's (``FakeJit.run`` calls the
compiled kernel as ``JITFunction.run`` does), a compiled kernel whose binary launcher computes on CPU tensors, the
driver and the knobs, and the Triton version (`_launch.TRITON_VERSION`): inside the tested range the launches go
direct, outside it through Triton's launcher with one warning. The installed Triton is checked for real (its
version in the range, the CUDA launcher's signature), and the ``gpu`` tests run the real direct path against
Triton's launcher, then force a mismatch and a failing direct call.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from nats_kernels.nats_attention import _launch

HAS_CUDA = torch.cuda.is_available()

# Triton's runtime switches as the fake launcher reads them (``knobs.runtime`` hooks), patched into _launch
knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7))


class Launcher:
    """A compiled kernel's binary launcher with the parameters of Triton 3.9's CUDA launcher: out[:n] = x[:n] *
    SCALE + grid x (the grid shows that the direct call passes it)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):  # fmt: skip
        assert (stream, function, kernel_metadata) == (7, "function", "metadata")
        self.calls += 1
        x, out, n, scale = args
        out[:n] = x[:n] * scale + gridX


class OldLauncher(Launcher):
    """Triton 3.4-3.6's launcher parameters: (grid, stream, function, *args)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        super().__call__(gridX, gridY, gridZ, stream, function, *args)


class Compiled:
    def __init__(self, launcher, n_args=4):
        self.run, self.function, self.packed_metadata = launcher, "function", "metadata"
        self.src = SimpleNamespace(signature={f"a{i}": "i32" for i in range(n_args)})


class FakeJit:
    """A ``@triton.jit`` function: ``fn[grid](*args, **constexprs)`` goes through `run`, written like Triton's
    launcher (``JITFunction.run``) in the tested versions."""

    arg_names = ["X", "OUT", "n", "SCALE"]

    def __init__(self, kernel=None):
        self.kernel = kernel or Compiled(Launcher())
        self.launches = 0  # calls through this (Triton's) launcher

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def run(self, *args, grid, **kwargs):
        self.launches += 1
        kernel = self.kernel
        bound_args = dict(zip(self.arg_names, (*args, *(kwargs[n] for n in self.arg_names[len(args) :]))))
        if callable(grid):
            grid = grid(bound_args)
        grid_0, grid_1, grid_2 = (*grid, 1, 1)[:3]
        stream, launch_metadata = 7, {"launched by": "Triton"}  # (a direct call passes None)
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())  # fmt: skip
        return kernel


class FakeAutotuner:
    """``@triton.autotune`` over a FakeJit: its chosen config sets SCALE."""

    def __init__(self, fn, scale):
        self.fn, self.best_config = fn, SimpleNamespace(kwargs={"SCALE": scale})

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn[grid](*args, **kwargs, **self.best_config.kwargs)


@pytest.fixture
def fake_triton(monkeypatch):
    """_launch with the stand-ins for Triton's launcher, driver and knobs, outside the interpreter."""
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "TRITON_VERSION", "3.6.0")  # a tested version, whatever is installed
    monkeypatch.setattr(_launch, "DIRECT", True)
    monkeypatch.setattr(_launch, "_knobs", knobs)
    monkeypatch.setattr(_launch, "_driver", driver)
    monkeypatch.setattr(_launch, "_JITFunction", FakeJit)
    monkeypatch.setattr(_launch, "_Autotuner", FakeAutotuner)
    monkeypatch.setattr(_launch, "_logged", set())
    _launch.triton_mismatch.cache_clear()
    yield
    _launch.triton_mismatch.cache_clear()


def calls(bound, n_calls=4, n=5):
    """Outputs of n_calls launches on fresh tensors (what a prefill's layers do), and their expected values."""
    got, want = [], []
    for i in range(n_calls):
        x = torch.arange(8, dtype=torch.float32) + i
        out = torch.zeros(8)
        bound(x, out, n)
        got.append(out)
        want.append(torch.cat([x[:n] * 2.0 + 3, torch.zeros(8 - n)]))
    return got, want


def test_installed_triton_launches_as_bound_does():
    """The installed Triton is in the tested range, and its CUDA launcher takes the grid, stream and function first
    (the class is read, not run: no GPU needed)."""
    if _launch._knobs is None:
        pytest.skip("Triton < 3.4: no direct launches")
    assert _launch.TRITON_VERSION == _launch.triton.__version__
    _launch.triton_mismatch.cache_clear()
    assert _launch.triton_mismatch() is None
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    assert _launch.launcher_mismatch(object.__new__(nvidia.CudaLauncher)) is None


IN_RANGE = ["3.4.0", "3.5.1", "3.6.0", "3.9.0", "3.9.1+git0123abcd", "3.8.0rc1"]
OUT_OF_RANGE = ["3.3.1", "3.10.0", "3.10.0+git0123abcd", "4.0.0", "2.3.1", "", "unknown"]


def test_the_tested_range_is_3_4_to_3_9():
    """The range the direct launch was written against (_launch's comment), and pyproject.toml's bound above it."""
    assert _launch.TESTED_TRITON == ((3, 4), (3, 10))
    assert _launch.triton_version("3.10.2+git1") == (3, 10) and _launch.triton_version("x3.6") is None


@pytest.mark.parametrize("version", IN_RANGE + OUT_OF_RANGE)
def test_version_mismatch_is_the_tested_range(version):
    reason = _launch.version_mismatch(version)
    if version in IN_RANGE:
        assert reason is None
    else:
        assert reason is not None and ">=3.4,<3.10" in reason and version in reason


def launched(caplog) -> tuple[FakeJit, _launch.Bound]:
    """A `Bound` of a fake kernel called four times (`calls`), its results those of the kernel itself; the log of
    the ``nats_kernels`` logger in ``caplog``."""
    jit = FakeJit()
    with caplog.at_level(logging.INFO, logger="nats_kernels"):
        bound = _launch.Bound(jit, (3,), SCALE=2.0)
        got, want = calls(bound)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    return jit, bound


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.9.0"])
def test_a_tested_version_launches_directly(fake_triton, monkeypatch, version, caplog):
    monkeypatch.setattr(_launch, "TRITON_VERSION", version)
    jit, bound = launched(caplog)
    assert jit.launches == 1 and jit.kernel.run.calls == 4 and bound.direct and bound.reason is None
    assert not caplog.records


@pytest.mark.parametrize("version", ["3.3.1", "3.10.0", "4.0.0", "unknown"])
def test_an_untested_version_keeps_tritons_launcher(fake_triton, monkeypatch, version, caplog):
    """Outside the tested range: every call through Triton's launcher, the same results, one warning naming the
    version and the range however many launches and `Bound`s."""
    monkeypatch.setattr(_launch, "TRITON_VERSION", version)
    for _ in range(2):
        jit, bound = launched(caplog)
        assert jit.launches == 4 and jit.kernel.run.calls == 4 and not bound.direct
        assert version in bound.reason and ">=3.4,<3.10" in bound.reason
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    message = caplog.records[0].getMessage()
    assert version in message and "launched through Triton's launcher" in message


def test_a_triton_without_knobs_keeps_tritons_launcher(fake_triton, monkeypatch, caplog):
    """A Triton reporting a tested version but without triton.knobs (its imports failed): Triton's launcher, said
    once."""
    monkeypatch.setattr(_launch, "_knobs", None)
    jit, bound = launched(caplog)
    assert jit.launches == 4 and not bound.direct and "triton.knobs" in bound.reason
    assert len(caplog.records) == 1


@pytest.mark.parametrize("launcher", [Launcher, OldLauncher])
def test_bound_launches_directly_after_the_first_call(fake_triton, launcher, caplog):
    jit = FakeJit(Compiled(launcher()))
    bound = _launch.Bound(jit, (3,), SCALE=2.0)
    with caplog.at_level(logging.INFO, logger="nats_kernels"):
        got, want = calls(bound)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert jit.launches == 1 and jit.kernel.run.calls == 4  # one through Triton, three direct
    assert bound.direct and bound.reason is None and not caplog.records


def test_bound_takes_the_autotuners_choice(fake_triton):
    jit = FakeJit()
    bound = _launch.Bound(FakeAutotuner(jit, 2.0), lambda meta: (int(meta["SCALE"]) + 1,))
    got, want = calls(bound)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # SCALE from the config, grid 3 from it
    assert jit.launches == 1 and bound.direct


class NoHooks(Launcher):
    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
        super().__call__(gridX, gridY, gridZ, stream, function, kernel_metadata, *args)


class Swapped(Launcher):
    """Parameters named in another order (a launcher the checks do not know; Triton's own call still works)."""

    def __call__(self, gridX, gridY, gridZ, function, stream, *args):
        super().__call__(gridX, gridY, gridZ, function, stream, *args)


class Raising(Launcher):
    """A launcher whose direct calls raise (Triton's launcher passes launch metadata, a direct call None)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):  # fmt: skip
        if launch_metadata is None:
            raise TypeError("function takes 12 arguments, 13 given")
        super().__call__(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                         launch_exit_hook, *args)  # fmt: skip


class NoMetadata(Compiled):
    """A compiled kernel without ``packed_metadata`` (Triton's launcher, changed too, passes it otherwise)."""

    def __init__(self):
        super().__init__(Launcher())
        del self.packed_metadata

    def __getattr__(self, name):
        if name == "packed_metadata" and sys._getframe(1).f_code.co_name == "run":  # Triton's launcher
            return "metadata"
        raise AttributeError(name)


MISMATCHES = {
    # what differs: (the jit function, the reason's words)
    "launcher without the hooks": (lambda: FakeJit(Compiled(NoHooks())), "launcher takes"),
    "launcher's stream and function swapped": (lambda: FakeJit(Compiled(Swapped())), "launcher takes"),
    "kernel expecting more arguments": (lambda: FakeJit(Compiled(Launcher(), n_args=5)), "5 arguments, 4"),
}


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_a_mismatch_keeps_tritons_launcher(fake_triton, what, caplog):
    """Anything that differs from what the direct call assumes: every call through Triton's launcher, the same
    results, the reason logged once however many launches and `Bound`s."""
    make, words = MISMATCHES[what]
    with caplog.at_level(logging.INFO, logger="nats_kernels"):
        for _ in range(2):
            jit = make()
            bound = _launch.Bound(jit, (3,), SCALE=2.0)
            got, want = calls(bound)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            assert jit.launches == 4 and not bound.direct and words in bound.reason
    assert len(caplog.records) == 1 and words in caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.WARNING


class NoBestConfig(FakeAutotuner):
    """An autotuner without ``best_config`` (a Triton that keeps its choice elsewhere)."""

    def __init__(self, fn, scale):
        self.fn, self.scale = fn, scale

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn[grid](*args, **kwargs, SCALE=self.scale)


def test_a_missing_private_attribute_keeps_tritons_launcher(fake_triton, monkeypatch):
    bound = _launch.Bound(FakeJit(NoMetadata()), (3,), SCALE=2.0)
    calls(bound, n_calls=2)
    assert bound.fn.launches == 2 and not bound.direct and "packed_metadata" in bound.reason
    monkeypatch.setattr(_launch, "_Autotuner", NoBestConfig)
    jit = FakeJit()
    bound = _launch.Bound(NoBestConfig(jit, 2.0), (3,))
    got, want = calls(bound)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert jit.launches == 4 and not bound.direct and "best_config" in bound.reason


def test_a_raising_direct_call_falls_back(fake_triton, caplog):
    jit = FakeJit(Compiled(Raising()))
    bound = _launch.Bound(jit, (3,), SCALE=2.0)
    with caplog.at_level(logging.INFO, logger="nats_kernels"):
        got, want = calls(bound)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # the failed call relaunched through Triton's
    assert jit.launches == 4 and not bound.direct and "TypeError" in bound.reason
    assert len(caplog.records) == 1


def test_direct_launches_can_be_switched_off(fake_triton, monkeypatch):
    for bound in (_launch.Bound(FakeJit(), (3,), direct=False, SCALE=2.0), None):
        if bound is None:
            monkeypatch.setattr(_launch, "DIRECT", False)
            bound = _launch.Bound(FakeJit(), (3,), SCALE=2.0)
        got, want = calls(bound)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert bound.fn.launches == 4 and not bound.direct and bound.reason is None
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook
    bound = _launch.Bound(FakeJit(), (3,), SCALE=2.0)
    calls(bound)
    assert bound.fn.launches == 4


def test_the_switch_is_read_from_the_environment():
    code = "from nats_kernels.nats_attention import _launch; print(_launch.DIRECT)"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "NATS_KERNELS_DIRECT_LAUNCH": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


# the settings nats_kernels.configure_triton() makes, removed so that the child starts without them (the tests'
# own process has them: conftest.py)
TRITON_SETTINGS = ("TRITON_INTERPRET", "TRITON_CACHE_DIR")
ENV_DIFF = """
import os, json
before = dict(os.environ)
{action}
after = dict(os.environ)
print(json.dumps({{k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after))
                   if before.get(k) != after.get(k)}}))
"""


def _env_change(action: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TRITON_SETTINGS}
    code = ENV_DIFF.format(action=action)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_kernels_changes_no_environment_variable():
    """Importing nats_kernels (and its op packages) leaves os.environ as it was: Triton's settings are made by the
    explicit nats_kernels.configure_triton(), which the console scripts call (nats.cli.guarded)."""
    assert _env_change("import nats_kernels, nats_kernels.nats_attention, nats_kernels.cross_entropy") == {}


def test_configure_triton_makes_the_settings():
    """configure_triton(): the interpreter without a CUDA GPU (else Triton's own cache folder); again, no change."""
    change = _env_change("import nats_kernels; nats_kernels.configure_triton(); nats_kernels.configure_triton()")
    if HAS_CUDA:
        assert set(change) == {"TRITON_CACHE_DIR"}
    else:
        assert change == {"TRITON_INTERPRET": [None, "1"]}


# ---- the real path, on a GPU ----


def _layer(n=3000, D=64, B=2, Hq=6, H=3, seed=0):
    """A NAtS layer's prefill inputs in transformers' layouts (as tests/test_hf_static_cache.py)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2) for h in (Hq, H, H))
    logits = (torch.randn(B, n, 3 * H, generator=g) * 2).to("cuda", torch.bfloat16).view(B, n, H, 3).transpose(1, 2)
    return q, k, v, logits


def _prefill(kernels, q, k, v, logits, bias):
    o, types, rows, end, ring, valid, last_g = kernels.attend(q, k, v, logits, bias)
    pool = kernels.pool(types, k, v, rows, last_g, int(end) + 3)
    return o, types, rows, end, ring, valid, last_g, pool


def _bounds(kernels):
    return kernels._plan, kernels._fwd, kernels._rows, kernels._pool


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_direct_launches_equal_tritons_launcher_on_the_gpu(monkeypatch, caplog):
    """The real direct path (the installed Triton passes the checks) gives what Triton's launcher gives, layer after
    layer; then a forced mismatch (a launcher signature the checks do not know) and a direct call that raises fall
    back to Triton's launcher with the same results, the reason logged."""
    from nats_kernels.nats_attention.prefill_cache import PrefillKernels

    assert _launch.triton_mismatch() is None, _launch.triton_mismatch()
    bias = torch.tensor([0.0, 0.5, 1.0], device="cuda", dtype=torch.bfloat16)
    W, new = 8, 5
    layers = [_layer(seed=s) for s in range(3)]
    key = PrefillKernels.key(*layers[0], bias, W, new)
    monkeypatch.setattr(_launch, "_logged", set())
    direct, through = PrefillKernels(key), PrefillKernels(key)
    for b in _bounds(through):
        b._direct = False
    for layer in layers:
        a, b = _prefill(direct, *layer, bias), _prefill(through, *layer, bias)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(b.direct for b in _bounds(direct)) and not any(b.direct for b in _bounds(through))

    want = [_prefill(through, *layer, bias) for layer in layers]
    monkeypatch.setattr(_launch, "LAUNCHER_PARAMS", (99,))  # a launcher unlike any tested
    with caplog.at_level(logging.INFO, logger="nats_kernels"):
        mismatched = PrefillKernels(key)
        got = [_prefill(mismatched, *layer, bias) for layer in layers]
    assert all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))
    assert not any(b.direct for b in _bounds(mismatched)) and "launcher takes" in mismatched._pool.reason
    assert sum("launcher takes" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(_launch, "LAUNCHER_PARAMS", (5, 9))

    raising = PrefillKernels(key)
    _prefill(raising, *layers[0], bias)
    for b in _bounds(raising):
        compiled = b._kernel
        b._kernel = SimpleNamespace(
            run=lambda *a: (_ for _ in ()).throw(RuntimeError("launcher changed")),
            function=compiled.function,
            packed_metadata=compiled.packed_metadata,
        )
    got = [_prefill(raising, *layer, bias) for layer in layers]
    assert all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))
    assert all("launcher changed" in b.reason for b in _bounds(raising))
