"""Exact PyTorch reference of NAtS attention (NATS_SPEC.md sections 1-4 and 6).

Everything here is pure PyTorch, runs on any device, and loops over no sequence position.
Attention is O(N^2) in memory (it builds the query x key mask); the density (the sparsity loss) and the
KV-cache sizes are O(N).

Conventions
-----------
* Token types (integer form): 0 = global, 1 = local, 2 = sliding.
* Type weights (float form): ``[..., N, 3]`` holding one-hot values ``(g, l, s)``; they may carry
  straight-through gradients (``onehot + y - y.detach()``). The *hard* types are ``argmax`` of the
  detached weights (for one-hot values: ``g == 1`` means global).
* Masks are ``[..., N, N]`` indexed ``[query i, key j]``.
* GQA: query head ``h`` uses KV head ``h // (Hq // Hkv)`` (the convention of ``repeat_interleave``).

The gradient of the attention with respect to the type weights is the exact derivative of the mask
formula of spec section 2 (the product ``prod_{k=j+1}^{i-1} (1 - g_k)`` included) at the hard types;
it is obtained from autograd through the vectorised product form of spec section 3.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = [
    "TOKEN_GLOBAL",
    "TOKEN_LOCAL",
    "TOKEN_SLIDING",
    "check_window",
    "check_types",
    "check_type_weights",
    "check_attention_inputs",
    "check_mask_grad",
    "MASK_GRADS",
    "next_global_index",
    "prev_global_index",
    "compact_order",
    "hard_types",
    "snap_one_hot",
    "nats_mask_hard",
    "nats_mask_soft",
    "nats_attention_reference",
    "causal_lse_reference",
    "nats_density",
    "kv_cache_sizes",
    "type_fractions",
    "types_to_weights",
]

TOKEN_GLOBAL, TOKEN_LOCAL, TOKEN_SLIDING = 0, 1, 2


# ----------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------
def check_window(window) -> int:
    """Return ``window`` as an int; raise ``ValueError`` unless it is an integer >= 1."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        if isinstance(window, Tensor) and window.numel() == 1 and not window.is_floating_point():
            window = int(window.item())
        else:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return window


MASK_GRADS = ("dense", "exact")  # spec section 3a; "dense" is the default


def check_mask_grad(mask_grad) -> str:
    """Return ``mask_grad`` if it names an estimator of spec section 3a; raise ``ValueError`` otherwise."""
    if mask_grad not in MASK_GRADS:
        raise ValueError(
            f"mask_grad must be one of {', '.join(repr(m) for m in MASK_GRADS)} (NATS_SPEC.md section 3a: "
            f"'dense' is bounded and the default, 'exact' uses the masked normaliser), got {mask_grad!r}"
        )
    return mask_grad


def check_types(types: Tensor, name: str = "types") -> None:
    """Raise unless ``types`` is an integer tensor ``[..., N]`` (N >= 1) with values in {0, 1, 2}."""
    if not isinstance(types, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(types).__name__}")
    if types.is_floating_point() or types.is_complex() or types.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token types in {{0, 1, 2}}, got dtype {types.dtype}")
    if types.dim() < 1 or types.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., N] with N >= 1, got {tuple(types.shape)}")
    if types.numel() and bool(((types < 0) | (types > 2)).any()):
        bad = types[(types < 0) | (types > 2)].unique()[:8].tolist()
        raise ValueError(f"{name} must hold token types 0 (global), 1 (local) or 2 (sliding); found {bad}")


def check_type_weights(type_weights: Tensor, name: str = "type_weights") -> None:
    """Raise unless ``type_weights`` is a floating tensor ``[..., N, 3]`` with N >= 1."""
    if not isinstance(type_weights, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(type_weights).__name__}")
    if not type_weights.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (one-hot (g, l, s) weights), got dtype {type_weights.dtype}")
    if type_weights.dim() < 2 or type_weights.shape[-1] != 3:
        raise ValueError(
            f"{name} must have shape [..., N, 3] (last dim = (global, local, sliding)), got {tuple(type_weights.shape)}"
        )
    if type_weights.shape[-2] < 1:
        raise ValueError(f"{name} must have N >= 1 tokens, got shape {tuple(type_weights.shape)}")


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, type_weights: Tensor, window) -> int:
    """Validate the arguments of NAtS attention; return the window as an int.

    q ``[B, Hq, N, D]``, k and v ``[B, Hkv, N, D]``, type_weights ``[B, Hkv, N, 3]``, Hq % Hkv == 0.
    """
    window = check_window(window)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, N, D], got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape [B, Hkv, N, D], got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    B, Hq, N, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if (Bk, Nk, Dk) != (B, N, D):
        raise ValueError(
            f"q [B, Hq, N, D] and k/v [B, Hkv, N, D] must agree in B, N and D, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of KV heads (GQA), "
            f"got Hq={Hq} (q {tuple(q.shape)}) and Hkv={Hkv} (k {tuple(k.shape)})"
        )
    check_type_weights(type_weights)
    if tuple(type_weights.shape) != (B, Hkv, N, 3):
        raise ValueError(
            f"type_weights must have shape [B, Hkv, N, 3] = {(B, Hkv, N, 3)} to match k {tuple(k.shape)}, "
            f"got {tuple(type_weights.shape)}"
        )
    if N < 1:
        raise ValueError(f"sequence length must be >= 1, got q {tuple(q.shape)}")
    devs = {t.device for t in (q, k, v, type_weights)}
    if len(devs) != 1:
        raise ValueError(f"q, k, v and type_weights must be on one device, got {sorted(map(str, devs))}")
    return window


# ----------------------------------------------------------------------------------------------------
# index helpers (O(N))
# ----------------------------------------------------------------------------------------------------
def _as_bool(x: Tensor) -> Tensor:
    return x if x.dtype == torch.bool else x != 0


def next_global_index(g_hard: Tensor) -> Tensor:
    """e_j = the first index k > j with ``g_hard[..., k]`` true, or N-1 if there is none.

    g_hard: ``[..., N]`` bool (or 0/1). Returns LongTensor ``[..., N]``.
    """
    g = _as_bool(g_hard)
    N = g.shape[-1]
    pos = torch.arange(N, device=g.device)
    idx = torch.where(g, pos, torch.full_like(pos, N))  # [..., N]
    # suffix min over k >= j, then shift by one to get k > j
    suf = idx.flip(-1).cummin(-1).values.flip(-1)
    nxt = torch.cat([suf[..., 1:], torch.full_like(suf[..., :1], N)], dim=-1)
    return nxt.clamp(max=N - 1)


def prev_global_index(g_hard: Tensor) -> Tensor:
    """p_j = the last index k < j with ``g_hard[..., k]`` true, or -1 if there is none.

    g_hard: ``[..., N]`` bool (or 0/1). Returns LongTensor ``[..., N]``.
    """
    g = _as_bool(g_hard)
    N = g.shape[-1]
    pos = torch.arange(N, device=g.device)
    idx = torch.where(g, pos, torch.full_like(pos, -1))
    pre = idx.cummax(-1).values
    return torch.cat([torch.full_like(pre[..., :1], -1), pre[..., :-1]], dim=-1)


def compact_order(types: Tensor, window: int):
    """Reference of the compact part of ``plan.compact_plan`` (the key order the kernels walk).

    Returns ``order`` [..., N] (positions: globals, then locals, then sliding tokens, each by position),
    ``lim`` [..., N] (the last query that sees each compact entry: N-1, e_j or min(j+W-1, N-1)) and
    ``cum`` [..., 3, N] (inclusive counts of each type at positions <= j), all int32.
    """
    t = types.long()
    n = t.shape[-1]
    pos = torch.arange(n, device=t.device)
    onehot = t[..., None, :] == torch.arange(3, device=t.device)[:, None]  # [..., 3, N]
    cum = onehot.long().cumsum(-1)
    tot = cum[..., -1]  # [..., 3]
    base = torch.stack([torch.zeros_like(tot[..., 0]), tot[..., 0], tot[..., 0] + tot[..., 1]], dim=-1)
    dest = base.gather(-1, t) + cum.gather(-2, t[..., None, :]).squeeze(-2) - 1
    order = torch.empty_like(t).scatter_(-1, dest, pos.expand_as(t).contiguous())
    e = next_global_index(t == TOKEN_GLOBAL)
    lim = torch.where(t == TOKEN_GLOBAL, n - 1, torch.where(t == TOKEN_LOCAL, e, (pos + window - 1).clamp(max=n - 1)))
    return order.int(), lim.gather(-1, order).int(), cum.int()


def hard_types(type_weights: Tensor) -> Tensor:
    """Integer types ``[..., N]`` = argmax of the detached weights ``[..., N, 3]``."""
    return type_weights.detach().argmax(-1)


def snap_one_hot(type_weights: Tensor) -> Tensor:
    """``onehot(argmax w) + (w - w.detach())``: exactly one-hot values, the gradient of ``w`` unchanged.

    Straight-through weights ``onehot + y - y.detach()`` are one-hot only up to a rounding error of one
    ulp; snapping makes the mask exactly 0/1 (spec section 2, "with hard types M_ij is 0 or 1"). Weights
    are one-hot by contract (spec section 9); soft weights would be treated as their argmax.
    """
    hard = torch.nn.functional.one_hot(hard_types(type_weights), 3).to(type_weights.dtype)
    return hard + (type_weights - type_weights.detach())


def _gather_prefix(cum: Tensor, idx: Tensor) -> Tensor:
    """cum[..., idx] where idx >= 0, else 0 (cum is an inclusive cumsum, idx may be -1)."""
    out = cum.gather(-1, idx.clamp(min=0))
    return torch.where(idx >= 0, out, torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------------
# masks (O(N^2))
# ----------------------------------------------------------------------------------------------------
def nats_mask_hard(types: Tensor, window: int) -> Tensor:
    """BoolTensor ``[..., N, N]`` (query x key) of spec section 2 for integer types ``[..., N]``.

    No validation (see ``nats.functional.nats_mask``).
    """
    N = types.shape[-1]
    pos = torch.arange(N, device=types.device)
    i = pos[:, None]
    j = pos[None, :]
    g = (types == TOKEN_GLOBAL)[..., None, :]
    loc = (types == TOKEN_LOCAL)[..., None, :]
    sl = (types == TOKEN_SLIDING)[..., None, :]
    e = next_global_index(types == TOKEN_GLOBAL)[..., None, :]  # [..., 1, N] per key
    # a local key j is visible up to and including its first later global e_j (to the end if none)
    m = g | (loc & (i <= e)) | (sl & ((i - j) < window))
    return m & (j <= i)


def nats_mask_soft(type_weights: Tensor, window: int) -> Tensor:
    """Differentiable NAtS mask ``[..., N, N]`` (query x key) from type weights ``[..., N, 3]``.

    Value (spec section 2): ``M_ij = g_j + l_j * prod_{k=j+1}^{i-1}(1 - g_k) + s_j [i - j < W]`` for
    j <= i, 0 above the diagonal; exactly 0/1 for one-hot weights. The product is written in the
    vectorised form of spec section 3,

        [cnt_ij = 0] * (1 - sum_{k=j+1}^{i-1} dg_k)  -  [cnt_ij = 1] * dg_{e_j},   dg = g - g.detach(),

    with cnt_ij the number of hard globals strictly between j and i and e_j the first hard global after
    j, so that autograd gives exactly the derivatives of the product at the hard types (the segment
    term of d g included). Hard types = argmax of the detached weights; the values used are those
    hard types (``snap_one_hot``), the gradient flows to ``type_weights`` unchanged.
    dtype = type_weights.dtype.
    """
    window = check_window(window)
    w = snap_one_hot(type_weights)
    N = w.shape[-2]
    dev = w.device
    g, l, s = w.unbind(-1)  # [..., N]
    gh = hard_types(w) == TOKEN_GLOBAL  # [..., N] bool

    pos = torch.arange(N, device=dev)
    i = pos[:, None]
    j = pos[None, :]
    causal = j <= i
    strict = j < i

    # cnt_ij = #hard globals in (j, i) = C_ex[i] - C_in[j] for j < i
    c_in = gh.to(torch.int64).cumsum(-1)
    c_ex = c_in - gh.to(torch.int64)
    cnt = c_ex[..., :, None] - c_in[..., None, :]
    cnt = torch.where(strict, cnt, torch.zeros_like(cnt))

    # sum_{k=j+1}^{i-1} dg_k (value 0, gradient -1 per k) via cumsums
    dg = g - g.detach()
    dg_in = dg.cumsum(-1)
    dg_ex = dg_in - dg
    sum_dg = dg_ex[..., :, None] - dg_in[..., None, :]
    sum_dg = torch.where(strict, sum_dg, torch.zeros_like(sum_dg))

    e = next_global_index(gh)
    dg_e = dg.gather(-1, e)  # [..., N] per key j

    one = (cnt == 0).to(w.dtype)
    two = (cnt == 1).to(w.dtype)
    prod = one * (1.0 - sum_dg) - two * dg_e[..., None, :]
    win = ((i - j) < window).to(w.dtype)

    m = g[..., None, :] + l[..., None, :] * prod + s[..., None, :] * win
    return torch.where(causal, m, torch.zeros_like(m))


# ----------------------------------------------------------------------------------------------------
# attention (O(N^2))
# ----------------------------------------------------------------------------------------------------
def _compute_dtype(*ts: Tensor) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def nats_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, type_weights: Tensor, window: int, mask_grad: str = "dense"
) -> Tensor:
    """Exact NAtS attention (spec section 3), pure PyTorch, O(N^2) memory.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` with ``Hq % Hkv == 0`` (query head h uses KV
            head ``h // (Hq // Hkv)``).
        type_weights: ``[B, Hkv, N, 3]`` one-hot (g, l, s) per KV head, may carry straight-through
            gradients.
        window: sliding window W >= 1 (a sliding key j is seen by queries j .. j+W-1).

    Returns ``[B, Hq, N, D]`` in q's dtype, computed in float32 (float64 if any input is float64).

    ``A_ij = M_ij exp(s_ij - m_i) / sum_k M_ik exp(s_ik - m_i)`` with ``s = q.k / sqrt(D)`` and m_i the
    detached max of s over the kept keys of row i (the value and gradient do not depend on m_i). The
    mask enters multiplicatively, so autograd gives ``dM_ij = exp(s_ij - LSE_i)(dO_i . v_j - D_i)`` for
    every j <= i, masked pairs included, and from there the type-weight gradients of spec section 3.
    That is ``mask_grad="exact"``; for a masked pair whose score exceeds the kept row max by more than
    ``log(finfo.max) / 2`` (44 nats in float32) the exponent is clamped there, so its (astronomically large)
    mask gradient stays finite.

    ``mask_grad="dense"`` (the default, spec section 3a) weights row i of dM by
    ``r_i = exp(LSE_i - LSEc_i)``, LSEc_i the log-sum-exp over every causal key, so that
    ``dM_ij = exp(s_ij - LSEc_i)(dO_i . v_j - D_i)``, bounded by ``|dO_i . v_j - D_i|``. The spec's
    autograd form ``M' = stopgrad(M) + stopgrad(r) (M - stopgrad(M))`` is applied at the kept pairs; at a
    masked pair (whose exponent only ever enters the gradient, as M_ij = 0 in value) the factor r_i is
    folded into the exponent instead, ``s_ij - m_i + log r_i``, which is at most ``log N`` above the kept
    row max: the same gradient without the clamp. The q, k, v gradients are exact in both modes.
    """
    window = check_attention_inputs(q, k, v, type_weights, window)
    mask_grad = check_mask_grad(mask_grad)
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cdt = _compute_dtype(q, k, v, type_weights)

    qf = q.to(cdt).reshape(B, Hkv, G, N, D)
    kf = k.to(cdt).unsqueeze(2)  # [B, Hkv, 1, N, D]
    vf = v.to(cdt).unsqueeze(2)
    M = nats_mask_soft(type_weights.to(cdt), window).unsqueeze(2)  # [B, Hkv, 1, N, N]

    pos = torch.arange(N, device=q.device)
    causal = pos[None, :] <= pos[:, None]
    kept = M.detach() > 0

    scores = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(D))  # [B, Hkv, G, N, N]
    row_max = scores.detach().masked_fill(~kept, float("-inf")).amax(-1, keepdim=True)  # diagonal kept
    z = scores - row_max
    if mask_grad == "exact":
        clamp = 0.5 * math.log(torch.finfo(cdt).max)
        z_masked = z.detach().clamp(max=clamp)
    else:
        # log r_i = LSE_i - LSEc_i <= 0, both relative to the kept row max (finite: the diagonal is kept)
        zd = z.detach()
        log_r = torch.logsumexp(zd.masked_fill(~kept, float("-inf")), -1, keepdim=True) - torch.logsumexp(
            zd.masked_fill(~causal, float("-inf")), -1, keepdim=True
        )
        z_masked = zd + log_r  # <= log N: exp(z_masked) / S_i = exp(s_ij - LSEc_i)
        r = torch.exp(log_r)
        Md = M.detach()
        M = Md + torch.where(kept, r, torch.ones_like(r)) * (M - Md)  # same value; kept rows' dM scaled by r_i
    z_masked = z_masked.masked_fill(~causal, float("-inf"))
    # kept pairs: differentiable scores; masked pairs: M = 0 in value, so d(M e^z)/dz = 0 there
    z = torch.where(kept, z, z_masked)
    p = M * torch.exp(z)
    a = p / p.sum(-1, keepdim=True)
    o = torch.matmul(a, vf)  # [B, Hkv, G, N, D]
    return o.reshape(B, Hq, N, D).to(q.dtype)


def is_one_hot(type_weights: Tensor) -> bool:
    """Whether every row of ``type_weights [..., 3]`` is exactly one-hot (a host sync on a GPU)."""
    w = type_weights.detach()
    return bool(((w == 0) | (w == 1)).all()) and bool((w.sum(-1) == 1).all())


def nats_attention_hard(q: Tensor, k: Tensor, v: Tensor, types: Tensor, window: int) -> Tensor:
    """NAtS attention at hard integer types ``[B, Hkv, N]`` without gradients: PyTorch's SDPA under the mask of
    spec section 2, one KV head (and its GQA group of query heads) at a time.

    Equal in value to ``nats_attention_reference`` at the one-hot weights of ``types`` (to rounding), computed in
    the same dtype, but fused attention instead of the reference's differentiable mask product and dozens of
    N x N ops: the prefill of evaluation and generation without a Triton kernel. On 2 CPU cores at SmolLM2's
    shape (N = 2000, 9 query / 3 KV heads, fp32) 0.16 s against the reference's 2.5 s. Memory: one [B, N, N] mask.
    """
    window = check_window(window)
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cdt = _compute_dtype(q, k, v)
    mask = nats_mask_hard(types, window)  # [B, Hkv, N, N]
    qg = q.to(cdt).reshape(B, Hkv, G, N, D)
    kf, vf = k.to(cdt), v.to(cdt)
    out = []
    with torch.no_grad():
        for h in range(Hkv):
            bias = torch.zeros((B, 1, N, N), dtype=cdt, device=q.device).masked_fill_(~mask[:, h, None], float("-inf"))
            out.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qg[:, h], kf[:, h, None].expand(B, G, N, D), vf[:, h, None].expand(B, G, N, D), attn_mask=bias
                )
            )
    return torch.stack(out, 1).reshape(B, Hq, N, D).to(q.dtype)


def causal_lse_reference(q: Tensor, k: Tensor) -> Tensor:
    """LSEc [B, Hq, N] (natural log, float32/64): log-sum-exp of ``q_i . k_j / sqrt(D)`` over every causal key
    j <= i, the normaliser of ``mask_grad="dense"`` (spec section 3a); GQA as in the attention."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    cdt = _compute_dtype(q, k)
    kf = k.to(cdt).repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.matmul(q.to(cdt), kf.transpose(-1, -2)) / math.sqrt(D)
    pos = torch.arange(N, device=q.device)
    return torch.logsumexp(scores.masked_fill(pos[None, :] > pos[:, None], float("-inf")), -1)


# ----------------------------------------------------------------------------------------------------
# density / KV budget (O(N))
# ----------------------------------------------------------------------------------------------------
def nats_density(type_weights: Tensor, window: int) -> Tensor:
    """Density rho = sum_{i >= j} M_ij / (N (N + 1) / 2) per leading index, in O(N) time and memory.

    type_weights: ``[..., N, 3]`` (typically ``[B, Hkv, N, 3]``); returns ``[...]`` (e.g. ``[B, Hkv]``)
    in float32 (float64 for float64 input). Value and gradient are exactly those of
    ``nats_mask_soft(type_weights, window).sum((-2, -1)) / (N (N + 1) / 2)``: with e_k / p_k the next /
    previous hard global, the column count of key k is

        g_k (N - k) + l_k (e_k - k + 1) + s_k min(W, N - k),

    and d/dg_k carries in addition the segment term ``-(sum of l_j over p_k < j < k) (e_k - k)``
    (added as a straight-through term of value 0).
    """
    window = check_window(window)
    check_type_weights(type_weights)
    cdt = _compute_dtype(type_weights)
    w = snap_one_hot(type_weights.to(cdt))
    N = w.shape[-2]
    g, l, s = w.unbind(-1)
    gh = hard_types(w) == TOKEN_GLOBAL
    e = next_global_index(gh)
    p = prev_global_index(gh)
    kpos = torch.arange(N, device=w.device)

    col_g = (N - kpos).to(cdt)
    col_l = (e - kpos + 1).to(cdt)
    col_s = (N - kpos).clamp(max=window).to(cdt)

    ld = l.detach()
    l_in = ld.cumsum(-1)
    n_loc = (l_in - ld) - _gather_prefix(l_in, p)  # sum of l_j over p_k < j < k
    dg = g - g.detach()

    total = (g * col_g + l * col_l + s * col_s).sum(-1) - (dg * n_loc * (e - kpos).to(cdt)).sum(-1)
    return total / (N * (N + 1) / 2.0)


def kv_cache_sizes(types: Tensor, window: int) -> Tensor:
    """c_i = number of keys j <= i with M_ij = 1 (the KV-cache size at step i before eviction).

    types: integer ``[..., N]``; returns LongTensor ``[..., N]``. O(N) via cumsums: the globals in
    [0, i], the locals in (p_i, i] (p_i = last global before i) and the sliding tokens in [i-W+1, i].
    """
    window = check_window(window)
    N = types.shape[-1]
    gh = types == TOKEN_GLOBAL
    g_in = gh.to(torch.int64).cumsum(-1)
    l_in = (types == TOKEN_LOCAL).to(torch.int64).cumsum(-1)
    s_in = (types == TOKEN_SLIDING).to(torch.int64).cumsum(-1)
    p = prev_global_index(gh)
    n_loc = l_in - _gather_prefix(l_in, p)
    pos = torch.arange(N, device=types.device).expand_as(s_in)
    n_sl = s_in - _gather_prefix(s_in, pos - window)
    return g_in + n_loc + n_sl


def type_fractions(types: Tensor) -> Tensor:
    """Fractions of (global, local, sliding) tokens: integer ``[..., N]`` -> float32 ``[..., 3]``."""
    return torch.nn.functional.one_hot(types.long(), 3).to(torch.float32).mean(-2)


def types_to_weights(types: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """One-hot type weights ``[..., N, 3]`` (g, l, s) from integer types ``[..., N]``."""
    return torch.nn.functional.one_hot(types.long(), 3).to(dtype)


def density_terms_reference(type_weights: Tensor, window: int):
    """(rho [...], coef [..., N, 3], stats [..., 5]) of type weights [..., N, 3]: the density of the hard types
    (spec section 4), its gradient with respect to the weights (the segment term of the global weight included,
    divided by the area) and the KV statistics (density, peak, global / local / sliding fractions; section 6).
    Reference of ``density.py``; run by the custom op ``nats::density_terms`` (``nats/ops.py``) off CUDA."""
    cdt = _compute_dtype(type_weights)
    w = type_weights.detach()
    N = w.shape[-2]
    types = hard_types(w)
    g = types == TOKEN_GLOBAL
    is_l = types == TOKEN_LOCAL
    e = next_global_index(g)
    p = prev_global_index(g)
    k = torch.arange(N, device=w.device)
    col_g = (N - k).to(cdt).expand(types.shape)  # column counts of key k under each type
    col_l = (e - k + 1).to(cdt)
    col_s = (N - k).clamp(max=window).to(cdt).expand(types.shape)
    l_in = is_l.to(torch.int64).cumsum(-1)
    n_loc = (l_in - is_l.to(torch.int64)) - _gather_prefix(l_in, p)  # locals strictly between p_k and k
    # d rho / d g_k carries the segment term: making k global ends the locals before it at k
    coef = torch.stack([col_g - (n_loc * (e - k)).to(cdt), col_l, col_s], dim=-1)
    area = N * (N + 1) / 2.0
    rho = torch.where(g, col_g, torch.where(is_l, col_l, col_s)).sum(-1) / area
    # KV-cache sizes c_i = globals in [0, i] + locals in (p_i, i] + sliding in [i-W+1, i] (spec section 6)
    s_in = (types == TOKEN_SLIDING).to(torch.int64).cumsum(-1)
    c = g.to(torch.int64).cumsum(-1) + (n_loc + is_l) + (s_in - _gather_prefix(s_in, (k - window).expand_as(s_in)))
    frac = type_fractions(types)
    stats = torch.cat([rho.float()[..., None], (c.amax(-1).float() / N)[..., None], frac], dim=-1)
    return rho, coef / area, stats
