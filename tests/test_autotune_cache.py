"""The kernels' autotune choices kept across processes (`nats_kernels.nats_attention._env.autotune`): the project's
file in Triton's cache folder, whatever the Triton; the one
line a tuning process prints; the cache folder kept out of torch.compile's temporary one. On the CPU (the kernels
then run in Triton's interpreter, which never tunes) with a stand-in for Triton's autotuner;
``benchmarks/bench_first_step.py`` measures the first step of two runs on a GPU."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

import nats_kernels
from nats_kernels.nats_attention import _env


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(_env, "_announced", False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(_env, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    return tmp_path


def test_the_first_tuning_of_a_process_is_said_once(fresh, capsys):
    _env.announce_tuning()
    _env.announce_tuning()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    line = err[0]
    assert line.startswith("nats: tuning the Triton kernels for NVIDIA H100 80GB HBM3 (first run on this GPU")
    assert _env.triton.__version__ in line and _env.TUNING_TIME in line and str(fresh / "triton") in line


def test_the_options_follow_the_installed_triton():
    """The project's file keeps the choices whatever the Triton (not Triton's cache_results, which missed them
    across torch.compile'd runs); the benchmark announced where ``do_bench`` can be given;
    NATS_KERNELS_AUTOTUNE_CACHE=0 keeps nothing."""
    new, old, older = {"do_bench", "cache_results"}, {"do_bench"}, set()
    assert _env.autotune_options(new, keep=True) == ({"do_bench": _env._announcing_bench}, True)
    assert _env.autotune_options(old, keep=True) == ({"do_bench": _env._announcing_bench}, True)
    assert _env.autotune_options(older, keep=True) == ({}, True)
    assert _env.autotune_options(new, keep=False) == ({"do_bench": _env._announcing_bench}, False)
    assert _env.autotune_options(older, keep=False) == ({}, False)
    installed = inspect.signature(_env.triton.autotune).parameters
    if tuple(int(x) for x in _env.triton.__version__.split(".")[:2]) >= (3, 2):  # tested: 3.6 (GPU), 3.9 (CPU)
        assert "do_bench" in installed


def test_the_project_file_is_keyed_by_kernel_gpu_triton_and_configs(tmp_path):
    base = dict(kernel="_nats_fwd_kernel", source="abc", configs=["BLOCK_M: 64", "BLOCK_M: 128"],
                gpu="NVIDIA H100 80GB HBM3", version="3.2.0", folder=str(tmp_path))  # fmt: skip
    path = _env.tuning_file(**base)
    assert path.parent == tmp_path / "nats_autotune" and path.name.startswith("_nats_fwd_kernel-")
    assert _env.tuning_file(**base) == path
    for change in (
        {"gpu": "NVIDIA H200"},
        {"version": "3.1.0"},
        {"source": "abd"},
        {"configs": ["BLOCK_M: 64"]},
        {"kernel": "_bwd_dq_kernel"},
    ):
        assert _env.tuning_file(**{**base, **change}) != path, change


class Tuner:
    """Triton's Autotuner as the project's file sees it: ``cache`` (key -> config), ``configs``, ``run``, which
    benchmarks every config for a key it has no choice for."""

    def __init__(self):
        self.configs = [SimpleNamespace(name=f"config {i}") for i in range(3)]
        self.cache, self.benchmarks = {}, 0
        self.fn = SimpleNamespace(__name__="_fake_kernel", cache_key="source-hash", fn=None)

    def run(self, *args, head_dim, dtype="torch.float16", **kwargs):
        key = (head_dim, dtype)
        if key not in self.cache:
            self.benchmarks += len(self.configs)
            self.cache[key] = self.configs[head_dim // 64]
        return self.cache[key]


def test_the_project_file_keeps_choices_across_processes(fresh, capsys, monkeypatch):
    """A second 'process' (a fresh autotuner of the same kernel) takes the first
    one's choices from the file and benchmarks nothing; a new key is tuned and added; another GPU tunes afresh."""
    first = _env.keep_choices(Tuner())
    assert first.run(head_dim=64) is first.configs[1] and first.benchmarks == 3
    assert first.run(head_dim=64) is first.configs[1] and first.benchmarks == 3
    assert "tuning the Triton kernels" in capsys.readouterr().err  # no file yet: a first run
    files = list((fresh / "triton" / "nats_autotune").glob("_fake_kernel-*.json"))
    assert len(files) == 1

    second = _env.keep_choices(Tuner())
    assert second.run(head_dim=64) is second.configs[1] and second.benchmarks == 0
    assert second.run(head_dim=128) is second.configs[2] and second.benchmarks == 3
    third = _env.keep_choices(Tuner())
    assert third.run(head_dim=128) is third.configs[2] and third.run(head_dim=64) is third.configs[1]
    assert third.benchmarks == 0

    monkeypatch.setattr(_env, "gpu_name", lambda: "NVIDIA H200")
    other = _env.keep_choices(Tuner())
    other.run(head_dim=64)
    assert other.benchmarks == 3


def test_a_broken_file_means_tuning_again(fresh):
    first = _env.keep_choices(Tuner())
    first.run(head_dim=64)
    (path,) = (fresh / "triton" / "nats_autotune").glob("*.json")
    path.write_text("{not json")
    again = _env.keep_choices(Tuner())
    again.run(head_dim=64)
    assert again.benchmarks == 3


def test_the_triton_cache_folder_is_kept_out_of_torch_compiles_temporary_one(tmp_path):
    """Without TRITON_CACHE_DIR, nats_kernels.configure_triton() on a GPU machine sets Triton's own default
    (torch.compile would otherwise set a folder under /tmp); a TRITON_CACHE_DIR given wins; the interpreter leaves
    it alone."""
    code = "import os, nats_kernels; nats_kernels.configure_triton(); print(os.environ.get('TRITON_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_HOME")}
    run = lambda **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True, check=True
    ).stdout.strip()
    home = str(tmp_path / "home")
    assert run(TRITON_INTERPRET="0", TRITON_HOME=home) == os.path.join(home, ".triton", "cache")
    assert run(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert run(TRITON_INTERPRET="1") == "None"
    assert nats_kernels.triton_cache_dir().endswith(os.path.join(".triton", "cache"))


def test_the_tuning_log_names_each_kernel_and_key_benchmarked(fresh, capsys, monkeypatch):
    """NATS_KERNELS_TUNING_LOG=1: a call that benchmarked prints its kernel and new key; a call that found its
    choice prints nothing; unset, the tuner is left as it is."""

    class Benching(Tuner):
        base_fn = SimpleNamespace(__name__="_fake_kernel")

        def run(self, *args, head_dim, **kwargs):
            if head_dim not in [k[0] for k in self.cache]:
                _env._announcing_bench(lambda: None, None)
            return super().run(*args, head_dim=head_dim, **kwargs)

    monkeypatch.setattr(_env, "_benchmarker", lambda: lambda call, quantiles: [1.0])
    assert _env.log_tuning(tuner := Benching()) is tuner and "logged_run" not in tuner.run.__qualname__
    monkeypatch.setattr(_env, "TUNING_LOG", True)
    tuner = _env.log_tuning(Benching())
    tuner.run(head_dim=64)
    tuner.run(head_dim=64)
    tuner.run(head_dim=128)
    logged = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nats: tuned")]
    assert logged == [
        "nats: tuned _fake_kernel for key [(64, 'torch.float16')]",
        "nats: tuned _fake_kernel for key [(128, 'torch.float16')]",
    ]
