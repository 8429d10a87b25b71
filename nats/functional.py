"""The stable functional API of Neural Attention Search (NAtS), NATS_SPEC.md section 9.

NAtS gives every token j, per layer and per KV head, one of three types:

* ``TOKEN_GLOBAL`` (0): kept for ever; every later query sees it.
* ``TOKEN_LOCAL`` (1): kept until the next global token of the same head has been queried.
* ``TOKEN_SLIDING`` (2): kept for a window of W queries (itself included).

For query i and key j the mask is (spec section 2)::

    M_ij = 0                                                       if j > i
    M_ij = g_j + l_j * prod_{k=j+1}^{i-1} (1 - g_k) + s_j [i - j < W]   otherwise

with ``(g_j, l_j, s_j)`` the one-hot type of token j, and attention is
``A_ij = M_ij exp(s_ij) / sum_k M_ik exp(s_ik)`` with ``s_ij = q_i . k_j / sqrt(D)``. The attention is
differentiable in the type weights (spec section 3), which is how the type scorer is trained; the
sparsity loss is the density ``rho = sum_{i >= j} M_ij / (N (N + 1) / 2)`` (section 4).

Shapes: masks are ``[..., N, N]`` indexed ``[query, key]``; q is ``[B, Hq, N, D]``; k and v are
``[B, Hkv, N, D]``; type weights are ``[B, Hkv, N, 3]``; integer types are ``[..., N]``.

Example::

    import torch
    from nats import functional as NF

    types = torch.tensor([0, 1, 2, 1, 0, 2])               # [N]
    mask = NF.nats_mask(types, window=2)                    # [N, N] bool
    area, peak = NF.kv_fractions(mask)

    q = torch.randn(1, 4, 6, 16); k = torch.randn(1, 2, 6, 16); v = torch.randn(1, 2, 6, 16)
    w = NF.types_to_weights(types).expand(1, 2, 6, 3)      # [B, Hkv, N, 3]
    o = NF.nats_attention(q, k, v, w, window=2)              # [1, 4, 6, 16]
    rho = NF.nats_density(w, window=2)                       # [1, 2], == area here
"""

from __future__ import annotations

import torch
from torch import Tensor

from nats import ops as _ops
from nats_kernels.nats_attention import reference as _ref
from nats_kernels.nats_attention import triton_supports
from nats_kernels.nats_attention.reference import (
    TOKEN_GLOBAL,
    TOKEN_LOCAL,
    TOKEN_SLIDING,
    next_global_index,
    prev_global_index,
)

__all__ = [
    "TOKEN_GLOBAL",
    "TOKEN_LOCAL",
    "TOKEN_SLIDING",
    "BACKENDS",
    "MASK_GRADS",
    "nats_mask",
    "nats_mask_soft",
    "nats_attention",
    "nats_attention_types",
    "nats_density",
    "kv_cache_sizes",
    "kv_fractions",
    "budget_fractions",
    "type_fractions",
    "types_to_weights",
    "next_global_index",
    "prev_global_index",
    "triton_available",
]

BACKENDS = ("auto", "reference", "triton")
MASK_GRADS = _ref.MASK_GRADS  # ("dense", "exact"), spec section 3a


# ----------------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------------
def nats_mask(types: Tensor, window: int) -> Tensor:
    """The NAtS mask of spec section 2 from integer token types.

    Args:
        types: integer tensor ``[..., N]`` with values ``TOKEN_GLOBAL`` (0), ``TOKEN_LOCAL`` (1) or
            ``TOKEN_SLIDING`` (2).
        window: sliding window W >= 1.

    Returns:
        BoolTensor ``[..., N, N]`` indexed ``[query i, key j]``: True iff ``j <= i`` and key j is
        global, or local with no global strictly between j and i, or sliding with ``i - j < W``.
        The diagonal is always True.
    """
    window = _ref.check_window(window)
    _ref.check_types(types)
    return _ref.nats_mask_hard(types, window)


def nats_mask_soft(type_weights: Tensor, window: int) -> Tensor:
    """Differentiable float mask ``[..., N, N]`` from type weights ``[..., N, 3]`` (spec sections 2-3).

    Equal in value to ``nats_mask(argmax types)`` for one-hot weights; autograd through it gives the
    exact derivatives of the product formula (the segment term included). O(N^2) memory.
    """
    window = _ref.check_window(window)
    _ref.check_type_weights(type_weights)
    return _ref.nats_mask_soft(type_weights, window)


# ----------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------
_TRITON_BACKEND: dict[str, object] = {}  # filled on first use: {"fn": callable or None, "reason": str or None}


def _load_triton_backend():
    """Return ``(fn, None)`` with the fused kernel, or ``(None, reason)`` if it cannot be imported.

    Cached in a plain module dict (not ``functools.lru_cache``) so that torch.compile traces it cleanly.
    Load it before compiling (``triton_available()``; `nats.attention.nats.NAtSAttention` does so when it is
    built): a graph traced while the dict is still empty guards on it being empty, and the first call fills it,
    so the second call would recompile.
    """
    if not _TRITON_BACKEND:
        try:
            from nats_kernels.nats_attention import triton_nats_attention  # noqa: PLC0415
        except Exception as exc:  # ImportError, or triton failing to initialise
            _TRITON_BACKEND.update(fn=None, reason=f"{type(exc).__name__}: {exc}")
        else:
            _TRITON_BACKEND.update(fn=triton_nats_attention, reason=None)
    return _TRITON_BACKEND["fn"], _TRITON_BACKEND["reason"]


def triton_available() -> bool:
    """True if the fused Triton kernel (``nats_kernels.nats_attention.triton_nats_attention``) imports."""
    return _load_triton_backend()[0] is not None


def nats_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    type_weights: Tensor,
    window: int,
    backend: str = "auto",
    mask_grad: str = "dense",
) -> Tensor:
    """NAtS attention (spec section 3), causal, with grouped-query heads.

    Args:
        q: ``[B, Hq, N, D]`` queries.
        k: ``[B, Hkv, N, D]`` keys; ``Hq`` must be a multiple of ``Hkv``; query head h uses KV head
            ``h // (Hq // Hkv)``.
        v: ``[B, Hkv, N, D]`` values.
        type_weights: ``[B, Hkv, N, 3]`` one-hot ``(global, local, sliding)`` weights per KV head; they
            may carry straight-through gradients (``onehot + y - y.detach()``).
        window: sliding window W >= 1.
        backend: ``"reference"`` (pure PyTorch, any device, O(N^2) memory), ``"triton"`` (the fused
            kernel) or ``"auto"`` (Triton for CUDA inputs it supports: fp16/bf16/fp32, head dims 16-128,
            when the kernel imports; else reference).

        mask_grad: the type-gradient estimator of spec section 3a. ``"dense"`` (default, the paper's
            kernel): ``dM_ij = exp(s_ij - LSEc_i)(dO_i . v_j - D_i)`` with LSEc_i the log-sum-exp over every
            causal key, bounded by ``|dO_i . v_j - D_i|``. ``"exact"``: the masked normaliser LSE_i, the exact
            derivative of section 3, unbounded at masked pairs whose score is far above the kept ones.

    Returns:
        ``[B, Hq, N, D]`` in q's dtype. Differentiable in q, k and v exactly, and in type_weights as
        ``mask_grad`` says (for every j <= i, masked pairs included, then through the mask product into
        the types).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(repr(b) for b in BACKENDS)}")
    mask_grad = _ref.check_mask_grad(mask_grad)
    window = _ref.check_attention_inputs(q, k, v, type_weights, window)
    if backend == "reference":
        return _reference_attention(q, k, v, type_weights, window, mask_grad)
    if backend == "triton":
        fn, reason = _load_triton_backend()
        if fn is None:
            raise RuntimeError(
                "the Triton backend of nats_attention is unavailable: importing "
                f"nats_kernels.nats_attention.triton_nats_attention failed ({reason}). "
                'Install triton and use CUDA tensors, or pass backend="reference".'
            )
        return fn(q, k, v, type_weights, window, mask_grad)
    # auto
    if triton_supports(q):
        fn, _ = _load_triton_backend()
        if fn is not None:
            return fn(q, k, v, type_weights, window, mask_grad)
    return _reference_attention(q, k, v, type_weights, window, mask_grad)


def nats_attention_types(q: Tensor, k: Tensor, v: Tensor, types: Tensor, window: int, backend: str = "auto") -> Tensor:
    """NAtS attention for inference (no gradient) from hard integer types: a prefill's attention over the prompt.

    Args:
        q, k, v: as for `nats_attention`.
        types: integer ``[B, Hkv, N]`` (``TOKEN_GLOBAL`` / ``TOKEN_LOCAL`` / ``TOKEN_SLIDING``).
        window: sliding window W >= 1.
        backend: ``"triton"`` (the fused kernel's forward without log-sum-exp or autograd,
            ``nats_kernels.nats_attention.nats_prefill``), ``"reference"`` (one SDPA call under the hard mask) or
            ``"auto"`` (Triton where `nats_attention` would take it).

    Returns:
        ``[B, Hq, N, D]``, equal to ``nats_attention(q, k, v, types_to_weights(types), window)`` without building
        the one-hot weights or the training kernel's autograd state.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(repr(b) for b in BACKENDS)}")
    if backend == "triton" or (backend == "auto" and triton_supports(q) and triton_available()):
        from nats_kernels.nats_attention import nats_prefill  # noqa: PLC0415

        return nats_prefill(q, k, v, types, window)
    return _ref.nats_attention_hard(q, k, v, types, _ref.check_window(window))


def _reference_attention(q, k, v, type_weights, window: int, mask_grad: str) -> Tensor:
    """The PyTorch backend: ``nats_attention_reference``, or, where no gradient is asked for and the weights are
    one-hot (evaluation, generation), the same attention as one SDPA call under the hard mask
    (``reference.nats_attention_hard``). Not while compiling: the one-hot test reads the weights."""
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, type_weights))
    if not wants_grad and not torch.compiler.is_compiling() and _ref.is_one_hot(type_weights):
        return _ref.nats_attention_hard(q, k, v, type_weights.argmax(-1), window)
    return _ref.nats_attention_reference(q, k, v, type_weights, window, mask_grad)


# ----------------------------------------------------------------------------------------------------
# sparsity / KV budget
# ----------------------------------------------------------------------------------------------------
def nats_density(type_weights: Tensor, window: int) -> Tensor:
    """Density ``rho = sum_{i >= j} M_ij / (N (N + 1) / 2)``: the sparsity loss (spec section 4).

    Args:
        type_weights: ``[..., N, 3]`` (typically ``[B, Hkv, N, 3]``) one-hot weights, may carry
            straight-through gradients.
        window: sliding window W >= 1.

    Returns:
        ``[...]`` (e.g. ``[B, Hkv]``), float32 (float64 for float64 input). O(N) time and memory; value
        and gradient equal those of ``nats_mask_soft(type_weights, window)`` summed over the causal
        area (the segment term of the global gradient included). Equals the area fraction of
        ``kv_fractions`` for hard types. Runs as the custom op ``nats::density_terms`` (``nats/ops.py``),
        so a compiled model keeps it in its graph; ``reference.nats_density`` is the autograd reference.
    """
    window = _ref.check_window(window)
    _ref.check_type_weights(type_weights)
    return _ops.density(type_weights, window)


def kv_cache_sizes(types: Tensor, window: int) -> Tensor:
    """Per-step KV-cache sizes ``c_i = sum_j M_ij`` (spec sections 5-6) in O(N).

    Args:
        types: integer ``[..., N]`` token types.
        window: sliding window W >= 1.

    Returns:
        LongTensor ``[..., N]``; equals ``nats_mask(types, window).sum(-1)``.
    """
    window = _ref.check_window(window)
    _ref.check_types(types)
    return _ref.kv_cache_sizes(types, window)


def kv_fractions(mask: Tensor) -> tuple[float, float]:
    """Area and peak KV fractions of a mask (spec section 6), averaged over the leading dims.

    Args:
        mask: BoolTensor ``[..., N, N]`` indexed ``[query i, key j]``; ``c_i`` = number of True
            entries with ``j <= i`` (entries above the diagonal are ignored: a cache cannot hold
            future tokens).

    Returns:
        ``(area, peak)`` as Python floats, each the mean over the leading dims of the per-sequence
        ``area = sum_i c_i / sum_i (i + 1)`` and ``peak = max_i c_i / N``. Full causal gives (1, 1).
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2] or mask.shape[-1] < 1:
        raise ValueError(f"mask must have shape [..., N, N] with N >= 1, got {tuple(mask.shape)}")
    N = mask.shape[-1]
    c = torch.tril(mask.bool()).sum(-1).to(torch.float64)  # [..., N]
    area = c.sum(-1) / (N * (N + 1) / 2.0)
    peak = c.amax(-1) / N
    return float(area.mean()), float(peak.mean())


def budget_fractions(budget: int, n: int) -> tuple[float, float]:
    """``(area, peak)`` of a fixed KV budget of B tokens over N steps (spec section 6).

    ``peak = min(B, N) / N`` and ``area = sum_{i<N} min(i + 1, B) / (N (N + 1) / 2)``.
    """
    if int(budget) < 1 or int(n) < 1:
        raise ValueError(f"budget and n must be >= 1, got budget={budget}, n={n}")
    B, N = int(budget), int(n)
    b = min(B, N)
    area = (b * (b + 1) // 2 + (N - b) * b) / (N * (N + 1) / 2.0)
    return area, b / N


def type_fractions(types: Tensor) -> Tensor:
    """Fractions of global, local and sliding tokens: integer ``[..., N]`` -> float32 ``[..., 3]``."""
    _ref.check_types(types)
    return _ref.type_fractions(types)


def types_to_weights(types: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """One-hot type weights ``[..., N, 3]`` (g, l, s) in ``dtype`` from integer types ``[..., N]``."""
    _ref.check_types(types)
    return _ref.types_to_weights(types, dtype)
