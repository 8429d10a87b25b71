"""nats: learnable sparse attention (NAtS, gated attention, ANNA) on Hydra and Lightning."""

import logging as _logging
import sys as _sys
from importlib import metadata as _metadata

try:  # the installed distribution's version; a checkout that is not installed falls back to pyproject.toml's
    __version__ = _metadata.version("nats-attention")
except _metadata.PackageNotFoundError:  # pragma: no cover - nats imported from a checkout without an install
    import re as _re
    from pathlib import Path as _Path

    _pyproject = _Path(__file__).resolve().parent.parent / "pyproject.toml"
    _found = _re.search(r'^version = "([^"]+)"', _pyproject.read_text(), _re.M) if _pyproject.is_file() else None
    __version__ = _found.group(1) if _found else "unknown"


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
