"""The Triton kernels of nats, each beside its exact PyTorch reference (``reference.py`` in every op's folder).

Installed, like everything else, by ``pip install -e .`` (or a wheel): the folder ``kernels/`` is the package
``nats_kernels`` (a top-level ``kernels`` would clash with the PyPI project of that name).

- ``nats_kernels.nats_attention``: NAtS attention (training forward/backward, prefill) and its reference;
- ``nats_kernels.cross_entropy``: fused lm head + cross-entropy and its reference.

Importing this package needs no Triton and changes no environment variable. Triton's settings for the project
are made by one explicit call, :func:`configure_triton`, which the console scripts make (``nats.cli``) and
tests/conftest.py makes before any test: it must come before any kernel is defined (the kernels are imported on
first use) and before anything compiles. A program of its own that runs the kernels calls it first.
"""

import os
import sys
import warnings

import torch


def interpreting() -> bool:
    """True if ``TRITON_INTERPRET`` turns on Triton's CPU interpreter (as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


#: True: the kernels run in Triton's CPU interpreter. Read from the environment at import, and again by
#: :func:`configure_triton`; the kernels take the value they find when they are defined (``nats_attention._env``).
INTERPRET = interpreting()


def triton_cache_dir() -> str:
    """Triton's own default cache folder: ``$TRITON_HOME/.triton/cache``, ``~/.triton/cache`` without TRITON_HOME."""
    return os.path.join(os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")


def configure_triton() -> bool:
    """Triton's settings for the kernels, made in ``os.environ`` (a value the user set always wins); returns
    :data:`INTERPRET`. Call it before any kernel is defined and before anything compiles: the console scripts do
    (``nats.cli``), as does tests/conftest.py; calling it again changes nothing.

    - ``TRITON_INTERPRET=1`` without a CUDA GPU: there the kernels can only run in Triton's CPU interpreter, which
      Triton selects when ``@triton.jit`` decorates a function while ``TRITON_INTERPRET=1`` is set (the kernels are
      decorated when first imported). The interpreter is slow: use it for small shapes (tests).
    - ``TRITON_CACHE_DIR=<Triton's own default>`` (``triton_cache_dir()``) when the kernels are compiled: compiled
      kernels and the kernels' autotune choices (``nats_attention._env.autotune``) are kept in Triton's cache
      folder. Unset, torch.compile sets TRITON_CACHE_DIR to a folder under the system's temporary folder
      (/tmp/torchinductor_<user>/triton/<device>) when it compiles its first Triton kernel, which a cluster's job
      often gets afresh: every run would compile and tune again.
    """
    global INTERPRET
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpret = interpreting()
    if not interpret:
        os.environ.setdefault("TRITON_CACHE_DIR", triton_cache_dir())
    env = sys.modules.get(__name__ + ".nats_attention._env")
    if env is not None and env.INTERPRET != interpret:
        warnings.warn(
            "nats_kernels.configure_triton() came after the kernels were defined: they keep "
            f"TRITON_INTERPRET={'1' if env.INTERPRET else '0'}; call it before the first kernel is imported",
            stacklevel=2,
        )
    INTERPRET = interpret
    return interpret
