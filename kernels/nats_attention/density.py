"""NAtS density terms in one Triton program per (batch, head) row: the sparsity loss, its gradient and the KV
statistics (NATS_SPEC.md sections 4 and 6), which ``nats/ops.py`` (``nats::density_terms``) otherwise computes
with ~25 eager PyTorch ops per layer (``reference.density_terms_reference``, the reference of this kernel).

Per row of type weights ``w [N, 3]`` (hard types = argmax, first index on ties), with ``g``/``l``/``s`` the
global/local/sliding indicators, ``e_k`` the next global after k (N-1 if none) and ``p_k`` the previous one
(-1 if none):

    col_g = N - k,  col_l = e_k - k + 1,  col_s = min(N - k, W)        (key k's column count per type)
    n_loc_k = locals strictly between p_k and k
    rho  = sum_k col_{type_k} / area,  area = N (N + 1) / 2
    coef = [col_g - n_loc_k (e_k - k), col_l, col_s] / area            (d rho / d w_k, segment term included)
    c_i  = globals in [0, i] + locals in (p_i, i] + sliding in [i-W+1, i];  peak = max_i c_i / N

The scans (next/previous global, local and sliding prefix counts) are ``tl.associative_scan`` / ``tl.cumsum``
over the row. Values at k-1, k+1 and k-W come from loading the weights again at those offsets, since register
tensors cannot be shifted; ``l_in[p_k]`` (a gather) is the running maximum of ``g_j * l_in[j]`` over j < k,
which equals it because ``l_in`` (the inclusive local count) never decreases.

Outputs: ``rho [R]`` fp32, ``coef [R, N, 3]`` fp32, ``stats [R, 5]`` fp32 (density, peak, global / local /
sliding fractions), for ``R`` rows of fp16/bf16/fp32 weights. fp64 weights and rows longer than ``MAX_N`` use
the reference.
"""

import torch

from ._env import empty, tl, triton

MAX_N = 16384  # one program holds a row: beyond this, the reference


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _types_at(w_row, pos, N):
    """Hard types at positions ``pos`` (argmax of the 3 weights, first index on ties); -1 outside [0, N)."""
    ok = (pos >= 0) & (pos < N)
    w0 = tl.load(w_row + pos * 3 + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_row + pos * 3 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_row + pos * 3 + 2, mask=ok, other=0.0).to(tl.float32)
    t = tl.where(w1 > w0, 1, 0)
    best = tl.maximum(w0, w1)
    t = tl.where(w2 > best, 2, t)
    return tl.where(ok, t, -1)


@triton.jit
def _density_kernel(w_ptr, rho_ptr, coef_ptr, stats_ptr, N, W, inv_area, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    w_row = w_ptr + row * N * 3
    k = tl.arange(0, BLOCK)
    inside = k < N

    t = _types_at(w_row, k, N)
    g = (t == 0).to(tl.int32)
    is_l = (t == 1).to(tl.int32)
    is_s = (t == 2).to(tl.int32)

    # e_k: first global j > k (N-1 if none) = reverse running min of (j if global else N) over j >= k+1
    t_next = _types_at(w_row, k + 1, N)
    cand = tl.where(t_next == 0, k + 1, N)
    e = tl.associative_scan(cand, 0, _min_combine, reverse=True)
    e = tl.minimum(e, N - 1)

    # locals strictly between p_k and k: (l_in[k] - l_k) - l_in[p_k]; l_in[p_k] = max over j < k of g_j l_in[j]
    l_in = tl.cumsum(is_l, 0)
    t_prev = _types_at(w_row, k - 1, N)
    l_in_prev = l_in - is_l  # l_in[k-1]
    v_prev = tl.where(t_prev == 0, l_in_prev, 0)
    l_at_p = tl.associative_scan(v_prev, 0, _max_combine)
    n_loc = l_in_prev - l_at_p

    # sliding in [k-W+1, k] = s_in[k] - s_in[k-W]; s_in[k-W] = running sum of is_s shifted by W
    s_in = tl.cumsum(is_s, 0)
    t_back = _types_at(w_row, k - W, N)
    s_back = tl.cumsum((t_back == 2).to(tl.int32), 0)
    c = tl.cumsum(g, 0) + n_loc + is_l + (s_in - s_back)

    kf = k.to(tl.float32)
    col_g = N - kf
    col_l = (e - k + 1).to(tl.float32)
    col_s = tl.minimum(N - k, W).to(tl.float32)
    chosen = tl.where(g == 1, col_g, tl.where(is_l == 1, col_l, col_s))
    rho = tl.sum(tl.where(inside, chosen, 0.0), 0) * inv_area

    c_row = coef_ptr + row * N * 3 + k * 3
    tl.store(c_row + 0, (col_g - (n_loc * (e - k)).to(tl.float32)) * inv_area, mask=inside)
    tl.store(c_row + 1, col_l * inv_area, mask=inside)
    tl.store(c_row + 2, col_s * inv_area, mask=inside)

    tl.store(rho_ptr + row, rho)
    inv_n = 1.0 / N
    peak = tl.max(tl.where(inside, c, 0), 0).to(tl.float32) * inv_n
    s_row = stats_ptr + row * 5
    tl.store(s_row + 0, rho)
    tl.store(s_row + 1, peak)
    tl.store(s_row + 2, tl.sum(g, 0).to(tl.float32) * inv_n)
    tl.store(s_row + 3, tl.sum(is_l, 0).to(tl.float32) * inv_n)
    tl.store(s_row + 4, tl.sum(is_s, 0).to(tl.float32) * inv_n)


def supported(type_weights: torch.Tensor) -> bool:
    """Whether :func:`density_terms` runs the kernel for these weights (else use the reference)."""
    return (
        type_weights.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and 1 <= type_weights.shape[-2] <= MAX_N
        and type_weights.shape[-1] == 3
    )


def density_terms(type_weights: torch.Tensor, window: int):
    """(rho [...], coef [..., N, 3], stats [..., 5]) of weights [..., N, 3], all fp32 (see the module docstring)."""
    if not supported(type_weights):
        raise ValueError(
            f"density kernel: weights [..., N <= {MAX_N}, 3] in fp16/bf16/fp32, got "
            f"{tuple(type_weights.shape)} {type_weights.dtype}"
        )
    lead, N = type_weights.shape[:-2], type_weights.shape[-2]
    w = type_weights.detach().reshape(-1, N, 3).contiguous()
    R = w.shape[0]
    rho = empty((R,), torch.float32, w.device)
    coef = empty((R, N, 3), torch.float32, w.device)
    stats = empty((R, 5), torch.float32, w.device)
    if R:
        block = max(16, triton.next_power_of_2(N))
        _density_kernel[(R,)](
            w,
            rho,
            coef,
            stats,
            N,
            int(window),
            1.0 / (N * (N + 1) / 2.0),
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return rho.reshape(lead), coef.reshape(*lead, N, 3), stats.reshape(*lead, 5)
