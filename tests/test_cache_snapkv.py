"""The prefill-time KV-cache policies snapkv, pyramidkv and adakv (nats/cache/policies/): the kept sets against
a slow reference written here (dense attention weights by loops, pooling by loops, top-k by sorting), decode steps
against a dense softmax over exactly the kept keys, the model's decode loop against a per-head masked forward,
budget accounting, PyramidKV's per-layer and AdaKV's per-head budgets, memory and errors (float64, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from test_cache import masked_forward

from nats.cache import get_cache_class, make_caches, policy_logits
from nats.cache.decode import eval_mode, prefill
from nats.cache.engine import EngineLayer, rounded
from nats.cache.policies.pyramidkv import pyramid_budgets, pyramid_sizes
from nats.cache.rule import RuleContext
from nats.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V = 47


# ----------------------------------------------------------------------------------------------------
# the slow reference
# ----------------------------------------------------------------------------------------------------
def ref_votes(q, k, window, kernel, pooling):
    """SnapKV's votes of one KV row by loops: q [G, N, D] (the group's query heads), k [N, D] -> list of N - w."""
    G, N, D = q.shape
    p = N - window
    votes = [0.0] * p
    for g in range(G):
        for i in range(p, N):  # the window's queries, causal softmax over keys 0..i
            logits = [float(q[g, i] @ k[j]) / math.sqrt(D) for j in range(i + 1)]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            for j in range(p):
                votes[j] += e[j] / z
    half = kernel // 2
    pooled = []
    for j in range(p):
        near = [votes[m] for m in range(j - half, j + half + 1) if 0 <= m < p]
        pooled.append(max(near) if pooling == "max" else sum(near) / kernel)  # avg: zero padding counts
    return pooled


def top(scores, n):
    """Indices of the n largest scores, ties to the lower index."""
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:n])


def ref_kept(q, k, budget, window, kernel=7, pooling="max", prefix_budget=None, alpha=None):
    """The positions each row keeps after a prefill: list [B][Hkv] of sorted lists. q [B, Hq, N, D], k [B, Hkv,
    N, D]. prefix_budget: the layer's prefix keys (PyramidKV; default B - w); alpha: AdaKV's head allocation."""
    B, Hq, N, D = q.shape
    H = k.shape[1]
    G = Hq // H
    if N <= budget:
        return [[list(range(N)) for _ in range(H)] for _ in range(B)]
    p = N - window
    base = budget - window if prefix_budget is None else prefix_budget
    out = []
    for b in range(B):
        votes = [ref_votes(q[b, h * G : (h + 1) * G], k[b, h], window, kernel, pooling) for h in range(H)]
        if alpha is None:
            chosen = [top(votes[h], base) for h in range(H)]
        else:  # AdaKV: the safeguard of every head, then the best remaining votes of all heads together
            floor = math.floor(alpha * base)
            chosen = [top(votes[h], floor) for h in range(H)]
            rest = [(-votes[h][j], h, j) for h in range(H) for j in range(p) if j not in chosen[h]]
            for _, h, j in sorted(rest)[: H * (base - floor)]:
                chosen[h].append(j)
        out.append([sorted(chosen[h]) + list(range(p, N)) for h in range(H)])
    return out


def dense_over(q, keys, vals):
    """softmax(q . keys / sqrt(D)) vals for q [G, D], keys/vals [n, D]."""
    s = keys @ q.T / math.sqrt(q.shape[-1])  # [n, G]
    return (torch.softmax(s, dim=0).T @ vals).reshape(q.shape)


def new_layer(policy, reserve=None, layer_idx=0, n_layer=1, **options) -> EngineLayer:
    """One layer of the engine running the policy's rule, driven directly (PyTorch attention); ``reserve``: the
    decoded tokens planned for (None: the pool grows as the steps need)."""
    rule = get_cache_class(policy).rule(**options)
    return EngineLayer(rule, RuleContext(layer_idx, n_layer, reserve, True, "torch", "torch"))


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def held(layer, k, v):
    """The positions a layer holds per row, list [B][Hkv] of sorted lists: its segments' keys found among the
    sequence's keys k [B, Hkv, T, D] (random: each occurs once), each exactly once and with its own value."""
    B, H = k.shape[:2]
    out = []
    for b in range(B):
        rows = []
        for h in range(H):
            r = b * H + h
            s, n = int(layer.start[r]), int(layer.length[r])
            match = (layer.k_pool[s : s + n, None] == k[b, h][None]).all(-1)  # [n, T]
            assert bool((match.sum(1) == 1).all()), (b, h)
            pos = match.long().argmax(1)
            assert torch.equal(layer.v_pool[s : s + n], v[b, h, pos]), (b, h)
            rows.append(sorted(pos.tolist()))
        out.append(rows)
    return out


def step(layer, q, k, v, i):
    """The layer's decode step of position i of q [B, Hq, T, D], k, v [B, Hkv, T, D] -> [B, Hq, 1, D]."""
    B, Hq, _, D = q.shape
    R = B * k.shape[1]
    y = layer.step(q[:, :, i].reshape(R, Hq * B // R, D), k[:, :, i].reshape(R, D), v[:, :, i].reshape(R, D))
    return y.reshape(B, Hq, 1, D)


# awkward shapes: prompt below the window, prompt <= budget (keep all), at budget + 1, GQA groups 1-3, batch > 1
CASES = [
    # B, H, G, N, budget, window, kernel, pooling
    (2, 2, 2, 5, 12, 8, 7, "max"),  # prompt shorter than the window and the budget: everything
    (1, 3, 1, 12, 12, 4, 7, "max"),  # N == B: everything
    (2, 2, 3, 13, 12, 4, 7, "max"),  # N == B + 1
    (3, 2, 2, 40, 10, 4, 7, "max"),
    (2, 1, 3, 37, 15, 6, 5, "avg"),
    (2, 3, 2, 29, 9, 8, 1, "max"),  # one prefix key besides the window; no pooling
    (1, 2, 1, 50, 20, 1, 3, "avg"),
]


@pytest.mark.parametrize("B,H,G,N,budget,window,kernel,pooling", CASES)
def test_snapkv_prefill_keeps_the_reference_set_and_is_exact(B, H, G, N, budget, window, kernel, pooling):
    D = 8
    q, k, v = rand(B, H * G, N, D, seed=1, scale=2), rand(B, H, N, D, seed=2), rand(B, H, N, D, seed=3)
    cache = new_layer("snapkv", 5, window=window, kernel=kernel, pooling=pooling)
    y = cache.prefill(q, k, v, None, budget=budget)
    expect = ref_kept(q, k, budget, window, kernel, pooling)
    assert held(cache, k, v) == expect
    assert torch.equal(cache.kept(), torch.full((B * H,), min(N, budget)))
    assert torch.equal(cache.cap, cache.kept() + 5)  # the reserve planned on top of what the prompt keeps
    # the prefill output is full causal attention
    for b in range(B):
        for h in range(H * G):
            for i in range(N):
                ref = dense_over(q[b, h, i][None], k[b, h // G, : i + 1], v[b, h // G, : i + 1])
                assert torch.allclose(y[b, h, i], ref[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "adakv"])
@pytest.mark.parametrize("B,H,G,N,budget,window,kernel,pooling", CASES[:1] + CASES[3:5])
def test_decode_attends_exactly_the_kept_keys_and_fractions(policy, B, H, G, N, budget, window, kernel, pooling):
    D, steps = 8, 6
    T = N + steps
    q, k, v = rand(B, H * G, T, D, seed=4, scale=2), rand(B, H, T, D, seed=5), rand(B, H, T, D, seed=6)
    where = {"layer_idx": 1, "n_layer": 3} if policy == "pyramidkv" else {}
    cache = new_layer(policy, None, window=window, kernel=kernel, pooling=pooling, **where)  # grows as it decodes
    cache.prefill(q[:, :, :N], k[:, :, :N], v[:, :, :N], None, budget=budget)
    prompt_kept = held(cache, k, v)
    n0 = cache.kept().clone()
    for s in range(steps):
        i = N + s
        y = step(cache, q, k, v, i)
        now = held(cache, k, v)
        for b in range(B):
            for h in range(H):
                keys = prompt_kept[b][h] + list(range(N, i + 1))
                assert now[b][h] == keys
                ref = dense_over(q[b, h * G : (h + 1) * G, i], k[b, h, keys], v[b, h, keys])
                assert torch.allclose(y[b, h * G : (h + 1) * G, 0], ref, atol=1e-12, rtol=0)
    assert torch.equal(cache.kept(), n0 + steps)
    # spec section 6: prompt query i reads i + 1 keys, decode query N + s reads n0 + s + 1
    fr = cache.fractions()
    c = n0.double()
    area = (N * (N + 1) / 2 + steps * c + steps * (steps + 1) / 2) / (T * (T + 1) / 2)
    peak = torch.maximum(torch.full_like(c, N), c + steps) / T
    assert torch.allclose(fr["area"], area, atol=1e-12) and torch.allclose(fr["peak"], peak, atol=1e-12)


def test_pyramidkv_and_adakv_kept_sets_equal_the_reference():
    B, H, G, N, D, budget, window = 2, 3, 2, 33, 8, 11, 3
    q, k, v = rand(B, H * G, N, D, seed=7, scale=2), rand(B, H, N, D, seed=8), rand(B, H, N, D, seed=9)
    L = 4
    base, prefix = budget - window, N - window
    budgets = pyramid_budgets(base, prefix, L, beta=2)
    for layer in range(L):
        cache = new_layer("pyramidkv", 0, layer_idx=layer, n_layer=L, window=window, beta=2)
        cache.prefill(q, k, v, None, budget=budget)
        assert held(cache, k, v) == ref_kept(q, k, budget, window, prefix_budget=budgets[layer])
        assert (cache.kept() == budgets[layer] + window).all()
    for alpha in (0.0, 0.5, 1.0):
        cache = new_layer("adakv", 0, window=window, alpha=alpha, pooling="avg")
        cache.prefill(q, k, v, None, budget=budget)
        assert held(cache, k, v) == ref_kept(q, k, budget, window, pooling="avg", alpha=alpha)
        kept = cache.kept().view(B, H)
        assert torch.equal(kept.sum(1), torch.full((B,), H * budget))  # the layer's total is Hkv * B
        assert (kept >= math.floor(alpha * base) + window).all()
        if alpha == 0.0:
            assert len(set(kept.flatten().tolist())) > 1  # the heads' budgets differ
        if alpha == 1.0:  # every head its own B: SnapKV
            snap = new_layer("snapkv", 0, window=window, pooling="avg")
            snap.prefill(q, k, v, None, budget=budget)
            assert held(cache, k, v) == held(snap, k, v)


# ----------------------------------------------------------------------------------------------------
# PyramidKV's budgets
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "base,prefix,L,beta",
    [
        (6, 16, 3, 20),
        (100, 900, 30, 20),
        (50, 60, 7, 20),
        (7, 7, 5, 20),
        (9, 40, 4, 1),
        (1, 10, 6, 20),
        (0, 5, 3, 20),
        (13, 14, 1, 20),
    ],
)
def test_pyramid_budgets_sum_monotone_close(base, prefix, L, beta):
    b = pyramid_budgets(base, prefix, L, beta)
    assert len(b) == L and sum(b) == L * base  # mean = the budget
    assert all(x >= y for x, y in zip(b, b[1:]))  # non-increasing from the lowest layer
    assert all(0 <= x <= prefix for x in b)
    if L > 1:
        lo, hi = base / beta, 2 * base - base / beta
        if hi > prefix:
            hi, lo = prefix, 2 * base - prefix
        for layer, x in enumerate(b):
            assert abs(x - (hi - layer * (hi - lo) / (L - 1))) < 1 + 1e-9
    if beta == 1:
        assert b == [base] * L


def test_pyramid_layer_budgets_through_make_caches():
    model = tiny(n_layer=4)
    cache = make_caches(model, "pyramidkv", 2, 40, budget=12, window=4)
    # the engine tells each layer's rule where it runs: its index among the model's 4 layers
    assert [(lay.context.layer_idx, lay.context.n_layer) for lay in cache.layers] == [(i, 4) for i in range(4)]
    sizes = pyramid_sizes(30, 12, 4, 4)
    assert sum(sizes) == 4 * 12 and sizes == sorted(sizes, reverse=True) and sizes[0] > 12 > sizes[-1]
    assert pyramid_sizes(12, 12, 4, 4) == [12] * 4  # a prompt within the budget: everything
    with eval_mode(model):
        prefill(model, cache, torch.randint(0, V, (2, 30)))
    kept = cache.kept()  # [layer, sequence, KV head]: one budget per layer
    assert torch.equal(kept, torch.tensor(sizes)[:, None, None].expand(4, 2, 2))


# ----------------------------------------------------------------------------------------------------
# the model's decode loop against a per-head masked forward
# ----------------------------------------------------------------------------------------------------
def tiny(n_layer: int = 3, block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=V, block_size=block_size, n_layer=n_layer, n_head=6, n_kv_head=2, n_embd=48,
        attention={"name": "dense"},
    )  # fmt: skip
    return GPT(cfg).double().eval()


def masked_decode_reference(model, idx, P, budget, window, kept_fn):
    """Prompt idx[:, :P] with full attention, then tokens P.. attending to the kept prompt keys of their layer
    and KV head (kept_fn(layer, q, k) on the layer's prompt q/k -> [B][Hkv] lists) and all tokens from P on."""
    B, N = idx.shape

    def mask(layer, q, k):
        H = k.shape[1]
        G = q.shape[1] // H
        kept = kept_fn(layer, q[:, :, :P], k[:, :, :P])
        i = torch.arange(N)[:, None]
        j = torch.arange(N)[None, :]
        mask = (j <= i).expand(B, H, N, N).clone()
        for b in range(B):
            for hh in range(H):
                row = torch.zeros(N, dtype=torch.bool)
                row[kept[b][hh]] = True
                row[P:] = True
                mask[b, hh, P:] &= row[None, :]
        return mask.repeat_interleave(G, 1)

    return masked_forward(model, idx, mask)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "adakv"])
def test_decode_loop_equals_masked_forward(policy):
    model = tiny()
    idx = torch.randint(0, V, (2, 44), generator=torch.Generator().manual_seed(3))
    P, budget, window = 30, 10, 4
    L = len(model.blocks)
    opts = {"window": window, "kernel": 3}

    def kept_fn(layer, q, k):
        if policy == "snapkv":
            return ref_kept(q, k, budget, window, kernel=3)
        if policy == "adakv":
            return ref_kept(q, k, budget, window, kernel=3, alpha=0.2)
        prefix = pyramid_budgets(budget - window, P - window, L)[layer]
        return ref_kept(q, k, budget, window, kernel=3, prefix_budget=prefix)

    with torch.no_grad():
        ref = masked_decode_reference(model, idx, P, budget, window, kept_fn)
        full = model(idx).logits
    seq, cache = policy_logits(model, idx, policy, sequential=True, prefill_len=P, budget=budget, **opts)
    assert torch.allclose(seq, ref, atol=1e-10, rtol=0)
    assert torch.allclose(seq[:, :P], full[:, :P], atol=1e-10, rtol=0)  # the prefill is exact
    assert not torch.allclose(seq[:, P:], full[:, P:], atol=1e-3)  # the budget matters after it
    kept = cache.kept().double()
    assert float(kept.mean()) == budget + (44 - P)  # mean over layers and heads: B + decoded tokens
    # the parallel prefill of everything is the full model; decoding from an empty prompt keeps everything
    par, _ = policy_logits(model, idx, policy, budget=budget, **opts)
    empty, _ = policy_logits(model, idx, policy, sequential=True, budget=budget, **opts)
    assert torch.allclose(par, full, atol=1e-10, rtol=0) and torch.allclose(empty, full, atol=1e-10, rtol=0)


def test_prompt_within_budget_equals_full_cache():
    model = tiny()
    idx = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx).logits
    for policy in ("snapkv", "pyramidkv", "adakv"):
        seq, cache = policy_logits(model, idx, policy, sequential=True, prefill_len=16, budget=16, window=8)
        assert torch.allclose(seq, full, atol=1e-10, rtol=0), policy
        assert torch.equal(cache.kept(), torch.full((3, 3, 2), 40))


# ----------------------------------------------------------------------------------------------------
# memory, generate, errors
# ----------------------------------------------------------------------------------------------------
def test_memory_follows_the_compression():
    """The pool holds each row's kept tokens + the reserve (rounded up, + the scratch slot), not the prompt."""
    B, H, G, N, D, budget, new = 2, 2, 2, 300, 16, 40, 10
    q, k, v = rand(B, H * G, N, D, seed=10), rand(B, H, N, D, seed=11), rand(B, H, N, D, seed=12)
    cache = new_layer("snapkv", new)
    cache.prefill(q, k, v, None, budget=budget)
    assert cache.cap.tolist() == [budget + new] * (B * H)
    assert cache.kv_nbytes() == 2 * rounded(B * H * (budget + new) + 1) * D * 8 < 2 * B * H * N * D * 8
    assert cache.kept_nbytes() == 2 * B * H * budget * D * 8
    ada = new_layer("adakv", new)
    ada.prefill(q, k, v, None, budget=budget)
    assert torch.equal(ada.cap, ada.kept() + new) and len(set(ada.kept().tolist())) > 1  # each row its own share
    assert ada.kv_nbytes() == 2 * rounded(int(ada.cap.sum()) + 1) * D * 8


def test_generate_runs_and_keeps_the_budget():
    from nats.cache import generate

    model = tiny()
    prompt = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(5))
    out = generate(model, prompt, 8, policy="snapkv", budget=12, window=4)
    assert out.shape == (2, 38) and torch.equal(out[:, :30], prompt)
    _, cache = generate(model, prompt, 8, "adakv", budget=12, window=4, return_caches=True)
    kept = cache.kept()  # [layer, sequence, KV head]; 30 prompt tokens + 7 fed back: B + 7 per head on average
    assert torch.equal(kept.sum(-1), torch.full((3, 2), 2 * (12 + 7)))


def test_errors():
    model = tiny()
    with pytest.raises(ValueError, match="snapkv: window=32 must be below the budget B=10"):
        make_caches(model, "snapkv", 1, 40, budget=10)
    with pytest.raises(ValueError, match="kernel must be an odd positive integer"):
        make_caches(model, "snapkv", 1, 40, budget=10, window=4, kernel=4)
    with pytest.raises(ValueError, match="pooling must be one of"):
        make_caches(model, "pyramidkv", 1, 40, budget=10, window=4, pooling="mean")
    with pytest.raises(ValueError, match="window must be a positive integer"):
        make_caches(model, "adakv", 1, 40, budget=10, window=0)
    with pytest.raises(ValueError, match="budget B=40 >= N=40"):
        make_caches(model, "snapkv", 1, 40, budget=40, window=4)
    with pytest.raises(ValueError, match="needs a budget"):
        make_caches(model, "snapkv", 1, 40)
    with pytest.raises(ValueError, match="beta must be >= 1"):
        make_caches(model, "pyramidkv", 1, 40, budget=10, window=4, beta=0.5)
    with pytest.raises(ValueError, match="alpha .* must be in \\[0, 1\\]"):
        make_caches(model, "adakv", 1, 40, budget=10, window=4, alpha=1.5)
    with pytest.raises(ValueError, match="exceed the model's block_size=64"):
        make_caches(model, "snapkv", 1, 80, budget=10, window=4)
    with pytest.raises(TypeError, match="does not accept the options \\['alpha'\\]"):
        make_caches(model, "snapkv", 1, 40, budget=10, window=4, alpha=0.5)
    layer = new_layer("snapkv", 0, window=4)  # the rule checks the budget at the prompt too
    with pytest.raises(ValueError, match="snapkv: window=4 must be below the budget B=3"):
        layer.prefill(*(rand(1, 2, 20, 8, seed=0) for _ in range(3)), None, budget=3)


def test_triton_decode_equals_torch():
    """AdaKV's rows of different lengths through the Triton decode kernel (interpreted here: few steps)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny(n_layer=2).float().to(dev)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(6)).to(dev)
    kw = {"sequential": True, "prefill_len": 13, "budget": 8, "window": 3}
    out, cache = policy_logits(model, idx, "adakv", backend="triton", **kw)
    ref, _ = policy_logits(model, idx, "adakv", backend="torch", **kw)
    assert all(lay.context.backend == "triton" for lay in cache.layers)
    assert len(set(cache.kept()[0].flatten().tolist())) > 1
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
