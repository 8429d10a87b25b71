"""Spec-driven tests of nats.functional and the NAtS reference (NATS_SPEC.md sections 1-4, 6, 9).

Everything is checked against independent brute-force forms of the spec: Python loops over (i, j) for the
mask, the explicit product prod_{k=j+1}^{i-1} (1 - g_k) differentiated by autograd for the gradients,
and the closed-form gradient formulas of section 3.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from nats import functional as NF
from nats_kernels.nats_attention import reference as R

F64 = torch.float64
TOL = 1e-10


# ----------------------------------------------------------------------------------------------------
# brute-force forms of the spec
# ----------------------------------------------------------------------------------------------------
def rand_types(shape, gen, probs=None) -> torch.Tensor:
    """Random integer types; the type distribution itself is random unless given."""
    if probs is None:
        probs = torch.rand(3, generator=gen) + 0.05
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=torch.long)
    return torch.multinomial(probs, n, replacement=True, generator=gen).reshape(shape)


def brute_mask(types: list[int], W: int) -> list[list[int]]:
    """Section 2 literally, with Python ints."""
    N = len(types)
    M = [[0] * N for _ in range(N)]
    for i in range(N):
        for j in range(i + 1):
            g, l, s = (types[j] == 0), (types[j] == 1), (types[j] == 2)
            prod = math.prod(1 - (types[k] == 0) for k in range(j + 1, i))
            M[i][j] = int(g + l * prod + s * (i - j < W))
    return M


def loop_mask(w: torch.Tensor, W: int) -> torch.Tensor:
    """Differentiable mask [..., N, N] from weights [..., N, 3] with the explicit running product."""
    g, l, s = w.unbind(-1)
    N = w.shape[-2]
    zero = torch.zeros_like(g[..., 0])
    rows = []
    for i in range(N):
        row = [zero] * N
        p = torch.ones_like(g[..., 0])  # prod_{k=j+1}^{i-1} (1 - g_k)
        for j in range(i, -1, -1):
            row[j] = g[..., j] + l[..., j] * p + s[..., j] * (1.0 if i - j < W else 0.0)
            if j < i:
                p = p * (1 - g[..., j])
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)


def loop_attention(q, k, v, w, W, mask_grad="exact"):
    """A = M exp(s) / sum M exp(s) straight from spec section 3 (no max subtraction), float64; for
    ``mask_grad="dense"`` with section 3a's M' = stopgrad(M) + stopgrad(r) (M - stopgrad(M))."""
    G = q.shape[1] // k.shape[1]
    M = loop_mask(w, W).repeat_interleave(G, dim=1)
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask_grad == "dense":
        with torch.no_grad():
            e = torch.exp(s).tril()
            r = (M * e).sum(-1, keepdim=True) / e.sum(-1, keepdim=True)  # exp(LSE_i - LSEc_i)
        M = M.detach() + r * (M - M.detach())
    p = M * torch.exp(s)
    return (p / p.sum(-1, keepdim=True)) @ v


def st_weights(types, gen, dtype=F64):
    """Straight-through one-hot weights onehot + y - y.detach() with a random soft leaf y."""
    y = torch.softmax(torch.randn(*types.shape, 3, generator=gen, dtype=dtype), -1).requires_grad_()
    w = F.one_hot(types, 3).to(dtype) + y - y.detach()
    return w, y


def qkv(B, Hq, Hkv, N, D, gen, dtype=F64, scale=1.0):
    q = (scale * torch.randn(B, Hq, N, D, generator=gen, dtype=dtype)).requires_grad_()
    k = torch.randn(B, Hkv, N, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hkv, N, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def next_prev_brute(types):
    N = len(types)
    e = [next((k for k in range(j + 1, N) if types[k] == 0), N - 1) for j in range(N)]
    p = [next((k for k in range(j - 1, -1, -1) if types[k] == 0), -1) for j in range(N)]
    return e, p


def segment_types(N, gen):
    """Types with long runs of locals between globals, so the segment term of d g is exercised."""
    t = rand_types((N,), gen, probs=torch.tensor([0.15, 0.7, 0.15]))
    t[0] = 0
    return t


# ----------------------------------------------------------------------------------------------------
# mask
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 13, 31, 64])
def test_nats_mask_matches_bruteforce(N):
    gen = torch.Generator().manual_seed(N)
    for W in sorted({1, 2, 3, max(1, N // 3), N, N + 5}):
        types = rand_types((2, 3, N), gen)
        m = NF.nats_mask(types, W)
        assert m.dtype == torch.bool and m.shape == (2, 3, N, N)
        for a in range(2):
            for b in range(3):
                ref = torch.tensor(brute_mask(types[a, b].tolist(), W), dtype=torch.bool)
                assert torch.equal(m[a, b], ref), (types[a, b].tolist(), W)
        # unbatched input gives the same
        assert torch.equal(NF.nats_mask(types[1, 2], W), m[1, 2])


def test_nats_mask_hand_example():
    # g l s l g l, W = 2
    t = torch.tensor([0, 1, 2, 1, 0, 1])
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],  # query 4 is the global after locals 1, 3: still sees them
            [1, 0, 0, 0, 1, 1],  # afterwards they are gone
        ],
        dtype=torch.bool,
    )
    assert torch.equal(NF.nats_mask(t, 2), expect)


def test_diagonal_always_one_and_soft_value_exact():
    gen = torch.Generator().manual_seed(1)
    for N in [1, 4, 17, 40]:
        for W in [1, 3, 100]:
            types = rand_types((3, N), gen)
            m = NF.nats_mask(types, W)
            assert m.diagonal(dim1=-2, dim2=-1).all()
            assert not m.triu(1).any()
            w, _ = st_weights(types, gen)
            soft = NF.nats_mask_soft(w, W)
            assert torch.equal(soft.detach(), m.to(F64))  # exactly 0/1


def test_next_prev_global_index():
    gen = torch.Generator().manual_seed(2)
    for N in [1, 2, 9, 30]:
        types = rand_types((4, N), gen)
        e = R.next_global_index(types == 0)
        p = R.prev_global_index(types == 0)
        assert e.dtype == torch.long and p.dtype == torch.long
        for r in range(4):
            eb, pb = next_prev_brute(types[r].tolist())
            assert e[r].tolist() == eb
            assert p[r].tolist() == pb
    assert NF.next_global_index(torch.tensor([False, False])).tolist() == [1, 1]
    assert NF.prev_global_index(torch.tensor([True, False, True])).tolist() == [-1, 0, 0]


def test_token_counts():
    """Column counts (keys) and row counts (cache sizes) of the mask against closed forms."""
    gen = torch.Generator().manual_seed(3)
    for N in [1, 5, 23, 64]:
        for W in [1, 4, N + 1]:
            types = rand_types((2, 2, N), gen)
            m = NF.nats_mask(types, W)
            e = R.next_global_index(types == 0)
            kk = torch.arange(N)
            col = (types == 0) * (N - kk) + (types == 1) * (e - kk + 1) + (types == 2) * torch.clamp(N - kk, max=W)
            assert torch.equal(m.sum(-2), col)
            c = NF.kv_cache_sizes(types, W)
            assert c.dtype == torch.long
            assert torch.equal(c, m.sum(-1))
    fr = NF.type_fractions(torch.tensor([[0, 1, 1, 2], [2, 2, 2, 2]]))
    assert torch.allclose(fr, torch.tensor([[0.25, 0.5, 0.25], [0.0, 0.0, 1.0]]))
    w = NF.types_to_weights(torch.tensor([0, 2, 1]))
    assert torch.equal(w, torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]]))


# ----------------------------------------------------------------------------------------------------
# attention: values and gradients
# ----------------------------------------------------------------------------------------------------
ATTN_CASES = [
    # B, Hq, Hkv, N, D, W
    (1, 2, 2, 1, 4, 1),
    (2, 4, 2, 7, 8, 3),
    (1, 4, 2, 33, 8, 5),
    (1, 2, 1, 63, 4, 10),
    (1, 1, 1, 33, 4, 64),
    (1, 3, 3, 20, 6, 1),
]


@pytest.mark.parametrize("mask_grad", ["dense", "exact"])
@pytest.mark.parametrize("B,Hq,Hkv,N,D,W", ATTN_CASES)
def test_attention_matches_loop_reference(B, Hq, Hkv, N, D, W, mask_grad):
    gen = torch.Generator().manual_seed(N * 100 + Hq)
    types = rand_types((B, Hkv, N), gen)
    if N > 8:
        types[..., : N // 2] = segment_types(N // 2, gen)  # make sure the segment term appears
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, scale=1.5)
    dO = torch.randn(B, Hq, N, D, generator=gen, dtype=F64)

    w, y = st_weights(types, gen)
    o = NF.nats_attention(q, k, v, w, W, backend="reference", mask_grad=mask_grad)
    assert o.shape == (B, Hq, N, D) and o.dtype == F64
    got = torch.autograd.grad((o * dO).sum(), (q, k, v, y))

    w2 = F.one_hot(types, 3).to(F64) + y - y.detach()
    o2 = loop_attention(q, k, v, w2, W, mask_grad)
    exp = torch.autograd.grad((o2 * dO).sum(), (q, k, v, y))

    torch.testing.assert_close(o, o2, atol=TOL, rtol=TOL)
    for name, a, b in zip("q k v y".split(), got, exp):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, n=name: f"d{n}: {m}")
    assert N == 1 or got[3].abs().sum() > 0


@pytest.mark.parametrize("B,Hq,Hkv,N,D,W", ATTN_CASES)
def test_inference_attention_takes_the_hard_mask_path(B, Hq, Hkv, N, D, W, monkeypatch):
    """Without gradients and at one-hot weights the PyTorch backend runs SDPA under the hard mask
    (``reference.nats_attention_hard``): the loop reference's values; with gradients, or at weights that are not
    one-hot, it stays on the differentiable reference."""
    gen = torch.Generator().manual_seed(N * 7 + Hq)
    types = rand_types((B, Hkv, N), gen)
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, scale=1.5)
    w = F.one_hot(types, 3).to(F64)
    want = loop_attention(q.detach(), k.detach(), v.detach(), w, W, "dense")
    calls = []
    hard = R.nats_attention_hard
    monkeypatch.setattr(R, "nats_attention_hard", lambda *a: calls.append(1) or hard(*a))
    with torch.no_grad():
        got = NF.nats_attention(q, k, v, w, W, backend="reference")
    assert calls and got.dtype == F64
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    calls.clear()
    NF.nats_attention(q, k, v, w, W, backend="reference")  # q, k, v require grad
    soft = w * 0.9 + 0.1 / 3
    with torch.no_grad():
        NF.nats_attention(q, k, v, soft, W, backend="reference")
    assert not calls


@pytest.mark.parametrize("mask_grad", ["dense", "exact"])
@pytest.mark.parametrize("N,W,Hq,Hkv", [(24, 4, 2, 1), (17, 1, 1, 1), (12, 30, 2, 2)])
def test_type_gradients_match_spec_formulas(N, W, Hq, Hkv, mask_grad):
    """The type gradients equal the closed forms of section 3 (segment term included) over the dM of the
    estimator of section 3a."""
    gen = torch.Generator().manual_seed(7 + N)
    B, D = 1, 5
    types = torch.stack([segment_types(N, gen) for _ in range(Hkv)]).unsqueeze(0)
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, scale=2.0)
    dO = torch.randn(B, Hq, N, D, generator=gen, dtype=F64)
    w, y = st_weights(types, gen)
    o = NF.nats_attention(q, k, v, w, W, backend="reference", mask_grad=mask_grad)
    (dy,) = torch.autograd.grad((o * dO).sum(), (y,))

    # dM_ij = exp(s_ij - LSE_i) (dO_i . v_j - D_i) for every j <= i, summed over the query heads of a group;
    # "dense": LSE_i over every causal key instead of the kept ones
    G = Hq // Hkv
    with torch.no_grad():
        M = NF.nats_mask(types, W).to(F64).repeat_interleave(G, 1)
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = q @ kr.transpose(-1, -2) / math.sqrt(D)
        norm_mask = M == 0 if mask_grad == "exact" else torch.ones_like(M).tril() == 0
        lse = torch.logsumexp(s.masked_fill(norm_mask, float("-inf")), -1, keepdim=True)
        Di = (dO * o).sum(-1, keepdim=True)
        dM = torch.exp(s - lse) * (dO @ vr.transpose(-1, -2) - Di)
        dM = dM.tril().reshape(B, Hkv, G, N, N).sum(2)

    seg_nonzero = False
    for h in range(Hkv):
        t = types[0, h].tolist()
        e, p = next_prev_brute(t)
        d = dM[0, h]
        for kk in range(N):
            ds = sum(d[i, kk] for i in range(kk, min(kk + W - 1, N - 1) + 1))
            dl = sum(d[i, kk] for i in range(kk, e[kk] + 1))
            seg = sum(d[i, j] for j in range(p[kk] + 1, kk) if t[j] == 1 for i in range(kk + 1, e[kk] + 1))
            dg = sum(d[i, kk] for i in range(kk, N)) - seg
            seg_nonzero |= abs(float(seg)) > 1e-6
            exp = torch.tensor([float(dg), float(dl), float(ds)], dtype=F64)
            torch.testing.assert_close(dy[0, h, kk], exp, atol=TOL, rtol=TOL, msg=f"head {h} token {kk}")
    assert seg_nonzero


def test_mask_grad_estimators_differ_and_dense_is_bounded():
    """Masked keys scoring far above the kept ones: "exact" type gradients explode (exp(s - LSE) at masked
    pairs), "dense" ones stay within the bound of section 3a (|dM_ij| <= |dO_i . v_j - D_i|), and the two
    estimators give the same output and the same q, k, v gradients."""
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, N, D, W = 1, 2, 1, 40, 8, 3
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, scale=1.0)
    types = torch.ones(B, Hkv, N, dtype=torch.long)
    types[..., ::8] = 0  # segments of locals: the locals of a finished segment are masked
    with torch.no_grad():  # make masked old locals score high for late queries: k_j aligned with q_i
        k[..., 1:8, :] = 4.0 * q[:, :1, -1:, :].mean(-2, keepdim=True)
    dO = torch.randn(B, Hq, N, D, generator=gen, dtype=F64)
    res = {}
    for mg in ("dense", "exact"):
        w, y = st_weights(types, torch.Generator().manual_seed(3))
        o = NF.nats_attention(q, k, v, w, W, backend="reference", mask_grad=mg)
        res[mg] = (o, *torch.autograd.grad((o * dO).sum(), (q, k, v, y)))
    for a, b in zip(res["dense"][:4], res["exact"][:4]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    dy_dense, dy_exact = res["dense"][4], res["exact"][4]
    assert dy_exact.abs().max() > 100 * dy_dense.abs().max()
    # bound: every type gradient is a sum of at most N (dense) terms each bounded by max |dO.v - D|
    with torch.no_grad():
        o = res["dense"][0]
        bound = (dO @ v.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) - (dO * o).sum(-1, keepdim=True)).abs().max()
    assert dy_dense.abs().max() <= 2 * Hq * N * bound  # dg has two sums (column and segment term)


def test_mask_grad_is_validated():
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(1, 2, 1, 5, 4, gen)
    w = NF.types_to_weights(rand_types((1, 1, 5), gen), F64)
    with pytest.raises(ValueError, match="mask_grad must be one of 'dense', 'exact'"):
        NF.nats_attention(q, k, v, w, 2, mask_grad="unmasked")


def test_gradcheck_qkv():
    gen = torch.Generator().manual_seed(11)
    types = rand_types((1, 2, 9), gen)
    w = NF.types_to_weights(types, F64)
    q, k, v = qkv(1, 4, 2, 9, 3, gen)
    assert torch.autograd.gradcheck(lambda q, k, v: NF.nats_attention(q, k, v, w, 3, backend="reference"), (q, k, v))


def _dense(q, k, v):
    G = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)


@pytest.mark.parametrize("N", [1, 16, 45])
def test_special_types_reduce_to_known_attention(N):
    gen = torch.Generator().manual_seed(N)
    B, Hq, Hkv, D = 2, 4, 2, 8
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, dtype=torch.float32)
    dense = _dense(q, k, v)

    def run(types, W):
        w = NF.types_to_weights(torch.full((B, Hkv, N), types, dtype=torch.long))
        return NF.nats_attention(q, k, v, w, W, backend="reference")

    torch.testing.assert_close(run(0, 1), dense, atol=1e-5, rtol=1e-5)  # all global
    torch.testing.assert_close(run(2, N), dense, atol=1e-5, rtol=1e-5)  # sliding, W >= N
    torch.testing.assert_close(run(2, N + 7), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run(1, 1), dense, atol=1e-5, rtol=1e-5)  # all local, no global ahead
    # sliding with W = 1: every query sees only itself
    torch.testing.assert_close(run(2, 1), v.repeat_interleave(Hq // Hkv, 1), atol=1e-6, rtol=1e-6)
    # auto on CPU is the reference
    w = NF.types_to_weights(rand_types((B, Hkv, N), gen))
    assert torch.equal(NF.nats_attention(q, k, v, w, 3), NF.nats_attention(q, k, v, w, 3, backend="reference"))


def test_future_tokens_never_change_the_past():
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, N, D, W = 2, 4, 2, 30, 8, 4
    q, k, v = qkv(B, Hq, Hkv, N, D, gen)
    types = rand_types((B, Hkv, N), gen)
    o = NF.nats_attention(q, k, v, NF.types_to_weights(types, F64), W, backend="reference")
    for t in [0, 5, 17, 28]:
        q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
        types2 = types.clone()
        q2[:, :, t + 1 :] = torch.randn(q2[:, :, t + 1 :].shape, generator=gen, dtype=F64)
        k2[:, :, t + 1 :] = 10 * torch.randn(k2[:, :, t + 1 :].shape, generator=gen, dtype=F64)
        v2[:, :, t + 1 :] = torch.randn(v2[:, :, t + 1 :].shape, generator=gen, dtype=F64)
        types2[..., t + 1 :] = rand_types(types2[..., t + 1 :].shape, gen)
        o2 = NF.nats_attention(q2, k2, v2, NF.types_to_weights(types2, F64), W, backend="reference")
        torch.testing.assert_close(o2[:, :, : t + 1], o[:, :, : t + 1], atol=1e-13, rtol=1e-13)
        m, m2 = NF.nats_mask(types, W), NF.nats_mask(types2, W)
        assert torch.equal(m[..., : t + 1, :], m2[..., : t + 1, :])


def test_low_precision_inputs_and_extreme_scores():
    gen = torch.Generator().manual_seed(9)
    B, Hq, Hkv, N, D, W = 1, 2, 1, 40, 16, 3
    q, k, v = qkv(B, Hq, Hkv, N, D, gen, dtype=torch.float32)
    types = rand_types((B, Hkv, N), gen)
    w = NF.types_to_weights(types)
    o32 = NF.nats_attention(q, k, v, w, W, backend="reference")
    for dt in (torch.bfloat16, torch.float16):
        o = NF.nats_attention(q.to(dt), k.to(dt), v.to(dt), w.to(dt), W, backend="reference")
        assert o.dtype == dt
        torch.testing.assert_close(o.float(), o32, atol=3e-2, rtol=3e-2)
    # huge scores on masked pairs: no inf / nan in the output or any gradient
    q2 = (q.detach() * 300).requires_grad_()
    types[..., 1:] = 1
    types[..., 5::6] = 0
    w2, y = st_weights(types, gen, dtype=torch.float32)
    o = NF.nats_attention(q2, k, v, w2, W, backend="reference")
    grads = torch.autograd.grad(o.sum(), (q2, k, v, y))
    assert torch.isfinite(o).all()
    assert all(torch.isfinite(g).all() for g in grads)


# ----------------------------------------------------------------------------------------------------
# density and KV budget
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,W", [(1, 1), (6, 2), (19, 1), (33, 5), (40, 64)])
def test_density_value_and_gradient(N, W):
    gen = torch.Generator().manual_seed(N + 1000 * W)
    B, H = 2, 3
    types = rand_types((B, H, N), gen)
    if N > 4:
        types[0, 0] = segment_types(N, gen)
    w, y = st_weights(types, gen)
    rho = NF.nats_density(w, W)
    assert rho.shape == (B, H) and rho.dtype == F64
    area = N * (N + 1) / 2
    m = NF.nats_mask(types, W)
    torch.testing.assert_close(rho.detach(), m.sum((-2, -1)).to(F64) / area, atol=1e-12, rtol=0)
    c = torch.randn(B, H, generator=gen, dtype=F64)
    (g_fast,) = torch.autograd.grad((rho * c).sum(), (y,))

    # autograd of the O(N^2) vectorised form and of the explicit product
    (g_soft,) = torch.autograd.grad(((NF.nats_mask_soft(w, W).sum((-2, -1)) / area) * c).sum(), (y,))
    w2 = F.one_hot(types, 3).to(F64) + y - y.detach()
    (g_loop,) = torch.autograd.grad(((loop_mask(w2, W).sum((-2, -1)) / area) * c).sum(), (y,))
    torch.testing.assert_close(g_fast, g_soft, atol=TOL, rtol=TOL)
    torch.testing.assert_close(g_fast, g_loop, atol=TOL, rtol=TOL)

    # closed form: d/dg_k = (N - k) - #(locals in (p_k, k)) (e_k - k), d/dl_k = e_k - k + 1, d/ds_k = min(W, N - k)
    for a in range(B):
        for h in range(H):
            t = types[a, h].tolist()
            e, p = next_prev_brute(t)
            for kk in range(N):
                nloc = sum(1 for j in range(p[kk] + 1, kk) if t[j] == 1)
                exp = (
                    torch.tensor([N - kk - nloc * (e[kk] - kk), e[kk] - kk + 1, min(W, N - kk)], dtype=F64)
                    * c[a, h]
                    / area
                )
                torch.testing.assert_close(g_fast[a, h, kk], exp, atol=TOL, rtol=TOL)


def test_density_segment_term_by_hand():
    # g l l s g : making token 3 (sliding) global would hide locals 1 and 2 from query 4
    types = torch.tensor([0, 1, 1, 2, 0])
    w = NF.types_to_weights(types, F64).requires_grad_()
    (grad,) = torch.autograd.grad(NF.nats_density(w, 2).sum() * 15, (w,))
    # d g_3 = (N - 3) - 2 locals * (e_3 - 3) = 2 - 2 * 1 = 0
    assert grad[3, 0].item() == 0.0
    # d g_2 = (5 - 2) - 1 local * (4 - 2) = 1;  d g_1 = 4 - 0 = 4
    assert grad[2, 0].item() == 1.0 and grad[1, 0].item() == 4.0
    assert grad[:, 1].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]  # e_k - k + 1 (e_4 = N - 1 = 4)
    assert grad[:, 2].tolist() == [2.0, 2.0, 2.0, 2.0, 1.0]


def test_density_is_cheap_at_training_size():
    gen = torch.Generator().manual_seed(0)
    B, H, N, W = 16, 12, 1024, 64
    types = rand_types((B, H, N), gen)
    y = torch.softmax(torch.randn(B, H, N, 3, generator=gen), -1).requires_grad_()
    w = F.one_hot(types, 3).float() + y - y.detach()
    t0 = time.perf_counter()
    rho = NF.nats_density(w, W)
    rho.mean().backward()
    dt = time.perf_counter() - t0
    assert rho.shape == (B, H) and torch.isfinite(y.grad).all()
    c = NF.kv_cache_sizes(types, W)
    torch.testing.assert_close(rho.detach().double(), c.sum(-1).double() / (N * (N + 1) / 2), atol=1e-6, rtol=0)
    assert dt < 5.0, f"density fwd+bwd took {dt:.2f} s"


def test_kv_fractions():
    N = 12
    full = torch.ones(N, N, dtype=torch.bool).tril()
    assert NF.kv_fractions(full) == (1.0, 1.0)
    assert NF.kv_fractions(torch.ones(3, N, N, dtype=torch.bool)) == (1.0, 1.0)  # upper part ignored
    for budget in [1, 3, 6, 12, 20]:
        i = torch.arange(N)[:, None]
        j = torch.arange(N)[None, :]
        m = (j <= i) & (i - j < budget)  # a fixed budget of B most recent tokens
        area, peak = NF.kv_fractions(m)
        ba, bp = NF.budget_fractions(budget, N)
        assert area == pytest.approx(ba, abs=1e-12) and peak == pytest.approx(bp, abs=1e-12)
        assert bp == min(budget, N) / N
        assert ba == pytest.approx(sum(min(k + 1, budget) for k in range(N)) / (N * (N + 1) / 2))
    assert NF.budget_fractions(1, 4) == pytest.approx((4 / 10, 0.25))
    # NAtS masks: area == density, peak == max cache size / N, averaged over leading dims
    gen = torch.Generator().manual_seed(4)
    types = rand_types((2, 3, 25), gen)
    m = NF.nats_mask(types, 4)
    area, peak = NF.kv_fractions(m)
    assert area == pytest.approx(NF.nats_density(NF.types_to_weights(types), 4).mean().item(), abs=1e-6)
    c = NF.kv_cache_sizes(types, 4)
    assert peak == pytest.approx((c.amax(-1).double() / 25).mean().item(), abs=1e-12)
    # a hand case: g s s with W = 1 -> c = [1, 2, 2]
    m = NF.nats_mask(torch.tensor([0, 2, 2]), 1)
    assert NF.kv_fractions(m) == pytest.approx((5 / 6, 2 / 3))


# ----------------------------------------------------------------------------------------------------
# errors and backends
# ----------------------------------------------------------------------------------------------------
def test_errors():
    t = torch.tensor([0, 1, 2])
    for bad in (0, -3):
        with pytest.raises(ValueError, match=r"window must be >= 1, got"):
            NF.nats_mask(t, bad)
    with pytest.raises(ValueError, match="window"):
        NF.nats_mask(t, 1.5)
    with pytest.raises(ValueError, match=r"token types|0 \(global\)"):
        NF.nats_mask(torch.tensor([0, 3, 1]), 2)
    with pytest.raises(ValueError, match="0 \\(global\\)"):
        NF.kv_cache_sizes(torch.tensor([-1, 0]), 2)
    with pytest.raises(TypeError, match="integer"):
        NF.nats_mask(torch.tensor([0.0, 1.0]), 2)

    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    w = NF.types_to_weights(torch.zeros(1, 2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"window must be >= 1, got 0"):
        NF.nats_attention(q, k, v, w, 0)
    with pytest.raises(ValueError, match=r"\(1, 2, 5, 3\)"):
        NF.nats_attention(q, k, v, w[:, :, :4], 2)
    with pytest.raises(ValueError, match=r"\[\.\.\., N, 3\]"):
        NF.nats_attention(q, k, v, torch.zeros(1, 2, 5, 4), 2)
    with pytest.raises(ValueError, match=r"\[\.\.\., N, 3\]"):
        NF.nats_density(torch.zeros(2, 5, 2), 2)
    with pytest.raises(ValueError, match=r"multiple"):
        NF.nats_attention(torch.randn(1, 3, 5, 8), k, v, w, 2)
    with pytest.raises(ValueError, match=r"\(1, 4, 6, 8\)"):
        NF.nats_attention(torch.randn(1, 4, 6, 8), k, v, w, 2)
    with pytest.raises(ValueError, match=r"k .* and v"):
        NF.nats_attention(q, k, v[..., :4], w, 2)
    with pytest.raises(ValueError, match=r"\[B, H, N, D\]"):
        NF.nats_attention(q[0], k, v, w, 2)
    with pytest.raises(ValueError, match=r"'auto', 'reference', 'triton'"):
        NF.nats_attention(q, k, v, w, 2, backend="flash")
    with pytest.raises(ValueError, match=r"\[\.\.\., N, N\]"):
        NF.kv_fractions(torch.ones(3, 4, dtype=torch.bool))


def test_triton_backend_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(NF, "_load_triton_backend", lambda: (None, "ImportError: no kernel"))
    q = torch.randn(1, 2, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    w = NF.types_to_weights(torch.zeros(1, 2, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"Triton backend .* unavailable.*no kernel"):
        NF.nats_attention(q, k, k, w, 2, backend="triton")
    # auto falls back to the reference
    torch.testing.assert_close(NF.nats_attention(q, k, k, w, 2), _dense(q, k, k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,Hq,Hkv,N,D,W", ATTN_CASES)
def test_attention_from_integer_types_is_the_attention_of_their_one_hot_weights(B, Hq, Hkv, N, D, W):
    """`nats_attention_types` (a prefill's attention: integer types, no gradient) equals `nats_attention` at the
    one-hot weights of the same types (the PyTorch backend here; the Triton one, ``nats_prefill``, is checked against
    the training kernel in tests/test_kernels.py)."""
    gen = torch.Generator().manual_seed(N * 11 + Hkv)
    types = rand_types((B, Hkv, N), gen)
    q, k, v = (t.detach() for t in qkv(B, Hq, Hkv, N, D, gen, scale=1.5))
    want = loop_attention(q, k, v, F.one_hot(types, 3).to(F64), W, "dense")
    got = NF.nats_attention_types(q, k, v, types, W, backend="reference")
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="unknown backend"):
        NF.nats_attention_types(q, k, v, types, W, backend="cuda")
