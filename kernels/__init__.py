"""The Triton kernels of nats, each beside its exact PyTorch reference (``reference.py`` in every op's folder).

Installed, like everything else, by ``pip install -e .`` (or a wheel): the folder ``kernels/`` is the package
``nats_kernels`` (a top-level ``kernels`` would clash with the PyPI project of that name).

- ``nats_kernels.nats_attention``: NAtS attention (training forward/backward, prefill) and its reference;
- ``nats_kernels.cross_entropy``: fused lm head + cross-entropy and its reference.

The Triton interpreter is chosen here, in one place, for every kernel of the project: this module runs before
any kernel module is imported (tests/conftest.py imports it first too). Without a CUDA GPU the kernels can only
run in Triton's CPU interpreter, which Triton selects when ``@triton.jit`` decorates a function while
``TRITON_INTERPRET=1`` is set; so it is set here when no GPU is present. An explicit ``TRITON_INTERPRET``
always wins. The interpreter is slow: use it for small shapes (tests). Importing this package needs no Triton.
"""

import os

import torch


def _interpret() -> bool:
    """Set ``TRITON_INTERPRET=1`` without a CUDA GPU (unless set already); True if the interpreter is on."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


INTERPRET = _interpret()  # True: the kernels run in Triton's CPU interpreter


def triton_cache_dir() -> str:
    """Triton's own default cache folder: ``$TRITON_HOME/.triton/cache``, ``~/.triton/cache`` without TRITON_HOME."""
    return os.path.join(os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")


# Compiled kernels and the kernels' autotune choices (nats_attention/_env.autotune) are kept in Triton's cache
# folder. Unset, torch.compile sets TRITON_CACHE_DIR to a folder under the system's temporary folder
# (/tmp/torchinductor_<user>/triton/<device>) when it compiles its first Triton kernel, which a cluster's job often
# gets afresh: every run would compile and tune again. So Triton's own default is set here, before anything
# compiles; a TRITON_CACHE_DIR set by the user wins.
if not INTERPRET:
    os.environ.setdefault("TRITON_CACHE_DIR", triton_cache_dir())
