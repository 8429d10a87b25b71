"""``python -m nats.lm_eval``: the lm-evaluation-harness command line with the ``nats`` model (`nats.lm_eval`)
registered, offline by default; a task whose data would come from the network, and a mistake in the settings, end
with one line (docs/lm_eval.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from nats.lm_eval.model import PROGRAM  # registers the model


@contextlib.contextmanager
def offline() -> Iterator[bool]:
    """Hugging Face datasets and hub offline (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``) unless either variable
    is set, also in the libraries already imported; restored afterwards. Yields whether datasets are offline."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    if all(v is None for v in saved.values()):
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    true = ("1", "ON", "YES", "TRUE")
    datasets_off = (os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE") or "").upper() in true
    hub_off = (os.environ.get("HF_HUB_OFFLINE") or "").upper() in true
    flags = [
        (sys.modules.get("datasets.config"), datasets_off),
        (sys.modules.get("huggingface_hub.constants"), hub_off),
    ]
    before = [(mod, getattr(mod, "HF_HUB_OFFLINE", None)) for mod, _ in flags if mod is not None]
    for mod, value in flags:
        if mod is not None:
            mod.HF_HUB_OFFLINE = value
    try:
        yield datasets_off
    finally:
        for mod, value in before:
            mod.HF_HUB_OFFLINE = value
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def network_refusal(err: BaseException, datasets_offline: bool = True) -> str | None:
    """One line for a task whose dataset had to come from the network (a connection or offline error raised while
    a harness task loaded its data): the task, the dataset and what to do; None for any other error."""
    from lm_eval.api.task import Task

    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {
        "OfflineModeIsEnabled",
        "LocalEntryNotFoundError",
        "DatasetNotFoundError",
        "ConnectError",
        "ConnectTimeout",
    }
    if not any(isinstance(x, ConnectionError) or type(x).__name__ in names for x in chain):
        return None
    task = None
    for x in chain:
        tb = x.__traceback__
        while tb is not None and task is None:
            candidate = tb.tb_frame.f_locals.get("self")
            task = candidate if isinstance(candidate, Task) else None
            tb = tb.tb_next
        if task is not None:
            break
    if task is None:
        return None
    config = getattr(task, "config", None)
    name = getattr(config, "task", None) or type(task).__name__
    path, subset = getattr(task, "DATASET_PATH", None), getattr(task, "DATASET_NAME", None)
    dataset = f"{path!r}" + (f" (subset {subset!r})" if subset else "")
    load = f"datasets.load_dataset('{path}'" + (f", '{subset}'" if subset else "") + ")"
    why = (
        "python -m nats.lm_eval runs offline (HF_DATASETS_OFFLINE=1; set HF_DATASETS_OFFLINE=0 to let it download)"
        if datasets_offline
        else "the network cannot be reached from here"
    )
    return (
        f"task {name!r} needs the dataset {dataset} from the Hugging Face hub, which is not on this machine, and "
        f"{why}: evaluate local files instead (a task YAML with dataset_path: json and dataset_kwargs: "
        "{data_files: ...}, passed with --include_path; docs/lm_eval.md), or run "
        f'python -c "import datasets; {load}" on a machine with network and copy its datasets cache '
        "(HF_DATASETS_CACHE) here"
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m nats.lm_eval``: the harness' command line (``lm_eval``'s arguments, e.g.
    ``--model nats --model_args ... --tasks ...``) with the ``nats`` model registered, offline by default (`offline`);
    a mistake in the settings and a task whose data is not here end with one line (exit status 1)."""
    from lm_eval.__main__ import cli_evaluate

    from nats.runs import USER_ERRORS, one_line

    saved = sys.argv
    if argv is not None:
        sys.argv = [PROGRAM, *argv]
    try:
        with offline() as datasets_offline:
            try:
                cli_evaluate()
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as err:  # noqa: BLE001 - the boundary: one line for what the user can fix
                message = network_refusal(err, datasets_offline)
                if message is None and isinstance(err, USER_ERRORS):
                    message = one_line(err)
                if message is None:
                    raise
                sys.exit(f"{PROGRAM}: {message}")
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
