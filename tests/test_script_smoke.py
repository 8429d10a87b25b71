"""Every script the repository ships (benchmarks/, experiments/, slurm/) has a CPU smoke run in the default suite,
so that none of them rots unnoticed:

* a Python script is run by a test of its own (named in a test file that is not marked slow), or here with
  ``--help`` (its imports and its argument parser);
* a shell script runs here with its commands stubbed (``python3``, ``nats-*``, ``nvidia-smi``, ``sbatch`` ...
  record their arguments and succeed): it must finish with status 0, every Python script it calls must exist and
  take the ``--options`` it passes, every test file it passes to pytest must exist, and the overrides it gives a
  ``nats-*`` script must compose (a key that is not a setting fails here, not on the GPU machine)."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SHIPPED = sorted(
    p.relative_to(REPO).as_posix()
    for p in [
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("benchmarks/*.sh"),
        *REPO.glob("experiments/*.py"),
        *REPO.glob("experiments/*.sh"),
        *REPO.glob("slurm/*"),
    ]
    if p.suffix in (".py", ".sh", ".sbatch")
)
SHELL = [s for s in SHIPPED if s.endswith((".sh", ".sbatch"))]
PYTHON = [s for s in SHIPPED if s.endswith(".py")]
# a shell script's dry-run arguments ({dest}: its output folder); default: the output folder alone
SHELL_ARGS = {
    "experiments/gpu_finetune_smollm2.sh": ["train", "{dest}"],
    "experiments/gpu_carry_over.sh": ["{dest}", "."],  # the earlier code: here, the checkout itself
    "experiments/hf_type_bias_sweep.sh": ["validation"],  # its folders come from DEST
}
# sourced by the others, not run on its own; or run for real by another test
SOURCED = {"benchmarks/gpu_site.sh", "experiments/prepare_data.sh"}
RUN_ELSEWHERE = {"slurm/train.sbatch": "tests/test_slurm.py, on a local one-node SLURM cluster"}
STUBBED = ["python3", "python", "nvidia-smi", "pip", "sbatch", "srun", "squeue", "scontrol", "torchrun", "sleep"]
STUBBED += ["nats-train", "nats-eval", "nats-eval-hf", "nats-prepare", "nats-generate", "tensorboard"]
CONFIGS = {"nats-train": "train", "nats-eval": "eval", "nats-eval-hf": "eval_hf", "nats-prepare": "prepare"}


def _tested_elsewhere() -> dict[str, str]:
    """script -> the test file (not this one) that runs it in the default suite: a test function (or a fixture) that
    names the script and is not marked slow, in a module that is not marked slow."""
    import ast

    found = {}
    for test in sorted((REPO / "tests").glob("test_*.py")):
        if test.name == Path(__file__).name:
            continue
        text = test.read_text()
        if re.search(r"^pytestmark = .*slow", text, re.M):
            continue
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            if any("slow" in ast.unparse(d) for d in node.decorator_list):
                continue
            body = ast.get_source_segment(text, node) or ""
            for script in PYTHON:
                if script.rsplit("/", 1)[1] in body:
                    found.setdefault(script, test.name)
    return found


def test_every_shipped_script_has_a_smoke_run():
    elsewhere = _tested_elsewhere()
    for script in PYTHON:
        assert script in elsewhere or script in HELP_ONLY, f"{script} has no CPU smoke run in the default suite"
    for script in RUN_ELSEWHERE:
        assert script in SHELL and (REPO / RUN_ELSEWHERE[script].split(",")[0]).is_file(), script


# ----------------------------------------------------------------------------------------------------
# Python scripts: --help in-process (imports and argument parser), for those no other test runs
# ----------------------------------------------------------------------------------------------------
HELP_ONLY = sorted(set(PYTHON) - set(_tested_elsewhere()))


@pytest.mark.parametrize("script", HELP_ONLY)
def test_python_script_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.syspath_prepend(str(REPO / Path(script).parent))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert exit_.value.code in (0, None), capsys.readouterr()
    assert "usage" in capsys.readouterr().out.lower()


# ----------------------------------------------------------------------------------------------------
# shell scripts: a dry run with the commands stubbed
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stubs")
    stub = folder / "_stub"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        # one write per command (O_APPEND): commands a script runs side by side (&) do not interleave
        'line=$(basename "$0"); for a in "$@"; do line+=" $(printf "%q" "$a")"; done\n'
        'printf "%s\\n" "$line" >> "$STUB_LOG"\n'
    )
    stub.chmod(0o755)
    for name in STUBBED:
        (folder / name).symlink_to(stub)
    return folder


def _dry_run(
    script: str, stubs: Path, tmp: Path, argv: list[str] | None = None, first: Path | None = None
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """``script`` run with the commands stubbed (``argv``: its arguments, default `SHELL_ARGS`; ``first``: a folder of
    commands found before the stubs); the commands it ran, as logged."""
    log = tmp / "commands.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "SLURM_", "WHEELS", "LIMIT_", "HF_"))}
    path = f"{stubs}:/usr/bin:/bin" if first is None else f"{first}:{stubs}:/usr/bin:/bin"
    env.update(STUB_LOG=str(log), PATH=path, PROJECT_ROOT=str(tmp), HOME=str(tmp))
    env.update(DEST=str(tmp / "dest"), SCORERS=str(tmp / "scorers.pt"))
    argv = argv if argv is not None else SHELL_ARGS.get(script, ["{dest}"])
    args = ["bash", str(REPO / script), *(a.format(dest=tmp / "dest") for a in argv)]
    res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    commands = [shlex.split(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return res, commands


@pytest.mark.parametrize("script", sorted(set(SHELL) - SOURCED - set(RUN_ELSEWHERE)))
def test_shell_script_dry_run(script, stubs, tmp_path):
    from nats.cli import check_overrides

    res, commands = _dry_run(script, stubs, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert commands, "the script ran no command"
    for cmd in commands:
        prog, args = cmd[0], cmd[1:]
        if prog in ("python3", "python") and args and args[0].endswith(".py"):
            target = REPO / args[0]
            assert target.is_file(), f"{script} runs {args[0]}, which does not exist"
            source = target.read_text()
            for opt in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--")):
                assert f'"{opt}"' in source, f"{script}: {args[0]} takes no option {opt}"
        if prog in ("python3", "python") and args[:2] == ["-m", "pytest"]:
            for path in (a.split("::")[0] for a in args[2:] if a.startswith("tests/")):
                assert (REPO / path).exists(), f"{script} passes {path} to pytest, which does not exist"
        if prog in CONFIGS:
            overrides = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "resume="))]
            message = check_overrides(overrides, CONFIGS[prog], prog)
            assert message is None, f"{script}: {prog} {' '.join(overrides)}: {message}"


def test_allreduce_probe_cpu_smoke(tmp_path):
    """benchmarks/allreduce_probe.py under torchrun, 2 gloo processes on the CPU: a line per tensor size."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [str(torchrun), "--nproc_per_node=2", str(REPO / "benchmarks" / "allreduce_probe.py"), "--cpu-smoke"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(re.findall(r"all_reduce .* algbw .* busbw", res.stdout)) == 3, res.stdout


def test_side_by_side_assignments_apply_to_the_stages_after_them(stubs, tmp_path):
    """benchmarks/gpu_side_by_side.sh: in a group, NAME=VALUE holds for the stages after it, in order (a later
    LIMIT_METHODS does not reach the stage before it); each group runs on its own GPU."""
    gpus = tmp_path / "bin"
    gpus.mkdir()
    (gpus / "nvidia-smi").write_text("#!/bin/sh\n[ \"$1\" = -L ] && printf 'GPU 0\\nGPU 1\\n'\nexit 0\n")
    (gpus / "nvidia-smi").chmod(0o755)
    groups = ["LIMIT_METHODS=full,nats limit1b LIMIT_METHODS=nats profile8b",
              "HF_ARGS=--inductor=max_autotune=1 smol8k"]  # fmt: skip
    res, commands = _dry_run("benchmarks/gpu_side_by_side.sh", stubs, tmp_path, ["{dest}", *groups], first=gpus)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    methods = {}
    for cmd in commands:
        if "benchmarks/bench_hf_decode.py" in cmd:
            stage = Path(cmd[cmd.index("--out") + 1]).name
            methods[stage] = cmd[cmd.index("--methods") + 1 : cmd.index("--methods") + 3]
    assert methods["limit1b"] == ["full", "nats"] and methods["profile8b"][0] == "nats", methods
    assert methods["profile8b"][1:] in ([], ["--profile"]) and methods["smol8k"][:2] == ["static", "flex_static"]
    inductor = {Path(c[c.index("--out") + 1]).name: "--inductor=max_autotune=1" in c for c in commands if "--out" in c}
    assert inductor == {"limit1b": False, "profile8b": False, "smol8k": True}, inductor  # HF_ARGS: that group only
    assert (tmp_path / "dest" / "gpu0").is_dir() and (tmp_path / "dest" / "gpu1").is_dir()
