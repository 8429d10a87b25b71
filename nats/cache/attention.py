"""Decode attention of one query token over a KV pool with per-row segments (and an optional ring).

Layout (shared by the policies): the keys and values of a layer live in a *pool* ``[P, D]``; KV row
``r = b * Hkv + h`` (sequence b, KV head h) owns the segment ``[start[r], start[r] + length[r])`` of it,
and may own a *ring* of W extra slots ``ring_k[r]`` with a validity mask (NAtS' sliding tokens). The query
heads of a GQA group attend to their KV row: ``q`` is ``[R, G, D]`` with query head ``h * G + g``.

    out[r, g] = softmax(q[r, g] . K_r / sqrt(D)) V_r    over the segment of r and its valid ring slots

Two backends give the same result:

* ``"torch"``: gathers the segments into a padded ``[R, max_len, D]`` tensor (a slice, not a gather, when
  the segments are evenly strided: ``row_stride``) and runs a masked softmax in float32 (float64 for float64
  inputs). Any device; used on CPU and by the tests. It is the kernel's reference,
  ``nats_kernels.nats_attention.decode_reference``.
* ``"triton"``: one split-K (flash-decoding) kernel reading each kept key once, plus a combine kernel
  (``nats_kernels.nats_attention.pool_decode``, beside its reference). Reads ``start``/``length`` on the device, so a
  step never synchronises with the host and can be captured in a CUDA graph.

``"auto"`` picks Triton for CUDA tensors when it imports, else torch.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from nats_kernels.nats_attention.decode_reference import compute_dtype, masked_attention, torch_pool_attention

__all__ = ["BACKENDS", "resolve_backend", "pool_attention", "compute_dtype", "masked_attention", "torch_pool_attention"]

BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def _triton_fn():
    try:
        from nats_kernels.nats_attention.pool_decode import triton_pool_attention  # noqa: PLC0415
    except Exception as exc:  # ImportError, or triton failing to initialise
        return None, f"{type(exc).__name__}: {exc}"
    return triton_pool_attention, None


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when Triton imports, else 'torch'; checks the name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" and _triton_fn()[0] is not None else "torch"
    if backend == "triton" and _triton_fn()[0] is None:
        raise RuntimeError(f"the Triton decode kernel is unavailable ({_triton_fn()[1]}): use backend='torch'")
    return backend


def pool_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    max_len: int,
    *,
    ring_k: Tensor | None = None,
    ring_v: Tensor | None = None,
    ring_valid: Tensor | None = None,
    row_stride: int | None = None,
    backend: str = "torch",
    splits: int | None = None,
    balanced: bool = True,
) -> Tensor:
    """Attention of q [R, G, D] over pool segments (+ ring). See the module docstring.

    Args:
        k_pool, v_pool: ``[P, D]``.
        start, length: LongTensor ``[R]`` on q's device (segment of row r: ``[start, start + length)``).
        max_len: a host-side upper bound of ``length`` (the padded width of the torch backend, the split
            size of the Triton kernel).
        ring_k, ring_v: ``[R, W, D]``; ring_valid ``[R, W]`` bool.
        row_stride: segments are ``start[r] = r * row_stride`` (lets the torch backend slice, not gather).
        backend: "torch" or "triton" (resolved already; see :func:`resolve_backend`).
        splits: Triton split-K count (default from ``max_len``).
        balanced: rows of different lengths: the Triton kernel's split for them (the launch choice's ``uneven``:
            the rows' keys streamed end to end over a fixed grid, or chunks of one size over all rows); False: each
            row in equal chunks (rows that hold the same number of keys: saves the lookup, ~2-4% of the kernel).
    """
    if backend == "triton":
        fn, reason = _triton_fn()
        if fn is None:
            raise RuntimeError(f"the Triton decode kernel is unavailable ({reason})")
        return fn(
            q,
            k_pool,
            v_pool,
            start,
            length,
            max_len,
            ring_k=ring_k,
            ring_v=ring_v,
            ring_valid=ring_valid,
            splits=splits,
            config={"balanced": balanced},
        )
    return torch_pool_attention(q, k_pool, v_pool, start, length, max_len, ring_k, ring_v, ring_valid, row_stride)
