"""KV-cache policies (nats.cache): visible sets against brute-force definitions of spec sections 5 and 7,
decoding against the parallel forward (float64, GQA, evictions), cache sizes, the Triton decode kernel in
Triton's CPU interpreter, generate, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from nats import functional as NF
from nats.attention.nats import NAtSAttention
from nats.attention.registry import AttentionDims
from nats.cache import available_caches, generate, get_cache_class, make_caches, policy_logits
from nats.cache.attention import torch_pool_attention
from nats.cache.decode import prefill
from nats.cache.engine import EngineLayer
from nats.cache.policies.h2o_dense import h2o_dense_mask
from nats.cache.policies.nats import TypeTable, scorer_types
from nats.cache.policies.streaming_llm import streaming_mask
from nats.cache.rule import RuleContext
from nats.models.gpt import GPT, GPTConfig

V = 61
C = 8  # the block input of the NAtS layers driven directly (their scorer's input)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny(attention: dict, n_layer: int = 3, block_size: int = 72, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(vocab_size=V, block_size=block_size, n_layer=n_layer, attention=attention, **kw)
    return GPT(cfg).double().eval()


def nats_model(window: int = 4, **kw) -> GPT:
    model = tiny({"name": "nats", "window": window}, **kw)
    with torch.no_grad():  # spread the scorer so that all three types occur
        g = torch.Generator().manual_seed(1)
        for block in model.blocks:
            w = block.attn.core.scorer.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype))
    return model


def masked_forward(model: GPT, idx: torch.Tensor, mask) -> torch.Tensor:
    """Reference: the model with softmax attention restricted to a (query x key) mask: a given [N, N] one, or per
    layer ``mask(layer, q, k)`` of the layer's q [B, Hq, N, D] and k [B, Hkv, N, D], broadcastable to [B, Hq, N, N]."""
    B, N = idx.shape
    pos = torch.arange(N)
    x = model.embed(idx, pos)
    for layer, block in enumerate(model.blocks):
        h = block.ln_1(x)
        q, k, v = block.attn.project(h, model.rope, pos)
        m = mask(layer, q, k) if callable(mask) else mask
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        y = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v
        x = x + block.attn.gate_and_project(y, h)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


def onehot_probe(R: int, N: int, G: int = 1):
    """q = 0 (uniform attention over the visible keys) and v_j = e_j: the output row of query i is the
    indicator of its visible set divided by its size."""
    q = torch.zeros(R, G, N, N, dtype=torch.float64)
    k = torch.randn(R, N, N, dtype=torch.float64)
    v = torch.eye(N, dtype=torch.float64).expand(R, N, N)
    return q, k, v


def type_table(types: torch.Tensor, first_pos: int = 0) -> TypeTable:
    """The TypeTable giving types ``[B, Hkv, T]`` to positions ``first_pos ..``: rows r = b * Hkv + h."""
    B, H, T = types.shape
    return TypeTable(types.permute(2, 0, 1).reshape(T, B * H), first_pos)


def nats_core(H: int, G: int, D: int, window: int, dtype=torch.float64, device="cpu") -> NAtSAttention:
    """A NAtS scorer of H KV heads (G query heads each) and head dim D, with random weights."""
    torch.manual_seed(0)
    dims = AttentionDims(n_embd=C, n_head=H * G, n_kv_head=H, head_dim=D, block_size=256, layer_idx=0, n_layer=1)
    return NAtSAttention(dims, window=window, backend="reference").to(device, dtype).eval()


def new_layer(policy: str, core=None, backend: str = "torch", reserve: int | None = None, **options) -> EngineLayer:
    """One layer of the engine driven directly; without a reserve its pool grows as the steps need
    (`EngineLayer.maintain`)."""
    rule = get_cache_class(policy).rule(**options)
    return EngineLayer(rule, RuleContext(0, 1, reserve, True, "torch", backend), core)


def step_all(layer: EngineLayer, q, k, v, x=None, prefill_len: int = 1, budget: int | None = None, batch=None):
    """Prefill a layer with the first ``prefill_len`` positions of per-row q [R, G, N, D], k/v [R, N, D] (rows r = b *
    Hkv + h of ``batch`` sequences, by default x's or one per row; x [B, N, C]: the block input, NAtS' scorer), then
    step it over the others; returns the outputs [R, G, N, D]."""
    R, G, N, D = q.shape
    B = batch or (R if x is None else x.shape[0])
    H, P = R // B, prefill_len
    y = layer.prefill(q[:, :, :P].reshape(B, H * G, P, D), k[:, :P].reshape(B, H, P, D),
                      v[:, :P].reshape(B, H, P, D), None if x is None else x[:, :P], budget=budget)  # fmt: skip
    outs = [y.reshape(R, G, P, D)]
    for i in range(P, N):
        outs.append(layer.step(q[:, :, i], k[:, i], v[:, i], None if x is None else x[:, i])[:, :, None])
    return torch.cat(outs, dim=2)


def nats_probe_layer(types: torch.Tensor, window: int, D: int, G: int = 1, backend: str = "torch", device="cpu",
                     dtype=torch.float64) -> EngineLayer:  # fmt: skip
    """A NAtS layer whose tokens get the given types ``[B, Hkv, N]`` (a TypeTable over every position)."""
    core = nats_core(types.shape[1], G, D, window, dtype, device)
    return new_layer("nats", core, backend, type_table=type_table(types.to(device)))


# ----------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------
def test_registry_lists_policies_and_rejects_unknown():
    assert {"full", "streaming_llm", "h2o", "nats", "h2o_dense"} <= set(available_caches())
    with pytest.raises(ValueError, match="unknown cache policy 'bogus'.*full"):
        make_caches(tiny({"name": "dense"}), "bogus", 1, 8)


# ----------------------------------------------------------------------------------------------------
# visible sets against brute-force definitions
# ----------------------------------------------------------------------------------------------------
def brute_nats_visible(types: list[int], window: int) -> list[set[int]]:
    """Spec section 2 by loops: local j visible to i iff no global strictly between; sliding iff i - j < W."""
    out = []
    for i in range(len(types)):
        vis = set()
        for j in range(i + 1):
            t = types[j]
            if t == 0 or (t == 1 and not any(types[m] == 0 for m in range(j + 1, i))) or (t == 2 and i - j < window):
                vis.add(j)
        out.append(vis)
    return out


@pytest.mark.parametrize("window", [1, 3])
def test_nats_cache_visible_sets_sizes_and_kept(window):
    torch.manual_seed(0)
    B, H, N = 3, 2, 40
    types = torch.randint(0, 3, (B, H, N))
    types[..., 0] = 0
    types[0, 0, 5:25] = 1  # a long local run (grows and then truncates a segment)
    types[1, 1] = 2
    types[1, 1, 0] = 0
    layer = nats_probe_layer(types, window, N)
    q, k, v = onehot_probe(B * H, N)
    out = step_all(layer, q, k, v, x=torch.randn(B, N, C, dtype=torch.float64))  # [R, 1, N, N]
    vis = out[:, 0] > 0  # [R, N(query), N(key)]
    expect = NF.nats_mask(types, window).reshape(B * H, N, N)
    assert torch.equal(vis, expect)
    rows = types.reshape(B * H, N).tolist()
    for r in range(B * H):
        brute = brute_nats_visible(rows[r], window)
        assert [set(torch.nonzero(vis[r, i]).flatten().tolist()) for i in range(N)] == brute
    sizes = NF.kv_cache_sizes(types, window).double().reshape(B * H, N)
    fr = layer.fractions()
    assert torch.allclose(fr["area"], sizes.sum(-1) / (N * (N + 1) / 2))
    assert torch.allclose(fr["peak"], sizes.amax(-1) / N)
    # kept after the last step = the keys that query N would still see (globals, live locals, sliding)
    nxt = torch.cat([types, torch.full((B, H, 1), 2)], -1)  # a sliding token N: does not evict anything
    kept = NF.nats_mask(nxt, window)[..., N, :N].sum(-1)
    assert torch.equal(layer.kept(), kept.reshape(B * H))
    assert layer.reallocations > 0  # the local run outgrew its segment: the pool grew and kept the contents right


def test_nats_prefill_equals_stepping_state():
    """A NAtS layer prefilled with a whole sequence holds what one prefilled with its first token and stepped over
    the rest holds (the same types, given by a TypeTable): segments, globals, ring, measurements."""
    torch.manual_seed(1)
    B, H, N, D, W = 2, 3, 33, 8, 4
    types = torch.randint(0, 3, (B, H, N))
    types[..., 0] = 0
    k = torch.randn(B, H, N, D, dtype=torch.float64)
    v = torch.randn(B, H, N, D, dtype=torch.float64)
    q = torch.randn(B * H, 1, N, D, dtype=torch.float64)
    x = torch.randn(B, N, C, dtype=torch.float64)
    stepped, loaded = nats_probe_layer(types, W, D), nats_probe_layer(types, W, D)
    step_all(stepped, q, k.reshape(B * H, N, D), v.reshape(B * H, N, D), x)
    step_all(loaded, q, k.reshape(B * H, N, D), v.reshape(B * H, N, D), x, prefill_len=N)
    assert stepped.reallocations > 0 and loaded.reallocations == 0  # the stepped layer grew on the way
    assert torch.equal(stepped.length, loaded.length) and torch.equal(stepped.n_global, loaded.n_global)
    assert torch.equal(stepped.ring_valid, loaded.ring_valid)
    assert torch.equal(stepped.kept(), loaded.kept())
    for r in range(B * H):
        n = int(stepped.length[r])
        a = stepped.k_pool[stepped.start[r] : stepped.start[r] + n]
        b = loaded.k_pool[loaded.start[r] : loaded.start[r] + n]
        assert torch.equal(a, b)
        assert torch.equal(stepped.ring_k[r][stepped.ring_valid[r]], loaded.ring_k[r][loaded.ring_valid[r]])
    fa, fb = stepped.fractions(), loaded.fractions()
    assert torch.allclose(fa["area"], fb["area"]) and torch.allclose(fa["peak"], fb["peak"])
    assert torch.allclose(stepped.type_fractions(), loaded.type_fractions())


@pytest.mark.parametrize("prefill_len", [1, 3, 20])
def test_streaming_visible_sets_brute_force(prefill_len):
    """A prompt shorter than the sinks, one shorter than the budget, one past it: the ring has the budget's slots."""
    B, H, N, budget, sinks = 2, 2, 30, 9, 4
    layer = new_layer("streaming_llm", sinks=sinks)
    q, k, v = onehot_probe(B * H, N)
    vis = step_all(layer, q, k, v, prefill_len=prefill_len, budget=budget)[:, 0] > 0
    brute = torch.tensor([[j <= i and (j < sinks or i - j < budget - sinks) for j in range(N)] for i in range(N)])
    assert torch.equal(streaming_mask(N, budget, sinks), brute)
    assert torch.equal(vis, brute.expand(B * H, N, N))
    area, peak = NF.budget_fractions(budget, N)
    fr = layer.fractions()
    assert torch.allclose(fr["area"], torch.tensor(area, dtype=torch.float64))
    assert torch.allclose(fr["peak"], torch.tensor(peak, dtype=torch.float64))
    assert layer.kept().tolist() == [budget] * (B * H)


@pytest.mark.parametrize("prefill_len", [1, 5])
def test_h2o_hand_example_uniform_attention(prefill_len):
    """q = 0: every kept key gets 1/|S|. With B = 4, R = 2 the scores after step 3 are
    (0: 1 + 1/2 + 1/3 + 1/4, 1: 1/2 + 1/3 + 1/4, 2: 1/3 + 1/4, 3: 1/4): step 4 evicts key 2 (the lowest
    non-recent score), step 5 evicts key 3 (0.25 + 0.25 < the others), step 6 evicts key 4. The prompt runs the
    same rule as the steps."""
    N = 8
    layer = new_layer("h2o")
    q, k, v = onehot_probe(1, N)
    vis = step_all(layer, q, k, v, prefill_len=prefill_len, budget=4)[0, 0] > 0
    got = [sorted(torch.nonzero(vis[i]).flatten().tolist()) for i in range(N)]
    assert got[:4] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert got[4] == [0, 1, 3, 4]
    assert got[5] == [0, 1, 4, 5]
    assert got[6] == [0, 1, 5, 6]
    assert got[7] == [0, 1, 6, 7]
    assert sorted(layer.slot_pos[0].tolist()) == [0, 1, 6, 7]  # the positions the layer holds


def brute_h2o(q, k, v, budget, recent):
    """The sequential rule of spec section 7 by a slow loop, one row: q [G, N, D], k/v [N, D]."""
    G, N, D = q.shape
    kept: list[int] = []
    score: dict[int, float] = {}
    outs, visible = [], []
    for i in range(N):
        kept.append(i)
        score[i] = 0.0
        if len(kept) > budget:
            cands = [j for j in kept if j <= i - recent]
            victim = min(cands, key=lambda j: (score[j], j))
            kept.remove(victim)
            del score[victim]
        kk, vv = k[kept], v[kept]
        p = torch.softmax(q[:, i] @ kk.T / math.sqrt(D), dim=-1)  # [G, |S|]
        outs.append(p @ vv)
        for c, j in enumerate(kept):
            score[j] += float(p[:, c].sum())
        visible.append(sorted(kept))
    return torch.stack(outs, 1), visible


@pytest.mark.parametrize("budget,recent", [(6, None), (7, 2), (10, None)])
@pytest.mark.parametrize("prefill_len", [1, 9])
def test_h2o_matches_slow_loop_gqa(budget, recent, prefill_len):
    torch.manual_seed(2)
    B, H, G, N, D = 2, 2, 2, 28, 8
    q = torch.randn(B * H, G, N, D, dtype=torch.float64) * 2
    k = torch.randn(B * H, N, D, dtype=torch.float64)
    v = torch.randn(B * H, N, D, dtype=torch.float64)
    layer = new_layer("h2o", recent=recent)
    out = step_all(layer, q, k, v, prefill_len=prefill_len, budget=budget, batch=B)
    R = budget // 2 if recent is None else recent
    for r in range(B * H):
        ref, visible = brute_h2o(q[r], k[r], v[r], budget, R)
        assert torch.allclose(out[r], ref, atol=1e-12, rtol=0)
        assert sorted(layer.slot_pos[r].tolist()) == visible[-1]  # the positions held after the last step
    assert torch.equal(layer.kept(), torch.full((B * H,), budget))
    area, peak = NF.budget_fractions(budget, N)
    assert torch.allclose(layer.fractions()["area"], torch.tensor(area, dtype=torch.float64))


def test_h2o_dense_approximation_mask_sizes():
    torch.manual_seed(3)
    q = torch.randn(1, 4, 20, 8)
    k = torch.randn(1, 2, 20, 8)
    mask = h2o_dense_mask(q, k, budget=6, recent=3)
    assert mask.shape == (1, 2, 20, 20)
    assert torch.equal(mask.sum(-1)[0, 0], torch.arange(1, 21).clamp(max=6))
    assert not torch.triu(mask[0, 0], 1).any()
    i = torch.arange(20)
    assert mask[0, :, i, i].all() and mask[0, :, i[2:], i[2:] - 2].all()  # the recent keys


# ----------------------------------------------------------------------------------------------------
# decoding equals the parallel forward (float64, GQA, several layers, evictions)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill_len", [0, 23])
def test_full_decode_equals_forward(prefill_len):
    model = tiny({"name": "dense", "output_gate": "headwise"})
    idx = torch.randint(0, V, (2, 64))
    ref = model(idx).logits
    out, _ = policy_logits(model, idx, "full", sequential=True, prefill_len=prefill_len)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("prefill_len", [0, 31])
def test_nats_decode_equals_forward(prefill_len):
    model = nats_model(window=4)
    idx = torch.randint(0, V, (3, 61))
    ref = model(idx).logits
    out, cache = policy_logits(model, idx, "nats", sequential=True, prefill_len=prefill_len)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    par, pcache = policy_logits(model, idx, "nats")
    assert torch.allclose(par, ref, atol=1e-12, rtol=0)
    # the measured cache sizes are kv_cache_sizes of the model's own types; all three types occur
    from nats.attention.nats import collect_types

    types = collect_types(model, idx)
    seen = set()
    for layer, t in types.items():
        seen |= set(t.unique().tolist())
        sizes = NF.kv_cache_sizes(t, 4).double()
        for c in (cache, pcache):
            assert torch.allclose(c.fractions()["area"][layer], sizes.sum(-1) / (61 * 62 / 2))
            assert torch.allclose(c.fractions()["peak"][layer], sizes.amax(-1) / 61)
    assert seen == {0, 1, 2}
    assert cache.reallocations() > 0 and pcache.reallocations() == 0  # the decode loop grew its pools


def test_nats_decode_learned_positions_and_elementwise_gate():
    model = nats_model(window=3, pos_emb="learned", n_layer=2)
    gated = tiny({"name": "nats", "window": 3, "output_gate": "elementwise"}, n_layer=2)
    idx = torch.randint(0, V, (2, 40))
    for m in (model, gated):
        out, _ = policy_logits(m, idx, "nats", sequential=True)
        assert torch.allclose(out, m(idx).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("prefill_len", [0, 30])
def test_streaming_decode_equals_masked_forward(prefill_len):
    model = tiny({"name": "dense"})
    idx = torch.randint(0, V, (2, 50))
    budget, sinks = 12, 4
    ref = masked_forward(model, idx, streaming_mask(50, budget, sinks))
    seq, _ = policy_logits(model, idx, "streaming_llm", sequential=True, prefill_len=prefill_len, budget=budget)
    par, _ = policy_logits(model, idx, "streaming_llm", budget=budget)
    assert torch.allclose(seq, ref, atol=1e-10, rtol=0)
    assert torch.allclose(par, ref, atol=1e-10, rtol=0)
    assert not torch.allclose(ref, model(idx).logits, atol=1e-3)  # the budget matters


def test_h2o_layerwise_prefill_equals_token_steps():
    model = tiny({"name": "dense"})
    idx = torch.randint(0, V, (2, 40))
    a, _ = policy_logits(model, idx, "h2o", sequential=True, budget=10)
    b, _ = policy_logits(model, idx, "h2o", sequential=False, budget=10)
    c, _ = policy_logits(model, idx, "h2o", sequential=True, prefill_len=17, budget=10)
    assert torch.allclose(a, b, atol=1e-12, rtol=0) and torch.allclose(a, c, atol=1e-12, rtol=0)


def test_generate_greedy_matches_naive_loop():
    for model, policy in ((tiny({"name": "dense"}), "full"), (nats_model(), "nats")):
        idx = torch.randint(0, V, (2, 9))
        out = generate(model, idx, 12, policy=policy)
        naive = idx
        for _ in range(12):
            naive = torch.cat([naive, model(naive).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, naive)
    g = torch.Generator().manual_seed(0)
    sampled = generate(tiny({"name": "dense"}), idx, 5, policy="h2o", budget=6, temperature=1.0, top_k=5, generator=g)
    assert sampled.shape == (2, 14) and torch.equal(sampled[:, :9], idx)


# ----------------------------------------------------------------------------------------------------
# the Triton decode kernel (CPU interpreter here; the same code runs on CUDA)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_pool_attention_matches_torch(dtype):
    from nats_kernels.nats_attention.pool_decode import triton_pool_attention

    torch.manual_seed(0)
    R, G, D, W = 5, 2, 16, 4
    length = torch.tensor([0, 3, 70, 130, 1])
    cap = length + 5
    start = torch.zeros_like(cap)
    start[1:] = cap.cumsum(0)[:-1]
    P = int(cap.sum())
    kp, vp = torch.randn(P + 1, D).to(dtype), torch.randn(P + 1, D).to(dtype)
    q = torch.randn(R, G, D).to(dtype)
    rk, rv = torch.randn(R, W, D).to(dtype), torch.randn(R, W, D).to(dtype)
    rvalid = torch.rand(R, W) < 0.5
    rvalid[0, 0] = True  # row 0 has an empty segment: its ring must hold a key
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the real kernel on a GPU
    q, kp, vp, start, length, rk, rv, rvalid = (t.to(dev) for t in (q, kp, vp, start, length, rk, rv, rvalid))
    ref = torch_pool_attention(q, kp, vp, start, length, int(length.max()), rk, rv, rvalid)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in (1, 3, None):
        out = triton_pool_attention(
            q, kp, vp, start, length, int(length.max()), ring_k=rk, ring_v=rv, ring_valid=rvalid, splits=splits
        )
        assert out.dtype == dtype
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=0), splits
    ln = length.clamp(min=1)
    ref = torch_pool_attention(q, kp, vp, start, ln, int(ln.max()))
    out = triton_pool_attention(q, kp, vp, start, ln, int(ln.max()), splits=2)
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=0)
    for bn, balanced in ((16, True), (128, True), (16, False)):  # launch choices (benchmarks/sweep_pool_attention.py)
        cfg = {"block_n": bn, "num_warps": 2, "num_stages": 2, "balanced": balanced}
        out = triton_pool_attention(q, kp, vp, start, ln, int(ln.max()), splits=3, config=cfg)
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=0), (bn, balanced)
    cfg = {"balanced": False}  # each row in equal chunks of its own, the ring in the first
    out = triton_pool_attention(q, kp, vp, start, length, int(length.max()), rk, rv, rvalid, splits=3, config=cfg)
    ref_ring = torch_pool_attention(q, kp, vp, start, length, 130, rk, rv, rvalid)
    assert torch.allclose(out.float(), ref_ring.float(), atol=tol, rtol=0)
    # the streamed split: one program for every row, shares that cut rows (and rings of 1 to 4 blocks), and more
    # programs than blocks (empty shares amid a row's programs)
    for bn, programs in ((16, 1), (16, 3), (32, 7), (128, 2), (16, 200)):
        for ring in (True, False):
            cfg = {"split": "stream", "block_n": bn, "num_warps": 2, "num_stages": 2, "programs": programs}
            rings = (rk, rv, rvalid) if ring else (None, None, None)
            out = triton_pool_attention(q, kp, vp, start, length if ring else ln, 130, *rings, config=cfg)
            assert torch.allclose(out.float(), (ref_ring if ring else ref).float(), atol=tol, rtol=0), (bn, programs)


def test_triton_pool_attention_balances_uneven_rows():
    """The work-balanced split: chunks of one size over all rows (the rows' mean over the split count), so one long
    row among empty ones takes most of the programs (here 125 chunks of 16 keys, merged 64 at a time), and the
    empty rows still take their ring; the result equals the reference either way."""
    from nats_kernels.nats_attention.pool_decode import triton_pool_attention

    torch.manual_seed(1)
    R, G, D, W = 8, 2, 16, 2
    length = torch.tensor([0, 0, 2000, 0, 5, 0, 0, 40])
    start = torch.arange(R) * 2000
    kp, vp, q = torch.randn(R * 2000 + 1, D), torch.randn(R * 2000 + 1, D), torch.randn(R, G, D)
    rk, rv, rvalid = torch.randn(R, W, D), torch.randn(R, W, D), torch.ones(R, W, dtype=torch.bool)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, kp, vp, start, length, rk, rv, rvalid = (t.to(dev) for t in (q, kp, vp, start, length, rk, rv, rvalid))
    ref = torch_pool_attention(q, kp, vp, start, length, 2000, rk, rv, rvalid)
    for split in ("balanced", "rows", "stream"):
        cfg = {"block_n": 16, "num_warps": 2, "num_stages": 2, "split": split, "programs": 64}
        out = triton_pool_attention(q, kp, vp, start, length, 2000, rk, rv, rvalid, splits=64, config=cfg)
        assert torch.allclose(out, ref, atol=1e-5, rtol=0), split
    # more rows than the lookup reads at a time (pool_decode.ROW_BLOCK = 128): the walk carries over blocks
    R = 130
    length = torch.randint(0, 40, (R,))
    length[::7] = 0
    start = torch.arange(R) * 40
    kp, vp, q = torch.randn(R * 40 + 1, D), torch.randn(R * 40 + 1, D), torch.randn(R, G, D)
    rk, rv, rvalid = torch.randn(R, W, D), torch.randn(R, W, D), torch.ones(R, W, dtype=torch.bool)
    q, kp, vp, start, length, rk, rv, rvalid = (t.to(dev) for t in (q, kp, vp, start, length, rk, rv, rvalid))
    ref = torch_pool_attention(q, kp, vp, start, length, 40, rk, rv, rvalid)
    for split, programs in (("balanced", None), ("stream", 5), ("stream", 300)):
        cfg = {"block_n": 16, "split": split, "programs": programs}
        out = triton_pool_attention(q, kp, vp, start, length, 40, rk, rv, rvalid, splits=1, config=cfg)
        assert torch.allclose(out, ref, atol=1e-5, rtol=0), (split, programs)


def test_triton_pool_attention_default_splits_follow_the_launch_choice(monkeypatch):
    """Without a split count the kernel takes `default_splits`, capped at its launch choice's ``max_splits`` (16 for
    few rows of head dim 128); the launches are recorded, not run."""
    from nats_kernels.nats_attention import pool_decode

    grids, consts = [], []

    class Launch:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: consts.append(k)

    monkeypatch.setattr(pool_decode, "_pool_decode_kernel", Launch())
    monkeypatch.setattr(pool_decode, "_stream_decode_kernel", Launch())
    monkeypatch.setattr(pool_decode, "_combine_kernel", Launch())
    for D, expected in ((128, 16), (64, 32)):  # 8192 keys: 32 splits of 256 by default
        q, pool = torch.zeros(2, 4, D), torch.zeros(2 * 8192, D)
        rows = torch.zeros(2, dtype=torch.long)
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 8192, config={"split": "balanced"})
        assert grids[-2] == (2 * (expected + 1),), (D, grids)  # the balanced split's programs: R x (splits + 1)
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 8192, config={"balanced": False})
        assert grids[-2] == (2, expected), (D, grids)  # each row alike: (R, splits)
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 8192)  # uneven rows: streamed, one program per SM
        assert grids[-2] == (4,) and consts[-1]["MODE"] == 2, (D, grids)  # (4 "SMs" on the CPU)
    q, pool, rows = torch.zeros(200, 4, 64), torch.zeros(200 * 64, 64), torch.zeros(200, dtype=torch.long)
    pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64)
    pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64, config={"split": "balanced"})
    assert {k["BLOCK_R"] for k in consts} == {pool_decode.ROW_BLOCK}  # one compiled kernel whatever the rows
    with pytest.raises(ValueError, match="unknown split 'even'"):
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64, config={"split": "even"})


def test_decode_kernels_launch_dependent_on_hopper(monkeypatch):
    """On a GPU of compute capability 9.0 or later the attention and its merge over few rows (up to PDL_ROWS) are
    launched as programmatic dependent launches (``launch_pdl``, the kernels' USE_PDL wait), unless the launch choice
    or NATS_KERNELS_PDL=0 turns it off; never under the interpreter. The launches are recorded, not run."""
    from nats_kernels.nats_attention import pool_decode

    launched = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(k)

    for name in ("_pool_decode_kernel", "_stream_decode_kernel", "_combine_kernel"):
        monkeypatch.setattr(pool_decode, name, Launch())
    q, pool, rows = torch.zeros(2, 4, 64), torch.zeros(2 * 64, 64), torch.zeros(2, dtype=torch.long)
    assert not pool_decode.use_pdl(q.device)  # the CPU
    pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64)
    assert [k["USE_PDL"] for k in launched] == [False, False] and not any("launch_pdl" in k for k in launched)
    monkeypatch.setattr(pool_decode, "use_pdl", lambda device: True)  # as on an H100
    for split in ("stream", "rows", "balanced"):
        launched.clear()
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64, config={"split": split})
        assert [(k["USE_PDL"], k.get("launch_pdl")) for k in launched] == [(True, True)] * 2, split
        launched.clear()
        pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64, config={"split": split, "pdl": False})
        assert [k["USE_PDL"] for k in launched] == [False, False] and not any("launch_pdl" in k for k in launched)
    launched.clear()  # many rows (batch 8 of 8 KV heads): plain launches by default (they paid only for few rows)
    q, pool, rows = torch.zeros(64, 4, 64), torch.zeros(64 * 64, 64), torch.zeros(64, dtype=torch.long)
    pool_decode.triton_pool_attention(q, pool, pool, rows, rows, 64)
    assert [k["USE_PDL"] for k in launched] == [False, False]
    assert pool_decode.launch_config(16, 128)["pdl"] and not pool_decode.launch_config(17, 64)["pdl"]
    monkeypatch.undo()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pool_decode, "INTERPRET", False)  # the choice on a GPU, whatever runs these tests
    monkeypatch.setattr(pool_decode, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(pool_decode, "PDL", True)
    assert pool_decode.use_pdl(cuda)
    monkeypatch.setattr(pool_decode, "PDL", False)
    assert not pool_decode.use_pdl(cuda)  # NATS_KERNELS_PDL=0
    monkeypatch.setattr(pool_decode, "PDL", True)
    monkeypatch.setattr(pool_decode, "_capability", lambda index: (8, 0))
    assert not pool_decode.use_pdl(cuda)  # an A100: no programmatic dependent launch
    monkeypatch.setattr(pool_decode, "INTERPRET", True)
    monkeypatch.setattr(pool_decode, "_capability", lambda index: (9, 0))
    assert not pool_decode.use_pdl(cuda)  # Triton's interpreter


def test_stream_programs_fill_one_wave(monkeypatch):
    """The streamed split launches one wave: the SMs times the programs whose pipelined key and value blocks fit an
    SM's shared memory (an H200: 132 SMs of 228 KiB)."""
    from nats_kernels.nats_attention import pool_decode

    monkeypatch.setattr(pool_decode, "_sm_resources", lambda index: (132, 228 * 1024))
    cuda = torch.device("cuda", 0)
    assert pool_decode.stream_programs(cuda, 64, 128, 2, 2) == 3 * 132  # 64 KiB a program
    assert pool_decode.stream_programs(cuda, 128, 128, 3, 2) == 132  # 192 KiB
    assert pool_decode.stream_programs(cuda, 64, 64, 2, 2) == 6 * 132
    assert pool_decode.stream_programs(cuda, 16, 16, 1, 2) == 8 * 132  # at most 8
    assert pool_decode.stream_programs(torch.device("cpu"), 64, 128, 2, 2) == 4


@pytest.mark.slow  # a GPU benchmark's CPU smoke run: make test-all
def test_sweep_pool_attention_smoke(tmp_path):
    """benchmarks/sweep_pool_attention.py --smoke: the default launch choice first, the others timed, all checked
    against the PyTorch reference."""
    import json

    from conftest import load_script

    assert load_script("benchmarks/sweep_pool_attention.py").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sweep_pool_attention.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == ["tiny"] * 6 + ["tiny, spread"] * 6 + ["tiny, spread, ring"] * 6
    assert [r["default"] for r in rows[:6]] == ["default", "rows default", "default, no PDL", "fast", "fast", "fast"]
    assert [r["split"] for r in rows[:6]] == ["stream", "rows", "stream", "balanced", "rows", "stream"]
    assert [r["pdl"] for r in rows[:6]] == [True, True, False, True, True, True]
    assert all(r["max_err"] < 1e-5 for r in rows)
    text = (tmp_path / "sweep_pool_attention.md").read_text()
    assert "| tiny | default | 64 |" in text and "| tiny, spread | default | 64 |" in text
    assert {r["split"] for r in rows} == {"rows", "balanced", "stream"}  # every split timed
    sweep = load_script("benchmarks/sweep_pool_attention.py")
    assert sweep.main(["--smoke", "--shapes", "_spread", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sweep_pool_attention.json").read_text())["rows"]
    assert {r["shape"] for r in rows} == {"tiny, spread", "tiny, spread, ring"}  # "_" matches a space
    assert sweep.main(["--smoke", "--shapes", "ring", "--only", "split=stream", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sweep_pool_attention.json").read_text())["rows"]
    assert [r["default"] for r in rows] == ["default", "rows default", "default, no PDL", "fast"]  # defaults kept
    assert rows[-1]["split"] == "stream" and all(r["max_err"] < 1e-5 for r in rows)
    assert sweep.main(["--smoke", "--only", "warps=2", "--out", str(tmp_path / "none")]) == 2  # not a choice's key
    assert sweep.main(["--smoke", "--shapes", "9B", "--out", str(tmp_path / "none")]) == 2  # no such shape
    assert not (tmp_path / "none").exists()


def test_nats_decode_with_triton_backend():
    """The NAtS cache stepping through the Triton kernel (interpreted: few tokens) equals the forward."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = nats_model(window=3, n_layer=2).float().to(dev)
    idx = torch.randint(0, V, (2, 12)).to(dev)
    ref = model(idx).logits
    out, cache = policy_logits(model, idx, "nats", sequential=True, backend="triton")
    assert all(layer.context.backend == "triton" for layer in cache.layers)
    assert torch.allclose(out, ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------
# memory: per-head segments with slack, not padded to the longest head
# ----------------------------------------------------------------------------------------------------
def test_nats_cache_memory_follows_kept_tokens_per_head():
    torch.manual_seed(0)
    B, H, N, D, W, S = 2, 4, 3000, 16, 8, 64
    # very different head sizes: head h keeps a fraction 0.02 * 4**h of its tokens as globals
    rate = torch.tensor([0.02, 0.05, 0.2, 0.6]).view(1, H, 1)
    u = torch.rand(B, H, N)
    types = torch.where(u < rate, 0, torch.where(u < rate + 0.02, 1, 2))
    types[..., 0] = 0
    types = torch.cat([types, torch.randint(0, 3, (B, H, S))], -1)  # then S decode steps of random types
    layer = nats_probe_layer(types, W, D, dtype=torch.float32)
    k = torch.randn(B, H, N, D)
    layer.prefill(torch.zeros(B, H, N, D), k, k, torch.zeros(B, N, C))
    kv_ratio = layer.kv_nbytes() / layer.kept_nbytes()
    padded = B * H * int(layer.length.max()) / int(layer.kept().sum())
    assert kv_ratio < 1.1 < padded, (kv_ratio, padded)
    for _ in range(S):
        layer.step(torch.randn(B * H, 1, D), torch.randn(B * H, D), torch.randn(B * H, D), torch.zeros(B, C))
    assert layer.kv_nbytes() / layer.kept_nbytes() < 1.15


# ----------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------
def test_budget_errors():
    model = tiny({"name": "dense"})
    refused = {  # (policy, max_len, budget): the message
        ("h2o", 64, 64): "budget B=64 >= N=64",
        ("streaming_llm", 64, 4): "too small for 4 attention sinks",
        ("streaming_llm", 64, None): "needs a budget",
        ("full", 64, 8): "takes no budget",
        ("h2o", 64, 1): "h2o: budget B=1 is too small",
        ("full", 100, None): "exceed the model's block_size",
    }
    for (policy, max_len, budget), message in refused.items():
        with pytest.raises(ValueError, match=message):
            make_caches(model, policy, 1, max_len, budget=budget)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        generate(model, torch.zeros(1, 70, dtype=torch.long), 5)


def test_model_errors():
    with pytest.raises(ValueError, match="cache policy 'nats' needs a model with nats attention"):
        make_caches(tiny({"name": "dense"}), "nats", 1, 8)
    anna = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16, attention={"name": "anna"}))
    with pytest.raises(ValueError, match="attention 'anna'"):
        make_caches(anna, "full", 1, 8)
    with pytest.raises(ValueError, match="cannot decode"):
        policy_logits(
            tiny({"name": "dense"}), torch.zeros(1, 20, dtype=torch.long), "h2o_dense", budget=8, sequential=True
        )


def test_decode_benchmark_helpers_on_cpu():
    """benchmarks/bench_decode.py (a GPU script): its synthetic prompt through the cache's prefill (NAtS' types from
    the type table, for the prompt and the decoded tokens) and decode steps, on CPU."""
    import importlib.util

    from conftest import REPO
    from nats.cache.decode import decode_step
    from nats.cache.policies.nats import kept_after_prompt

    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = nats_model(window=4, n_layer=2, block_size=96).float()
    gen = torch.Generator().manual_seed(0)
    B, L = 2, 64
    types = bench.synthetic_types(B, 2, L, gen, "cpu")
    assert (types[..., 0] == 0).all() and 0.03 < float((types == 0).float().mean()) < 0.2
    later = torch.full((B, 2, 8), 2)
    later[0, 0, 3] = 0  # one global for row (0, 0) at position L + 3
    table = bench.type_table(torch.cat([types, later], -1), 0)  # the prompt's positions and the decoded ones

    def run(policy, backend="torch", seed=0):
        budget = 12 if policy in ("h2o", "streaming_llm") else None
        opts = {"type_table": table} if policy == "nats" else {}
        cache = bench.make_cache(model, policy, B, L + 8, budget=budget, backend=backend, track=False, **opts)
        gen = torch.Generator().manual_seed(seed)
        bench.fill(cache, model, B, L, gen)
        assert cache.t == L
        token = torch.randint(0, V, (B,), generator=gen)
        pos = torch.tensor([L])
        for _ in range(L, L + 8):
            logits = decode_step(model, cache, token, pos)
            token = logits.argmax(-1)
            pos += 1
        assert cache.t == L + 8
        return logits, cache

    logits = {}
    for policy in ("full", "full_sdpa", "nats", "h2o", "streaming_llm"):
        logits[policy], cache = run(policy)
        assert torch.isfinite(logits[policy]).all()
        kept = int(cache.kept().sum())
        expect = {
            "full": 2 * B * 2 * (L + 8),
            "full_sdpa": 2 * B * 2 * (L + 8),
            "h2o": 2 * B * 2 * 12,
            "streaming_llm": 2 * B * 2 * 12,
        }
        if policy in expect:
            assert kept == expect[policy], policy
        else:
            assert 0 < kept < 2 * B * 2 * (L + 8) * 0.5
            assert not cache.counts_types()  # track=False
            c = cache.layers[0]
            assert int(c.n_global[0]) == int((types[0, 0] == 0).sum()) + 1 and int(c.n_global[1]) == int(
                (types[0, 1] == 0).sum()
            )
            # what the table's types keep of the prompt and the decoded tokens: globals, live locals, ring
            whole = table.table.t()  # [R, L + 8]
            keep, isg = kept_after_prompt(whole)
            ring = (whole == 2) & (torch.arange(L + 8) > L + 8 - 4)
            for layer in cache.layers:
                assert torch.equal(layer.kept(), keep.sum(1) + ring.sum(1))
                assert torch.equal(layer.n_global, isg.sum(1))
        assert cache.reallocations() == 0 and cache.peak_nbytes() >= cache.nbytes() > cache.kv_nbytes()
    # the benchmark's own SDPA baseline reads the same keys as full (the same prompt and tokens)
    assert torch.allclose(logits["full_sdpa"], logits["full"], atol=1e-5, rtol=0)
    # the Triton step takes the same synthetic types, from the table its append kernel reads at the device position
    (ref, ref_cache), (out, cache) = run("nats", "torch", seed=1), run("nats", "triton", seed=1)
    assert torch.allclose(out, ref, atol=1e-4, rtol=0)
    for a, b in zip(ref_cache.layers, cache.layers):  # the same tokens kept (keys differ by the attention's rounding)
        for name in ("start", "length", "n_global", "ring_valid"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for r in range(a.rows.shape[1]):  # the segments (past its length the PyTorch step leaves a moved global's copy)
            s, n = int(a.start[r]), int(a.length[r])
            assert torch.allclose(a.k_pool[s : s + n], b.k_pool[s : s + n], atol=1e-4, rtol=0), r
    assert int(cache.layers[0].n_global[0]) == int((types[0, 0] == 0).sum()) + 1  # the synthetic global at L + 3


def test_nats_fused_triton_step_equals_torch_step():
    """The Triton backend's fused append/evict launches leave the same cache state as the torch ops, growth
    included."""
    torch.manual_seed(4)
    B, H, G, N, D, W = 2, 2, 2, 24, 8, 3
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the real kernel on a GPU
    types = torch.randint(0, 3, (B, H, N))
    types[..., 0] = 0
    types[0, 1, 2:21] = 1  # a local run past the first segment's free slots: the pools grow
    q = torch.randn(B * H, G, N, D)
    k, v, x = torch.randn(B * H, N, D), torch.randn(B * H, N, D), torch.randn(B, N, C)
    types, q, k, v, x = (t.to(dev) for t in (types, q, k, v, x))
    layers = [nats_probe_layer(types, W, D, G, be, dev, torch.float32) for be in ("torch", "triton")]
    outs = [step_all(layer, q, k, v, x) for layer in layers]
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    a, b = layers
    assert a.reallocations == b.reallocations > 0
    for name in ("length", "n_global", "ring_valid", "type_counts", "start", "cap"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert_same_nats_state(a, b)  # the segments (past a row's length the PyTorch step leaves a moved global's copy)
    assert torch.equal(a.ring_kv, b.ring_kv)  # every step writes its ring slot, whatever the type
    assert torch.allclose(a.fractions()["area"], b.fractions()["area"])


@pytest.mark.parametrize("dtype,W", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 1)])
def test_triton_nats_decode_matches_torch(dtype, W):
    """The fixed-capacity cache's step fused into the attention's launches (the merge starting from the new token,
    then the scorer's type, ring write, append, a global's locals dropped, the expired ring slot closed; a full
    segment keeps the token as sliding) against its PyTorch form (the custom op nats::nats_decode off CUDA): the
    output, and the state row for row. W = 1: a sliding token's only query is its own, its slot closed at once."""
    from nats.cache.policies import nats as nats_policy
    from nats_kernels.nats_attention.nats_step import nats_decode

    torch.manual_seed(0)
    B, Hkv, G, D, C = 2, 3, 2, 16, 20
    R = B * Hkv
    cap = torch.tensor([5, 3, 8, 2, 6, 4])
    start = torch.zeros_like(cap)
    start[1:] = cap.cumsum(0)[:-1]
    P = int(cap.sum()) + 1
    pos = torch.tensor([9])
    ring_valid = torch.rand(R, W) < 0.5
    ring_valid[:, 9 % W] = False  # the slot of position 9 - W: its window ended at the last query
    state = {
        "ring_k": torch.randn(R, W, D).to(dtype),
        "ring_v": torch.randn(R, W, D).to(dtype),
        "ring_valid": ring_valid,
        "k_pool": torch.randn(P, D).to(dtype),
        "v_pool": torch.randn(P, D).to(dtype),
        "length": torch.tensor([2, 3, 0, 2, 6, 1]),  # rows 1, 3 and 4 are full
        "n_global": torch.tensor([1, 1, 0, 2, 3, 0]),
        "t": torch.full((R,), -1),
    }
    x, w = torch.randn(B, C).to(dtype), torch.randn(3 * Hkv, C).to(dtype)
    with torch.no_grad():  # the scorer makes row 0's token global (its local goes), row 2's local, row 5's sliding
        for r, t in ((0, 0), (2, 1), (5, 2), (1, 0)):
            b, h = divmod(r, Hkv)
            w[3 * h + t] = x[b] * 4
    bias = torch.tensor([0.3, -0.2, 0.0])
    q = torch.randn(R, G, D).to(dtype)
    k_new, v_new = torch.randn(R, D).to(dtype), torch.randn(R, D).to(dtype)
    ref = {k: v.clone() for k, v in state.items()}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # the op takes the buffers packed, as the cache holds them (rows [6, R], ring [2, R, W, D], pool [2, P, D])
    rows = torch.stack((start, ref["length"], cap, ref["n_global"], ref["t"], torch.zeros_like(cap)))
    ring_kv, kv_pool = torch.stack((ref["ring_k"], ref["ring_v"])), torch.stack((ref["k_pool"], ref["v_pool"]))
    y_ref = nats_policy.nats_decode(q, x, w, bias, pos, rows, k_new, v_new, ring_kv, ref["ring_valid"], kv_pool)
    ref.update(t=rows[4], length=rows[1], n_global=rows[3], ring_k=ring_kv[0], ring_v=ring_kv[1], k_pool=kv_pool[0],
               v_pool=kv_pool[1])  # fmt: skip
    out = {k: v.to(dev) for k, v in state.items()}
    y = nats_decode(q.to(dev), k_new.to(dev), v_new.to(dev), pos.to(dev), out["t"], out["k_pool"], out["v_pool"],
                    start.to(dev), out["length"], out["n_global"], out["ring_k"], out["ring_v"], out["ring_valid"],
                    x=x.to(dev), w_s=w.to(dev), bias=bias.to(dev), cap=cap.to(dev))  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.cpu().float(), y_ref.float(), atol=tol, rtol=0)
    out = {k: v.cpu() for k, v in out.items()}
    for k in ("t", "length", "n_global", "ring_valid", "ring_k", "ring_v"):
        assert torch.equal(ref[k], out[k]), k
    for r in range(R):  # the segments (the PyTorch form leaves a dropped global's old copy past the length)
        s, n = int(start[r]), int(ref["length"][r])
        assert torch.equal(ref["k_pool"][s : s + n], out["k_pool"][s : s + n]), r
        assert torch.equal(ref["v_pool"][s : s + n], out["v_pool"][s : s + n]), r
    t = ref["t"].tolist()
    assert t[0] == 0 and int(ref["length"][0]) == 2  # global: its row's local dropped (1 global + the new one)
    assert t[2] == 1 and int(ref["length"][2]) == 1 and t[5] == 2 and bool(ref["ring_valid"][5, 9 % W]) == (W > 1)
    assert t[1] == 2 and t[4] == 2  # full rows keep their global / local token as sliding
    assert not ref["ring_valid"][:, 10 % W].any()  # the slot whose window this query closed


# ----------------------------------------------------------------------------------------------------
# the fused step's scorer and strided key/value reads (nats_decode), against the torch step
# ----------------------------------------------------------------------------------------------------
def assert_same_nats_state(a: EngineLayer, b: EngineLayer) -> None:
    """Two NAtS layers hold the same tokens: metadata, pool segments and valid ring slots (scratch slots aside)."""
    for name in ("start", "cap", "length", "n_global", "ring_valid", "type_counts"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for r in range(a.rows.shape[1]):
        s, n = int(a.start[r]), int(a.length[r])
        assert torch.equal(a.k_pool[s : s + n], b.k_pool[s : s + n]), r
        assert torch.equal(a.v_pool[s : s + n], b.v_pool[s : s + n]), r
        valid = a.ring_valid[r]
        assert torch.equal(a.ring_k[r][valid], b.ring_k[r][valid]), r
        assert torch.equal(a.ring_v[r][valid], b.ring_v[r][valid]), r


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nats_type_table_keeps_the_tokens_its_types_say(backend):
    """A NAtS layer made with a TypeTable from position P decodes with the table's types, not the scorer's (which
    differ; the prompt before P keeps the scorer's): each step's type is the table's, its output the NAtS attention of
    those types, and after N steps the layer holds exactly what a prefill of the whole sequence with the same types
    keeps (globals, live locals, valid ring slots; Triton through its interpreter on the CPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, P, N, W = 2, 5, 12, 3
    model = nats_model(window=W, n_layer=1).float().to(dev)
    attn, core = model.blocks[0].attn, model.blocks[0].attn.core
    H, Hkv, D, Cm = attn.n_head, attn.n_kv_head, attn.head_dim, model.config.n_embd
    R, G = B * Hkv, H // Hkv
    gen = torch.Generator().manual_seed(7)
    later = torch.randint(0, 3, (B, Hkv, N), generator=gen).to(dev)
    q = torch.randn(B, H, P + N, D, generator=gen).to(dev)
    k, v = (torch.randn(B, Hkv, P + N, D, generator=gen).to(dev) for _ in range(2))
    x = torch.randn(B, P + N, Cm, generator=gen).to(dev)
    cache = new_layer("nats", core, backend, type_table=type_table(later, P))
    differs = False
    with torch.no_grad():
        whole = torch.cat([core.hard_types(x[:, :P]), later], -1)  # the scorer's types, then the table's
        ref = NF.nats_attention_types(q, k, v, whole, W, backend="reference")  # [B, H, P + N, D]
        cache.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], x[:, :P])
        for i in range(N):
            p = P + i
            want = later[..., i].reshape(R)
            scored = scorer_types(x[:, p], core.scorer.weight, core.type_bias, torch.tensor([p], device=dev))
            differs |= not torch.equal(scored, want)
            y = cache.step(q[:, :, p].reshape(R, G, D), k[:, :, p].reshape(R, D), v[:, :, p].reshape(R, D), x[:, p])
            assert torch.equal(cache.last_type, want), i
            assert torch.allclose(y.reshape(B, H, D), ref[:, :, p], atol=1e-5, rtol=0), i
        loaded = new_layer("nats", core, backend, type_table=type_table(whole))
        loaded.prefill(q, k, v, x)
    assert differs  # the scorer alone would have typed some token otherwise
    for name in ("length", "n_global", "ring_valid", "type_counts"):
        assert torch.equal(getattr(cache, name), getattr(loaded, name)), name
    for r in range(R):
        a, b, n = int(cache.start[r]), int(loaded.start[r]), int(cache.length[r])
        assert torch.equal(cache.k_pool[a : a + n], loaded.k_pool[b : b + n]), r
        assert torch.equal(cache.v_pool[a : a + n], loaded.v_pool[b : b + n]), r
        valid = cache.ring_valid[r]
        assert torch.equal(cache.ring_k[r][valid], loaded.ring_k[r][valid]), r


def test_type_table_checks_its_table():
    """A TypeTable takes integer types -1..2 [T, R] from a position >= 0, and a cache only one of its rows."""
    with pytest.raises(ValueError, match="integer tensor"):
        TypeTable(torch.zeros(3, 4), 0)
    with pytest.raises(ValueError, match="-1..2"):
        TypeTable(torch.full((3, 4), 3), 0)
    with pytest.raises(ValueError, match="first_pos"):
        TypeTable(torch.zeros(3, 4, dtype=torch.long), -1)
    model = nats_model(window=2, n_layer=1)
    rows = model.blocks[0].attn.n_kv_head  # one sequence
    table = TypeTable(torch.zeros(3, rows + 2, dtype=torch.long), 0)
    cache = make_caches(model, "nats", 1, 8, type_table=table)
    with pytest.raises(ValueError, match=f"{rows + 2} columns, the cache {rows} rows"):
        prefill(model, cache, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="TypeTable"):
        make_caches(model, "nats", 1, 8, type_table=(torch.zeros(3, rows), 0))


@pytest.mark.parametrize("override", [None, "table"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_nats_fused_step_with_model_projections_equals_torch_step(pos_emb, override):
    """The Triton step (nats_decode: the scorer's type computed in the merge kernel) fed q, k, v as Attention.project
    makes them (views of the fused qkv output, whose layout differs between learned positions and RoPE; GQA), through
    the cache as the model calls it, equals the torch step: the same types (ties, the type offsets), cache state and
    output. ``table``: the cache's type_table read at the device position after a prompt (-1: the scorer's type), by
    the fused step and by the torch step. (Token 0 is the prompt's here; the kernel's token-0 rule:
    test_nats_kernels_scorer_rounds_like_the_linear.)"""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, the real kernel on a GPU
    B, N, W = 2, 9, 3
    P = 5 if override == "table" else 1  # prompt tokens prefilled before the steps
    model = tiny({"name": "nats", "window": W}, n_layer=1, pos_emb=pos_emb).float().to(dev)
    attn, core = model.blocks[0].attn, model.blocks[0].attn.core
    H, Hkv, D, Cm = attn.n_head, attn.n_kv_head, attn.head_dim, model.config.n_embd
    assert Hkv < H
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = torch.randn(3 * Hkv, Cm, generator=gen)
        w[1] = w[0]  # KV head 0: equal global and local logits, the tie goes to the first maximum (global)
        core.scorer.weight.copy_(w)
        core.type_bias.copy_(torch.tensor([0.4, 0.4, -0.3]))  # equal offsets on global and local keep the tie
    table = torch.randint(-1, 3, (N, B * Hkv), generator=gen).to(dev)
    tab = {"type_table": TypeTable(table, P)} if override == "table" else {}
    ref, fused = (make_caches(model, "nats", B, P + N, backend=be, **tab) for be in ("torch", "triton"))
    raw, unbiased = [], []  # the scorer's argmax, and without the offsets
    with torch.no_grad():
        x0 = torch.randn(B, P, Cm, generator=gen).to(dev)
        q0, k0, v0 = attn.project(x0, model.rope, torch.arange(P, device=dev))
        for c in (ref, fused):
            c.attend(0, q0, k0, v0, x0)
        for i in range(N):
            pos = torch.tensor([P + i], device=dev)
            x = torch.randn(B, 1, Cm, generator=gen).to(dev)
            q, k, v = attn.project(x, model.rope, pos)
            row = (H + 2 * Hkv) * D if pos_emb == "learned" else (H + Hkv) * D  # RoPE writes q and k anew
            assert not k.is_contiguous() and k.stride()[:2] == (row, D) and v.stride()[:2] == ((H + 2 * Hkv) * D, D)
            z = core.type_logits(x).reshape(B * Hkv, 3)
            raw.append(z.argmax(-1))
            unbiased.append((z - core.type_bias).argmax(-1))
            scored = scorer_types(x[:, 0], core.scorer.weight, core.type_bias, pos)
            assert torch.equal(scored, raw[-1]), i
            want = scored if override is None else torch.where(table[i] >= 0, table[i], scored)
            y_ref = ref.attend(0, q, k, v, x, pos=pos)
            y = fused.attend(0, q, k, v, x, pos=pos)
            a, b = ref.layers[0], fused.layers[0]
            assert torch.equal(b.last_type, want) and torch.equal(a.last_type, want), i
            assert torch.allclose(y, y_ref, atol=1e-5, rtol=0), i
            assert_same_nats_state(a, b)
    if override is None:  # the cases the kernel must get right occurred
        assert any(not torch.equal(u, r) for u, r in zip(unbiased, raw))  # the offsets change a type
        counts = fused.layers[0].type_counts.view(B, Hkv, 3)
        assert (counts.sum((0, 1)) > 0).all()  # all three types occur
        assert counts[:, 0, 1].sum() == 0 and counts[:, 0, 0].sum() > B  # the tie of KV head 0 goes to global
    if override == "table":
        assert (table == -1).any() and (table >= 0).any()


def bf16_alternatives(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float32 logits z kept as they are or rounded to bf16 by the wrong rules (bf16 is float32's upper half)."""
    bits = z.view(torch.int32).to(torch.int64)
    upper = (1 << 32) - (1 << 16)
    as_float = lambda b: (b & upper).to(torch.int32).view(torch.float32)  # noqa: E731
    return {"float32": z, "truncated": as_float(bits), "ties away": as_float(bits + 0x8000)}


@pytest.mark.parametrize("bias", [(0.0, 0.0, 0.0), (0.0, 2**-7, 0.0)])
def test_nats_kernels_scorer_rounds_like_the_linear(bias):
    """The fused step's scorer (nats_decode, with a capacity as the fixed-capacity cache runs it and without) against
    NAtSAttention.type_logits in bf16 + argmax, on logits built exactly: x . w is exact in float32, and only its
    rounding to bf16 (to nearest, ties to even) decides the type. Head 0: 1 + 2^-10 against 1 + 2^-9 (both 1 in
    bf16: a tie, global; unrounded, local); head 1: 1 against 1 + 2^-8 + 2^-10 (to nearest: local; truncated: a
    tie); head 2: 1 against 1 + 2^-8, a midpoint (ties to even: a tie; ties away from zero: local); head 3: an exact
    local/sliding tie (local). The offsets (0, 2^-7, 0) make heads 0 and 2 local."""
    from nats.attention.nats import NAtSAttention
    from nats.attention.registry import AttentionDims
    from nats_kernels.nats_attention.nats_step import nats_decode

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, Hkv, C, D, W = 1, 4, 8, 8, 4
    R = B * Hkv
    dims = AttentionDims(n_embd=C, n_head=Hkv, n_kv_head=Hkv, head_dim=D, block_size=16, layer_idx=0, n_layer=1)
    core = NAtSAttention(dims, window=W, backend="reference").eval()
    x = torch.tensor([[1, 2**-8, 2**-9, 2**-10, 1, 0, 0, 0]])  # [B, C]
    w = torch.zeros(3 * Hkv, C)
    w[0, [0, 3]] = w[1, [0, 2]] = 1  # head 0: z = (1 + 2^-10, 1 + 2^-9, 0)
    w[3, 0] = w[4, [0, 1, 3]] = 1  # head 1: z = (1, 1 + 2^-8 + 2^-10, 0)
    w[6, 0] = w[7, [0, 1]] = 1  # head 2: z = (1, 1 + 2^-8, 0)
    w[10, 4] = w[11, 4] = 1  # head 3: z = (0, 1, 1)
    with torch.no_grad():
        core.scorer.weight.copy_(w)
        core.type_bias.copy_(torch.tensor(bias))
    core, x = core.to(dev, torch.bfloat16), x.to(dev, torch.bfloat16)
    w_s, b = core.scorer.weight, core.type_bias
    with torch.no_grad():
        want = core.type_logits(x[:, None]).argmax(-1).reshape(R)
        exact = x.float() @ w_s.float().T  # exact: every partial sum fits float32
    # without the offsets the types are (0, 1, 0, 1): a kernel that ignored them would fail the second case
    assert want.tolist() == ([1, 1, 1, 1] if bias[1] else [0, 1, 0, 1])
    if not bias[1]:
        for name, z in bf16_alternatives(exact).items():  # each wrong rounding picks another type somewhere
            assert not torch.equal(z.view(R, 3).argmax(-1), want), name
    ring_k = torch.zeros(R, W, D, device=dev, dtype=torch.bfloat16)
    cap = torch.full((R,), 4, device=dev)
    start = torch.arange(R, device=dev) * 4
    k_new = torch.randn(B, Hkv, 1, D).to(dev, torch.bfloat16)
    q = torch.randn(R, 1, D).to(dev, torch.bfloat16)
    for pos, types in ((5, want), (0, torch.zeros_like(want))):  # token 0 is global
        pos = torch.tensor([pos], device=dev)
        for with_cap in (False, True):  # the GPT path's cache (no capacity) and the fixed-capacity one
            t = torch.full((R,), -1, dtype=torch.long, device=dev)
            pool = torch.zeros(4 * R + 1, D, device=dev, dtype=torch.bfloat16)
            zeros = torch.zeros(R, dtype=torch.long, device=dev)
            nats_decode(q, k_new, k_new, pos, t, pool, pool.clone(), start, zeros, zeros.clone(), ring_k.clone(),
                        ring_k.clone(), torch.zeros(R, W, dtype=torch.bool, device=dev), x=x, w_s=w_s, bias=b,
                        cap=cap if with_cap else None)  # fmt: skip
            assert torch.equal(t, types), (with_cap, int(pos))


def test_nats_fused_step_launches_only_the_attentions_two_kernels(monkeypatch):
    """One fused step of a layer, untracked, runs no torch compute besides the copy of the model's q (a view of its
    fused projection) into the engine's rows [R, G, D] (k and v are read where the projection wrote them): the scorer,
    the type offsets, the admission and the attention are all the attention's two kernels (nats_decode: the pool
    attention's split kernel and the step's own merge, which admits the token), so those are the launches. The ops of
    the kernel's wrapper inside the custom op nats::nats_decode are counted too; ops that only make views or allocate do
    not launch a kernel and are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nats_kernels.nats_attention import nats_step, pool_decode

    free = set(
        "view _unsafe_view reshape transpose permute t slice select split split_with_sizes expand unsqueeze squeeze "
        "unflatten alias as_strided detach empty empty_like".split()
    )
    free.add("nats_decode")  # the custom op: its body (the kernel's wrapper) is counted below
    launches, ops, inside = [], [], [False]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and func.__name__.split(".")[0] not in free:
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    for module, name in ((pool_decode, "_stream_decode_kernel"), (nats_step, "_merge_admit_kernel")):
        kernel = getattr(module, name)

        def run(*args, _run=kernel.run, _name=name, **kw):
            launches.append(_name)
            inside[0] = True  # the interpreter's own tensor work is the kernel's
            try:
                return _run(*args, **kw)
            finally:
                inside[0] = False

        monkeypatch.setattr(kernel, "run", run)

    def wrapper(*args, _fn=nats_step.nats_decode, **kw):  # inside the custom op the outer mode is off
        with Ops():
            return _fn(*args, **kw)

    monkeypatch.setattr(nats_step, "nats_decode", wrapper)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny({"name": "nats", "window": 3}, n_layer=1).to(dev, torch.bfloat16)
    attn = model.blocks[0].attn
    cache = make_caches(model, "nats", 2, 8, backend="triton", track=False)
    cache.auto_maintain = False  # host bookkeeping between steps, not part of the step
    with torch.no_grad():
        pos = torch.arange(2, device=dev)  # a prompt of two tokens, then the step of token 2
        x = torch.randn(2, 3, model.config.n_embd, device=dev, dtype=torch.bfloat16)
        cache[0].prefill(*attn.project(x[:, :2], model.rope, pos), x[:, :2])
        launches.clear()
        pos = torch.tensor([2], device=dev)
        q, k, v = attn.project(x[:, 2:], model.rope, pos)
        with Ops():
            cache[0].step(q, k, v, x[:, 2:], pos)
    assert launches == ["_stream_decode_kernel", "_merge_admit_kernel"]
    assert ops == ["clone.default"], ops


def test_pool_attention_passes_the_split_choice_to_the_kernel(monkeypatch):
    """`pool_attention(..., balanced=)` reaches the Triton kernel's launch (chunks balanced over the rows, or each row
    split alike), and balanced is the default."""
    from nats.cache import attention

    configs = []
    fake = lambda q, *a, config=None, **k: configs.append(config) or q  # noqa: E731
    monkeypatch.setattr(attention, "_triton_fn", lambda: (fake, None))
    q, pool, rows = torch.zeros(2, 1, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long)
    attention.pool_attention(q, pool, pool, rows, rows, 4, backend="triton")
    attention.pool_attention(q, pool, pool, rows, rows, 4, backend="triton", balanced=False)
    assert configs == [{"balanced": True}, {"balanced": False}]


def test_full_cache_append_writes_the_new_token_in_place_compiled_or_not():
    """The full rule's step (`AppendRule.step`) writes the new key and value into slot ``start + length`` of every
    row, the others untouched, every row's length + 1; compiled (functionalized and its mutations written back, as
    inductor does on CUDA; aot_eager here, inductor runs it in the GPU tests) into the same buffers with the same
    values."""
    B, H, D = 2, 3, 8
    R = B * H
    gen = torch.Generator().manual_seed(0)
    layer = new_layer("full", reserve=16)
    layer.prefill(*(torch.randn(B, H, 4, D, generator=gen) for _ in range(3)))

    def eager(q, k, v, pos):
        return layer.rule.step(layer.context, layer, None, q, k, v, pos, None)

    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    for p in range(4, 10):  # compiled and eager steps in turn, on the same buffers
        q, k, v = (torch.randn(R, *shape, D, generator=gen) for shape in ((1,), (), ()))
        ptrs = [t.data_ptr() for t in (layer.kv_pool, layer.rows)]
        ref = layer.kv_pool.clone()
        dest = layer.start + layer.length
        ref[0, dest], ref[1, dest] = k, v
        (compiled if p % 2 else eager)(q, k, v, torch.tensor([p]))
        assert [t.data_ptr() for t in (layer.kv_pool, layer.rows)] == ptrs
        assert torch.equal(layer.length, torch.full((R,), p + 1)) and torch.equal(layer.kv_pool, ref), p
