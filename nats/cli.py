"""The error boundary every console script shares (``nats-train``, ``nats-eval``, ``nats-eval-hf``,
``nats-generate``, ``nats-prepare``): a bad setting or input stops with one line that names the problem and the
fix, exit status 1, no traceback (``HYDRA_FULL_ERROR=1`` adds it) and no run folder left behind.

Two halves, both used by every script:

* :func:`console` runs before Hydra composes the config (nothing written yet): the script's own argument
  rewriting (``resume=``), the check of the overrides (:func:`check_overrides`: a key the config does not have
  names the closest one, or the config group that has it; an unknown option of a config group lists the group's
  options) and the checks of the setting that need no run (:func:`check_setting`, and the script's own ``check``).
* :func:`guarded` runs the job inside the Hydra app: any exception becomes one line
  (:func:`nats.runs.report_failure`); when nothing ran, the run folder Hydra made for it is removed, with the
  ``logs/<task>/runs/`` folders above it that are left empty.

The checks of a composed setting that every script may need before it starts are `nats.checks`.

``--help`` lists the config groups the script's config composes (:func:`config_groups`, through the resolver
``${config_groups:}`` of conf/hydra/help/*.yaml), not every group of conf/.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nats.checks import check_setting
from nats.utils import CONF_DIR


def compose(overrides: list[str], config_name: str = "train", hydra_config: bool = False) -> DictConfig:
    """The config a Hydra app would see for these command-line overrides, composed from conf/ in-process."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra_config)


# ----------------------------------------------------------------------------------------------------
# before Hydra: the arguments
# ----------------------------------------------------------------------------------------------------
def console(
    program: str,
    config_name: str,
    hydra_main: Callable[[], Any],
    rewrite: Callable[[list[str], list[str]], list[str]] | None = None,
    check: Callable[[DictConfig], Any] | None = None,
) -> Any:
    """A console script: ``rewrite(argv, notes)`` (e.g. ``resume=`` into the run's overrides; notes are printed),
    the overrides checked against the config ``config_name``, the composed config checked (:func:`check_setting`,
    then ``check(cfg)``: the script's own checks that need no model or data), then the Hydra app ``hydra_main``.
    A mistake in the arguments or the setting exits with ``<program>: <message>`` before anything is written (no
    run folder). With ``--multirun`` (or another ``-`` flag) the checks run in each job instead."""
    from nats.runs import USER_ERRORS, one_line

    argv = sys.argv[1:]
    if rewrite is not None:
        notes: list[str] = []
        try:
            new = rewrite(argv, notes)
        except USER_ERRORS as err:
            sys.exit(f"{program}: {one_line(err)}")
        for note in notes:
            print(note, flush=True)
        if new != argv:
            print(f"resume: {program} {' '.join(new)}", flush=True)
            argv = new
    message = check_override_syntax(argv)  # Hydra's grammar: its error would escape as a traceback
    if message:
        sys.exit(f"{program}: {message}")
    cfg, message = _composed(argv, config_name, program)
    if message:
        sys.exit(f"{program}: {message}")
    if cfg is not None:
        try:
            check_setting(cfg)
            if check is not None:
                check(cfg)
        except USER_ERRORS as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                import traceback

                traceback.print_exception(type(err), err, err.__traceback__)
            sys.exit(f"{program}: {one_line(err)}")
    sys.argv = [sys.argv[0], *argv]
    return hydra_main()


#: Hydra's flags that take a value (the next argument, not an override)
_HYDRA_VALUE_FLAGS = frozenset(
    ("--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd", "--experimental-rerun")
)  # fmt: skip


def check_override_syntax(argv: list[str]) -> str | None:
    """The message for the first override that Hydra's grammar cannot read (``prompt=Once upon a time, in a
    village,``: a comma, bracket or quote outside quotes, a quote left open), or whose unquoted commas make it a
    sweep in a run that is not ``--multirun`` (Hydra's "Ambiguous value"): the override and how to quote its value;
    None when all read. Hydra would raise its OverrideParseException past the error boundary (a traceback)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    multirun = any(a in ("-m", "--multirun") or a.replace(" ", "").startswith("hydra.mode=MULTIRUN") for a in argv)
    for i, arg in enumerate(argv):
        if arg.startswith("-") or (i > 0 and argv[i - 1] in _HYDRA_VALUE_FLAGS):
            continue
        key, eq, value = arg.partition("=")
        try:
            sweep = parser.parse_override(arg).is_sweep_override() and not multirun
        except HydraException as err:
            if not eq:
                return f"{arg!r} is not an override key=value (or ~key): write it as key=value"
            reason = str(err).splitlines()[0].split(" expecting ")[0]
            example = _quoted_example(key, value)
            return f"Hydra cannot read the override {arg!r} ({reason}): quote the value, e.g. {example}"
        if sweep:
            return (
                f"the commas of {arg!r} make it a list of values to sweep over, and this run is not a --multirun: "
                f"quote the value to keep it one string, e.g. {_quoted_example(key, value)} (or write a list as "
                f"{key}=[a,b])"
            )
    return None


def hydra_quoted(text: str, literal: bool = True) -> str:
    """``text`` as a quoted value of Hydra's override grammar that reads back as ``text`` itself: quotes and the
    backslashes before them escaped; with ``literal``, ``${`` too, so that OmegaConf does not interpolate it."""
    from hydra.core.override_parser.types import Quote, QuotedString

    if literal and "${" in text:  # OmegaConf: \${ is an escaped ${, \\ before it one backslash
        text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    quote = Quote.double if "'" in text and '"' not in text else Quote.single
    return QuotedString(text=text, quote=quote).with_quotes()


def _quoted_example(key: str, value: str) -> str:
    """``key=<value quoted for Hydra>`` as one word of the shell (in its double quotes), on one line."""
    import shlex

    if "\n" in value or "\r" in value or len(value) > 80:
        return f"\"{key}='...'\" (in the shell's quotes)"
    word = f"{key}={hydra_quoted(value, literal=False)}"
    return shlex.quote(word) if "!" in word else '"' + re.sub(r'([\\"$`])', r"\\\1", word) + '"'


def check_overrides(argv: list[str], config_name: str = "train", program: str = "nats-train") -> str | None:
    """The message for an override of a key the config does not have (``trainer.max_step=3``), naming the closest
    existing key, or the config group option that has the key (``model.attention.sparsity_lambda`` belongs to
    ``model/attention=nats``); for an option a config group does not have (``model/attention=flashy``), the
    group's options; for a group the config does not use (``optim=...`` of nats-generate), the groups it uses;
    None when the overrides compose. Hydra's own message proposes ``+trainer.max_step=3``, which adds the key and
    then fails in the trainer; the close key is what was meant."""
    return _composed(argv, config_name, program)[1]


def _composed(argv: list[str], config_name: str, program: str) -> tuple[DictConfig | None, str | None]:
    """(the config the overrides compose, None) or (None, the message of :func:`check_overrides`); (None, None)
    when the arguments are Hydra's own business (``--multirun``, ``--help``, ...) or fail in a way Hydra reports
    well."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    if any(a.startswith("-") for a in argv):  # --multirun, --cfg, --help, ...: Hydra's own business
        return None, None
    overrides = [a for a in argv if "=" in a]
    try:
        return compose(overrides, config_name), None
    except MissingConfigException as err:  # an option its group does not have (model/attention=flashy)
        return None, _unknown_option(err)
    except ConfigCompositionException as err:
        match = re.match(r"Could not override '([^']+)'", str(err))
        if not match:
            return None, None  # another composition error: Hydra says it
        bad = match.group(1)
    return None, _unknown_key(bad, overrides, config_name, program)


def _unknown_option(err: Exception) -> str | None:
    """``model/attention=flashy: no such option; choose one of: anna, dense, ...`` for Hydra's missing config
    ``model/attention/flashy`` (its message lists the options one per line, then its search path)."""
    missing = str(getattr(err, "missing_cfg_file", None) or "")
    if "/" not in missing:
        return None  # not an option of a group (a primary config): Hydra says it
    group, option = missing.rsplit("/", 1)
    options = group_options(group)
    if not options:
        return None
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{group}={option}: no such option{hint}; choose one of: {', '.join(options)}"


def _unknown_key(bad: str, overrides: list[str], config_name: str, program: str) -> str | None:
    """The message for ``bad``, an override key that matches nothing in the config ``config_name``."""
    rest = [o for o in overrides if o.split("=", 1)[0] != bad]
    if "." not in bad and group_options(bad):  # a config group this config does not compose (optim= of generate)
        try:
            used = config_groups(config_name, rest)
        except Exception:  # noqa: BLE001 - a second bad override: Hydra reports it
            return None
        return (
            f"{bad} is a config group that {program} does not use with this configuration; its config groups: "
            f"{', '.join(used)} (see {program} --help)"
        )
    try:
        cfg = compose(rest, config_name, hydra_config=True)
    except Exception:  # noqa: BLE001 - a second bad override: Hydra reports it
        return None
    value = next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == bad)
    parent, leaf = bad.rsplit(".", 1) if "." in bad else ("", bad)
    group = _group_with_key(parent, leaf)
    if group is not None:
        choices = cfg.hydra.runtime.choices
        current = choices.get(parent.replace(".", "/"))
        options = _group_options_with_key(parent, leaf)
        now = f" (this run uses {parent.replace('.', '/')}={current})" if current else ""
        return (
            f"{bad} is a setting of {' / '.join(f'{group}={o}' for o in options)}, not of the configuration "
            f"chosen{now}: choose it first, e.g. {program} {group}={options[0]} {bad}={value}"
        )
    node = OmegaConf.select(cfg, parent) if parent else None
    if isinstance(node, DictConfig) and len(node) == 0:  # an open mapping of options (cache_options: {})
        return f"{bad} is a new key of {parent} (empty by default): add it with a +, e.g. {program} +{bad}={value}"
    keys = [k for k in _config_keys(cfg) if k != "hydra" and not k.startswith("hydra.")]
    siblings = [k for k in keys if k.rsplit(".", 1)[0] == parent] if parent else []
    close = difflib.get_close_matches(bad, siblings, n=1, cutoff=0.6) or difflib.get_close_matches(bad, keys, n=1)
    if close:
        return f"{bad} is not a setting: did you mean {close[0]}? ({program} {close[0]}={value})"
    where = f" under {parent}: {', '.join(k.rsplit('.', 1)[-1] for k in siblings)}" if siblings else ""
    return f"{bad} is not a setting of this configuration; the settings{where or f' are listed by {program} --cfg job'}"


def _group_options_with_key(parent: str, leaf: str) -> list[str]:
    """The options of the config group at ``parent`` (``model.attention`` -> conf/model/attention/*.yaml) whose
    file sets ``leaf`` at its top level."""
    import yaml

    folder = Path(CONF_DIR, *parent.split(".")) if parent else None
    if folder is None or not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            node = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if isinstance(node, dict) and leaf in node:
            found.append(path.stem)
    return found


def _group_with_key(parent: str, leaf: str) -> str | None:
    """``model/attention`` when an option of that group has the key ``leaf``, else None."""
    return parent.replace(".", "/") if _group_options_with_key(parent, leaf) else None


def _config_keys(cfg: DictConfig) -> list[str]:
    """Every key path of a composed config (``trainer.max_steps``, ``model.attention.name``, ...)."""
    out: list[str] = []

    def walk(node, prefix: str) -> None:
        for key in node.keys() if isinstance(node, DictConfig) else []:
            path = f"{prefix}{key}"
            out.append(path)
            try:
                child = node._get_node(key)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(child, DictConfig):
                walk(child, path + ".")

    walk(cfg, "")
    return out


def group_options(group: str) -> list[str]:
    """The options of the config group ``group`` (``model/attention`` -> conf/model/attention/*.yaml), sorted;
    files whose name starts with ``_`` are bases the options extend (conf/data/_base.yaml), not options."""
    folder = Path(CONF_DIR, *group.split("/"))
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))


def config_groups(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The config groups (not Hydra's own) that the config ``config_name`` composes with these overrides: those
    of its defaults list, nested ones included (``model/attention``, chosen by ``model``'s option), and those it
    lists without an option (``experiment: null``). Sorted."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    def groups() -> list[str]:
        loader = GlobalHydra.instance().config_loader()
        defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN)
        found = {d.config_path.rsplit("/", 1)[0] for d in defaults.defaults if d.config_path and "/" in d.config_path}
        found |= set(defaults.overrides.known_choices)
        return sorted(g for g in found if g != "hydra" and not g.startswith("hydra/"))

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (--help)
        return groups()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return groups()


def config_groups_help(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """``group: option, option, ...`` per line for the config groups of :func:`config_groups`: what ``--help``
    lists under "== Config groups ==" (conf/hydra/help/*.yaml, ``${config_groups:}``)."""
    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in config_groups(config_name, overrides))


def _config_groups_resolver(*, _root_: DictConfig) -> str:
    """``${config_groups:}``: :func:`config_groups_help` of the app's config and overrides (``hydra.job``)."""
    hydra_node = _root_.hydra
    return config_groups_help(str(hydra_node.job.config_name), list(hydra_node.overrides.task or []))


if not OmegaConf.has_resolver("config_groups"):
    OmegaConf.register_new_resolver("config_groups", _config_groups_resolver, use_cache=False)


# ----------------------------------------------------------------------------------------------------
# inside Hydra: the job
# ----------------------------------------------------------------------------------------------------
def guarded(program: str, cfg: DictConfig, job: Callable[[DictConfig], Any]) -> Any:
    """Run ``job(cfg)`` in the Hydra app of ``program``; any exception ends the process with one line on the
    console (:func:`nats.runs.report_failure`): a mistake before anything ran removes the run folder Hydra made
    for it and the empty ``logs/<task>/runs/`` folders above it. Triton's settings are made first
    (:func:`nats_kernels.configure_triton`: the interpreter without a GPU, Triton's cache folder), in the process that
    runs the job, before any kernel is defined or compiled: a job that runs elsewhere (a SLURM job of a multirun) gets
    the settings of its own machine, not those of the machine that submitted it."""
    from nats.runs import quiet_libraries, report_failure, run_folder_is_new
    from nats_kernels import configure_triton

    configure_triton()
    quiet_libraries()
    if cfg.get("print_config"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
    out = OmegaConf.select(cfg, "paths.output_dir")
    root = OmegaConf.select(cfg, "paths.root_dir", default=None)
    new_folder = out is not None and run_folder_is_new(out)
    try:
        return job(cfg)
    except BaseException as err:  # noqa: BLE001 - the boundary: one line, the traceback with HYDRA_FULL_ERROR=1
        sys.exit(report_failure(unwrapped(err), out or ".", program=program, new_folder=new_folder, root=root))


def unwrapped(err: BaseException) -> BaseException:
    """The mistake itself where Hydra's instantiate wrapped it (``InstantiationException`` around a ValueError
    raised by a config's target: ``data=pg19`` without ``data.path``), else ``err``."""
    from hydra.errors import InstantiationException

    from nats.runs import USER_ERRORS

    while isinstance(err, InstantiationException) and isinstance(err.__cause__, USER_ERRORS):
        cause = err.__cause__
        if hasattr(err, "nats_steps_run"):
            cause.nats_steps_run = err.nats_steps_run
        err = cause
    return err


def hydra_script(
    program: str,
    config_name: str,
    job: Callable[[DictConfig], Any],
    module: str,
    rewrite: Callable[[list[str], list[str]], list[str]] | None = None,
    check: Callable[[DictConfig], Any] | None = None,
) -> Callable[[], None]:
    """The ``main`` of a console script: :func:`console` (``rewrite``, the overrides checked against the config
    ``config_name``, the setting checked: :func:`check_setting` and ``check``), then the Hydra app that runs
    ``job(cfg)`` inside :func:`guarded`. ``module``: the script's ``__name__``, after which Hydra names the job
    (``hydra.job.name``), as it would for an app defined there."""
    import hydra

    def task(cfg: DictConfig) -> None:
        guarded(program, cfg, job)  # one line on the console for a failure

    # python -m nats.eval (or python nats/eval.py) runs the script as __main__: the job is named after its file
    task.__module__ = Path(sys.modules[module].__file__).stem if module == "__main__" else module
    hydra_main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(task)

    def main() -> None:
        console(program, config_name, hydra_main, rewrite, check)

    main.__doc__ = f"`{program}`: the overrides checked (nats.cli.console), then the Hydra app."
    return main
