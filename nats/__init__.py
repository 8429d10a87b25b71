"""nats: learnable sparse attention (NAtS, gated attention, ANNA) on Hydra and Lightning."""
import logging as _logging
import sys as _sys


class _StdoutHandler(_logging.StreamHandler):
    """Writes to the current ``sys.stdout`` (so that redirections and pytest's capture see it)."""

    @property
    def stream(self):
        return _sys.stdout

    @stream.setter
    def stream(self, value):
        pass


# The project's messages ("resuming from ...", "val_ppl ...") reach stdout also when nats is used as a library
# (scripts, notebooks, tests) where nobody configured logging, as Lightning does for its own logger. Under a Hydra
# app, conf/hydra/default.yaml replaces this handler and sends them to the console and the run's log file.
_logger = _logging.getLogger(__name__)
if not _logger.handlers:
    _logger.setLevel(_logging.INFO)
    _logger.addHandler(_StdoutHandler())
    _logger.propagate = False
