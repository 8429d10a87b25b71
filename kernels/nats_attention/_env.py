"""Import-time Triton setup shared by the kernels.

``INTERPRET`` (Triton's CPU interpreter on or off) is the package's (``kernels/__init__.py``) when this module is
first imported, so before any kernel is defined: ``nats_kernels.configure_triton()`` chooses it, and must come first.
"""

import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

import torch

from .. import INTERPRET

# NATS_KERNELS_AUTOTUNE=0: every kernel uses the first of its autotune configs (saves compile time,
# e.g. for tests); read when the kernels are defined (first import).
AUTOTUNE = os.environ.get("NATS_KERNELS_AUTOTUNE", "1") != "0"

import triton
import triton.language as tl

# Tests set this (or NATS_KERNELS_POISON=1) so that outputs start as NaN: an element a kernel forgets to
# write then fails the comparison with the reference instead of passing by luck.
POISON = os.environ.get("NATS_KERNELS_POISON", "0") == "1"


def empty(shape, dtype, device) -> torch.Tensor:
    """Output allocation of the launchers: uninitialised, or NaN-filled when POISON is set."""
    if POISON:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_bnhd(shape, dtype, device) -> torch.Tensor:
    """Like ``empty`` for a [B, H, N, D] result, stored as [B, N, H, D] (a transposed view).

    Attention in a transformer comes from, and goes back to, [B, N, H*D] activations: in this layout the
    caller's ``transpose(1, 2).reshape(B, N, H * D)`` is free (as with torch's SDPA).
    """
    B, H, N, D = shape
    return empty((B, N, H, D), dtype, device).transpose(1, 2)


def _is_dense(x: torch.Tensor) -> bool:
    """True if x's elements fill its storage span without gaps or overlaps (a permuted contiguous tensor)."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def grad_like(x: torch.Tensor) -> torch.Tensor:
    """Gradient buffer for a [B, H, N, D] input: x's own layout when x is dense (then autograd need not
    copy it into a leaf's layout), else [B, N, H, D] like ``empty_bnhd`` (e.g. q sliced from a fused qkv)."""
    if _is_dense(x):
        if POISON:
            return torch.full_like(x, float("nan"))
        return torch.empty_like(x)
    return empty_bnhd(x.shape, x.dtype, x.device)


def configs(cfgs: list, interpret_cfg) -> list:
    """Autotune configs: one fixed config in the interpreter, the first one without autotuning."""
    if INTERPRET:
        return [interpret_cfg]
    return cfgs if AUTOTUNE else cfgs[:1]


# NATS_KERNELS_AUTOTUNE_CACHE=0: tune in every process instead of keeping the choices on disk (`autotune`)
AUTOTUNE_CACHE = os.environ.get("NATS_KERNELS_AUTOTUNE_CACHE", "1") != "0"
# What a first run's tuning costs (the line `announce_tuning` prints): on one H100, GPT-2-small's NAtS training
# (fig3_nats) reached its first step after 82 s, the SmolLM2 fine-tune (more shapes) after 404 s.
TUNING_TIME = "about 1-7 min"


def triton_cache_dir() -> str:
    """Triton's cache folder (compiled kernels and kept autotune choices): ``TRITON_CACHE_DIR``, by default
    ``~/.triton/cache`` (``TRITON_HOME`` instead of ``~``); ``nats_kernels.configure_triton()`` sets the default
    explicitly so that torch.compile does not move it to a temporary folder (``kernels/__init__.py``)."""
    from .. import triton_cache_dir as default  # noqa: PLC0415

    return os.environ.get("TRITON_CACHE_DIR") or default()


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"


_announced = False


def announce_tuning() -> None:
    """Say, once per process, that the kernels are being tuned (the first run on a GPU kind and Triton version)."""
    global _announced
    if _announced:
        return
    _announced = True
    print(
        f"nats: tuning the Triton kernels for {gpu_name()} (first run on this GPU, Triton "
        f"{getattr(triton, '__version__', '?')} and shape: {TUNING_TIME}; later runs reuse the choices kept in "
        f"{triton_cache_dir()})",
        file=sys.stderr,
        flush=True,
    )


def _benchmarker():
    from triton.runtime.driver import driver  # noqa: PLC0415

    get = getattr(driver.active, "get_benchmarker", None)
    if get is not None:
        return get()
    from triton.testing import do_bench  # noqa: PLC0415

    return do_bench


# NATS_KERNELS_TUNING_LOG=1: one line per kernel and key benchmarked (which choices a run did not find kept)
TUNING_LOG = os.environ.get("NATS_KERNELS_TUNING_LOG", "0") == "1"
_benchmarks = [0]  # benchmarks run in this process (`_announcing_bench`)


def _announcing_bench(kernel_call, quantiles):
    """Triton's benchmark of one autotune config, after `announce_tuning`: Triton benchmarks only where it has no
    choice kept for the kernel, GPU architecture, Triton version and key, so the line shows on a first run."""
    announce_tuning()
    _benchmarks[0] += 1
    return _benchmarker()(kernel_call, quantiles=quantiles)


def log_tuning(tuner):
    """With NATS_KERNELS_TUNING_LOG=1, the tuner prints the kernel and key of each call that benchmarked."""
    if not TUNING_LOG:
        return tuner
    run = tuner.run

    def logged_run(*args, **kwargs):
        before, known = _benchmarks[0], set(tuner.cache)
        out = run(*args, **kwargs)
        if _benchmarks[0] != before:
            name = getattr(tuner.base_fn, "__name__", "kernel")
            print(f"nats: tuned {name} for key {sorted(set(tuner.cache) - known)}", file=sys.stderr, flush=True)
        return out

    tuner.run = logged_run
    return tuner


def autotune_options(params, keep: bool | None = None) -> tuple[dict, bool]:
    """(keyword arguments for ``triton.autotune``, whether the project keeps the choices) for a ``triton.autotune``
    taking ``params``: the benchmark announced (``do_bench``, Triton 3.2 or later); the choices kept in the
    project's file (`keep_choices`), not by Triton's own ``cache_results``: Triton keys its file also by the
    environment variables it reads and its compiler backend's hash, and a torch.compile'd training run (fig3_nats on
    an H200, Triton 3.6) missed the choices its previous run had written and tuned all four kernels again."""
    keep = AUTOTUNE_CACHE if keep is None else keep
    extra = {"do_bench": _announcing_bench} if "do_bench" in params else {}
    return extra, keep


def autotune(configs: list, key: list[str]):
    """``triton.autotune`` whose choices are kept on disk, in Triton's cache folder (`triton_cache_dir`), keyed by
    the kernel's source, the GPU's name, the Triton version, the key's values (with the tensors' dtypes) and the
    configs (`keep_choices`): a later process on the same kind of GPU skips the
    benchmarking (the SmolLM2 fine-tune's first step took 195-283 s in a fresh process, 1.1 s with the kept
    choices). A process that benchmarks says so in one line first (`announce_tuning`). Delete the cache folder to
    tune again, or set NATS_KERNELS_AUTOTUNE_CACHE=0 to tune in every process (as flash-linear-attention's
    FLA_CACHE_RESULTS)."""
    if INTERPRET:
        return triton.autotune(configs=configs, key=key)
    extra, keep = autotune_options(inspect.signature(triton.autotune).parameters)
    decorate = triton.autotune(configs=configs, key=key, **extra)
    if not keep:
        return lambda fn: log_tuning(decorate(fn))
    return lambda fn: log_tuning(keep_choices(decorate(fn)))


def tuning_file(kernel: str, source: str, configs: list, gpu: str, version: str, folder: str) -> Path:
    """The project's file of a kernel's autotune choices: one per kernel source,
    configs, GPU name and Triton version, in ``<folder>/nats_autotune/``."""
    what = json.dumps([kernel, source, [str(c) for c in configs], gpu, version])
    return Path(folder) / "nats_autotune" / f"{kernel}-{hashlib.sha256(what.encode()).hexdigest()[:20]}.json"


def _source_key(fn) -> str:
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        key = getattr(fn, "cache_key", None)
        if isinstance(key, str):
            return key
        fn = fn.fn
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def keep_choices(tuner):
    """Keep an autotuner's choices in `tuning_file`: read before its first
    call in a process, written after a call that tuned a new key. Returns the tuner."""
    run, state = tuner.run, {}

    def kept_run(*args, **kwargs):
        if "path" not in state:
            name = getattr(tuner.fn, "__name__", None) or getattr(tuner.base_fn, "__name__", "kernel")
            path = state["path"] = tuning_file(name, _source_key(tuner.fn), tuner.configs, gpu_name(),
                                               getattr(triton, "__version__", "?"), triton_cache_dir())  # fmt: skip
            try:
                stored = json.loads(path.read_text())["choices"]
            except (OSError, ValueError, KeyError):
                stored = []
            for key, index in stored:
                if 0 <= index < len(tuner.configs):
                    tuner.cache.setdefault(tuple(key), tuner.configs[index])
            if not stored and len(tuner.configs) > 1:
                announce_tuning()
            state["known"] = set(tuner.cache)
        out = run(*args, **kwargs)
        if set(tuner.cache) != state["known"]:
            _write_choices(state["path"], tuner)
            state["known"] = set(tuner.cache)
        return out

    tuner.run = kept_run
    return tuner


def _write_choices(path: Path, tuner) -> None:
    choices = []
    for key, config in tuner.cache.items():
        index = next((i for i, c in enumerate(tuner.configs) if c is config or str(c) == str(config)), None)
        try:
            json.dumps(list(key))
        except TypeError:
            continue
        if index is not None:
            choices.append([list(key), index])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"choices": choices}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: tune again next time
        pass


def dot_precision(dtype: torch.dtype) -> str:
    """Input precision of tl.dot on fp32 operands: exact for fp32 inputs, tf32 otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis


def blocks_first(heads: int) -> bool:
    """Grid order of the block kernels (forward, causal LSE, dQ, dK/dV), read at every launch; `heads` is the
    launch's batch x query heads.

    ``blocks`` (the default): axis 0 holds the query (or key) blocks of one head, as in
    FlashAttention and Triton's attention tutorial, so a head's programs run side by side and read its K/V (Q/dO
    for dK/dV) from L2 instead of each from memory. ``heads`` (``NATS_KERNELS_GRID=heads``, the former
    default): axis 0 holds batch x heads. Measured by ``benchmarks/gpu_kernel_grid.sh`` on one H100
    (docs/results/kernel_breakdown_grid_h100.md): at GPT-2's training shape (B=32, W=16) the dK/dV pass took 0.57
    ms against 0.71 and the whole forward + backward 1.13 against 1.27; at B=16, W=64 0.61 against 0.64.
    Unset, a launch with more than MAX_GRID_Y (65535) batch x heads, which the second grid axis cannot hold, takes
    the heads order; set to ``blocks`` explicitly, it is an error.
    """
    order = os.environ.get("NATS_KERNELS_GRID")
    if order is None:
        return heads <= MAX_GRID_Y
    if order not in ("blocks", "heads"):
        raise ValueError(f"NATS_KERNELS_GRID must be 'blocks' or 'heads', got {order!r}")
    return order == "blocks"


def block_grid(heads: int, n: int, block: int, first: bool) -> tuple[int, int]:
    """Grid of a block kernel: (blocks of `block` rows over n, heads) when `first` (see ``blocks_first``), else
    (heads, blocks). The second axis may hold at most MAX_GRID_Y."""
    nb = cdiv(n, block)
    if first:
        if heads > MAX_GRID_Y:
            raise ValueError(
                f"{heads} (batch x heads) programs per block exceed the {MAX_GRID_Y} a CUDA grid axis allows; "
                "split the batch or set NATS_KERNELS_GRID=heads"
            )
        return nb, heads
    if nb > MAX_GRID_Y:
        raise ValueError(
            f"sequence length {n} needs {nb} blocks of {block} rows, more than the {MAX_GRID_Y} "
            "a CUDA grid axis allows; split the sequence (chunked prefill), use larger blocks or "
            "NATS_KERNELS_GRID=blocks"
        )
    return heads, nb


def clamp_window(window: int, n: int) -> int:
    """The sliding window the kernels use for a sequence of n: at least 1, at most n + 1 (a window of n + 1
    or more keeps every sliding token to the end; clamping keeps j + W - 1 far from int32 overflow)."""
    return min(max(int(window), 1), n + 1)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


__all__ = [
    "AUTOTUNE",
    "INTERPRET",
    "POISON",
    "cdiv",
    "clamp_window",
    "configs",
    "dot_precision",
    "empty",
    "empty_bnhd",
    "grad_like",
    "tl",
    "triton",
]
