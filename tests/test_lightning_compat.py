"""The private Lightning attributes of ``nats.lightning_compat`` against the installed Lightning.

Each function must find its attribute where it expects it on a real Trainer (and fit loop), read or write that
attribute (compared with Lightning's own value), and, where the attribute is missing (a stand-in object), raise one
line naming the installed Lightning and the supported range. A Lightning release that moves one of them fails here.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from nats import lightning_compat as compat
from nats.lightning_compat import LightningCompatError

REPO = Path(__file__).resolve().parents[1]


def trainer(**kwargs) -> L.Trainer:
    opts = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**opts, **kwargs})


class Record(L.Callback):
    """What the compat functions and Lightning's own attributes say at the end of every training batch."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            dict(
                batch_idx=batch_idx,
                accumulate=compat.should_accumulate(trainer),
                lightning_accumulate=trainer.fit_loop._should_accumulate(),
                update_logs=compat.should_update_logs(trainer),
                lightning_update_logs=trainer._logger_connector.should_update_logs,
                stepped=compat.batches_that_stepped(trainer),
                lightning_stepped=trainer.fit_loop.epoch_loop._batches_that_stepped,
                global_step=trainer.global_step,
                sigterm=compat.received_sigterm(trainer),
                attached=compat.attached_trainer(pl_module) is trainer,
            )
        )


@pytest.fixture(scope="module")
def fitted():
    """A fit of 3 optimizer steps of 2 micro-batches each, logs every 2 steps: the rows of `Record`."""
    record = Record()
    t = trainer(max_steps=3, accumulate_grad_batches=2, log_every_n_steps=2, limit_val_batches=0, callbacks=[record])
    t.fit(BoringModel())
    return record.rows


def test_should_accumulate_reads_the_fit_loop(fitted):
    assert [r["accumulate"] for r in fitted] == [r["lightning_accumulate"] for r in fitted]
    assert [r["accumulate"] for r in fitted] == [True, False] * 3  # 2 micro-batches per optimizer step


def test_should_update_logs_reads_the_logger_connector(fitted):
    assert [r["update_logs"] for r in fitted] == [r["lightning_update_logs"] for r in fitted]
    assert any(r["update_logs"] for r in fitted) and not all(r["update_logs"] for r in fitted)


def test_batches_that_stepped_reads_the_epoch_loop(fitted):
    assert [r["stepped"] for r in fitted] == [r["lightning_stepped"] for r in fitted]
    # Lightning counts a stepped batch after its on_train_batch_end, the optimizer's global_step before it
    assert [r["global_step"] for r in fitted] == [0, 1, 1, 2, 2, 3]
    assert [r["stepped"] for r in fitted] == [0, 0, 1, 1, 2, 2]


def test_received_sigterm_and_attached_trainer_during_a_fit(fitted):
    assert not any(r["sigterm"] for r in fitted)
    assert all(r["attached"] for r in fitted)


def test_set_received_sigterm_writes_lightnings_flag():
    t = trainer()
    assert t._signal_connector.received_sigterm is False and compat.received_sigterm(t) is False
    compat.set_received_sigterm(t)
    assert t._signal_connector.received_sigterm is True and compat.received_sigterm(t) is True
    compat.set_received_sigterm(t, False)
    assert t._signal_connector.received_sigterm is False


def test_set_received_sigterm_stops_a_fit():
    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                compat.set_received_sigterm(trainer)

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    t = trainer(max_steps=10, limit_val_batches=0, callbacks=[Stop()])
    with pytest.raises(SIGTERMException):
        t.fit(BoringModel())
    assert t.global_step == 2


def test_batches_that_stepped_shifted_is_what_a_checkpoint_saves_and_is_restored(tmp_path):
    import torch

    t = trainer(max_steps=3, limit_val_batches=0)
    t.fit(BoringModel())
    loop = t.fit_loop.epoch_loop
    assert loop._batches_that_stepped == 3
    loop._batches_that_stepped = 5
    with compat.batches_that_stepped_shifted(t, 1):
        assert compat.batches_that_stepped(t) == 4
        t.save_checkpoint(tmp_path / "shifted.ckpt", weights_only=False)
    saved = torch.load(tmp_path / "shifted.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert saved["epoch_loop.state_dict"]["_batches_that_stepped"] == 4  # what a resume starts from
    assert loop._batches_that_stepped == 5
    with pytest.raises(KeyError), compat.batches_that_stepped_shifted(t, 1):
        raise KeyError("restored on an error too")
    assert loop._batches_that_stepped == 5
    with compat.batches_that_stepped_shifted(t, 0):
        assert loop._batches_that_stepped == 5


def test_attached_trainer_of_a_bare_and_an_attached_module():
    module = BoringModel()
    assert compat.attached_trainer(module) is None
    t = trainer()
    module.trainer = t
    assert compat.attached_trainer(module) is t


def test_check_lightning_finds_everything_on_a_new_trainer():
    t = trainer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a warning about the version
        compat.check_lightning(t)


# ---------------------------------------------------------------- missing attributes: the clear error

_no_connectors = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
_bare_connectors = SimpleNamespace(_logger_connector=SimpleNamespace(), _signal_connector=SimpleNamespace())

MISSING = {
    "should_accumulate": (lambda: compat.should_accumulate(_no_connectors), "_should_accumulate"),
    "should_accumulate, no fit loop": (lambda: compat.should_accumulate(SimpleNamespace()), "fit_loop"),
    "should_update_logs": (lambda: compat.should_update_logs(_no_connectors), "_logger_connector"),
    "should_update_logs, no property": (lambda: compat.should_update_logs(_bare_connectors), "should_update_logs"),
    "received_sigterm": (lambda: compat.received_sigterm(_no_connectors), "_signal_connector"),
    "received_sigterm, no flag": (lambda: compat.received_sigterm(_bare_connectors), "received_sigterm"),
    "set_received_sigterm": (lambda: compat.set_received_sigterm(_bare_connectors), "received_sigterm"),
    "batches_that_stepped": (lambda: compat.batches_that_stepped(_no_connectors), "_batches_that_stepped"),
    "batches_that_stepped_shifted": (
        lambda: compat.batches_that_stepped_shifted(_no_connectors, 1).__enter__(),
        "_batches_that_stepped",
    ),
    "attached_trainer": (lambda: compat.attached_trainer(SimpleNamespace()), "_trainer"),
    "check_lightning": (lambda: compat.check_lightning(_no_connectors), "_should_accumulate"),
}


@pytest.mark.parametrize("name", MISSING)
def test_a_missing_attribute_is_one_clear_line(name):
    call, attribute = MISSING[name]
    with warnings.catch_warnings(), pytest.raises(LightningCompatError) as err:
        warnings.simplefilter("ignore")
        call()
    message = str(err.value)
    assert "\n" not in message
    assert attribute in message
    assert f"lightning {compat.lightning_version()}" in message and compat.SUPPORTED in message


def test_set_received_sigterm_never_creates_the_flag():
    connector = SimpleNamespace()
    with pytest.raises(LightningCompatError):
        compat.set_received_sigterm(SimpleNamespace(_signal_connector=connector))
    assert not hasattr(connector, "received_sigterm")  # Lightning would never read a flag written there


# ---------------------------------------------------------------- the supported range


def test_the_bound_is_pyprojects_and_holds_the_installed_lightning():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.findall(r'^\s*"(lightning[^"]*)"', text, re.M)
    assert deps == [compat.SUPPORTED]
    assert compat.version_supported(), f"lightning {compat.lightning_version()} is outside {compat.SUPPORTED}"
    assert compat.version_supported(compat.LIGHTNING_MAX_TESTED)
    below = tuple(int(p) for p in compat.LIGHTNING_BELOW.split("."))
    tested = tuple(int(p) for p in compat.LIGHTNING_MAX_TESTED.split("."))
    assert below == (tested[0], tested[1] + 1)  # the next minor after the newest tested


@pytest.mark.parametrize(
    "version, ok",
    [("2.3.0", True), ("2.6.6", True), ("2.6.0rc1", True), ("2.2.5", False), ("2.7.0", False), ("3.0", False)],
)
def test_check_version_warns_outside_the_range(version, ok):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.check_version(version) is ok
    assert len(caught) == (0 if ok else 1)
    if not ok:
        assert version in str(caught[0].message) and compat.SUPPORTED in str(caught[0].message)
