"""The fixed-capacity cache engine (`nats.cache.engine`) driven directly, one `EngineLayer` per test on tiny shapes,
without transformers: growth when the number of new tokens is unknown (decoding equals a run planned with enough
room, token for token; `maintain` says when it reallocated and looks at the device only once its host count of free
steps ran out), the engine's measurements (against NAtS' definitions, spec sections 2, 5 and 6, and
`nats.hf.StaticPolicyCache`), the multi-layer `EngineCache` driven without transformers (against
`nats.hf.StaticPolicyCache`), StreamingLLM's ``exact_prefill`` (against its mask over the whole sequence) and the
backend choice reaching both attention ops."""

from __future__ import annotations

import pytest
import torch

import nats_kernels
from nats import functional as NF
from nats.attention.nats import NAtSAttention
from nats.attention.registry import AttentionDims
from nats.cache.engine import GROW_STEPS, EngineLayer
from nats.cache.policies.nats import kept_after_prompt
from nats.cache.policies.streaming_llm import streaming_mask
from nats.cache.registry import get_cache_class
from nats.cache.rule import RuleContext

B, HQ, HKV, D, C = 2, 4, 2, 16, 16  # D: a head dim the Triton kernels take (the GPU test)
R, G = B * HKV, HQ // HKV

interpreted = pytest.mark.skipif(not nats_kernels.INTERPRET, reason="Triton on CPU tensors needs its interpreter")


def layer(policy, reserve, track=True, core=None, backend="torch", prefill_kernel="torch", **options):
    rule = get_cache_class(policy).rule(**options)
    return EngineLayer(rule, RuleContext(0, 1, reserve, track, prefill_kernel, backend), core)


def prompt(n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(B, n, C, generator=g, dtype=dtype)


def tokens(steps, dtype=torch.float64, seed=1):
    """Each step's query [R, G, D], key and value [R, D] and block input [B, C]."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(R, G, D, generator=g, dtype=dtype), torch.randn(R, D, generator=g, dtype=dtype),
         torch.randn(R, D, generator=g, dtype=dtype), torch.randn(B, C, generator=g, dtype=dtype))
        for _ in range(steps)
    ]  # fmt: skip


def decode(cache, n=10, steps=40, budget=None, dtype=torch.float64, device="cpu"):
    """Prefill n tokens and decode `steps`: (prompt output, the steps' outputs [steps, R, G, D])."""
    q, k, v, x = (t.to(device) for t in prompt(n, dtype))
    y = cache.prefill(q, k, v, x, budget=budget)
    return y, torch.stack([cache.step(*(t.to(device) for t in ts)) for ts in tokens(steps, dtype)])


def nats_core(window=4, bias=(1.0, 0.0, 0.0)):
    """A NAtS scorer with random weights (types of every kind), globals favoured by ``bias`` (rows that grow)."""
    torch.manual_seed(0)
    core = NAtSAttention(AttentionDims(C, HQ, HKV, D, 256, 0, 1), window=window, backend="reference").eval()
    with torch.no_grad():
        core.scorer.weight.normal_(0, 0.5)
        core.type_bias.copy_(torch.tensor(bias))
    return core


# ------------------------------------------------------------------------------------------------------------ growth
@pytest.mark.parametrize("policy,options", [("full", {}), ("snapkv", {"window": 4})])
def test_appending_rules_grow_without_a_reserve_and_decode_as_with_one(policy, options):
    budget = 6 if policy == "snapkv" else None
    grown, planned = layer(policy, None, **options), layer(policy, 40, **options)
    y0, ys = decode(grown, budget=budget)
    y1, yp = decode(planned, budget=budget)
    assert torch.equal(y0, y1) and torch.equal(ys, yp)
    assert grown.reallocations >= 2 and planned.reallocations == 0  # 40 steps: past GROW_STEPS twice
    kept = (10 if budget is None else budget) + 40
    assert grown.kept().tolist() == [kept] * R == planned.kept().tolist()  # every token seen is held
    assert torch.equal(grown.fractions()["area"], planned.fractions()["area"])


def test_a_reserve_that_runs_out_grows_instead_of_dropping_tokens():
    short, planned = layer("full", 5), layer("full", 40)
    _, ys = decode(short)
    _, yp = decode(planned)
    assert torch.equal(ys, yp) and short.kept().tolist() == [50] * R
    assert short.reallocations >= 1


def test_nats_grows_and_decodes_as_with_enough_reserve():
    grown, planned = layer("nats", None, core=nats_core()), layer("nats", 40, core=nats_core())
    y0, ys = decode(grown, dtype=torch.float32)
    y1, yp = decode(planned, dtype=torch.float32)
    assert torch.equal(y0, y1) and torch.equal(ys, yp)
    assert grown.reallocations >= 1 and planned.reallocations == 0
    # the ring, the global count and the last type survived the relayouts
    for name in ("length", "n_global", "last_type"):
        assert torch.equal(getattr(grown, name), getattr(planned, name)), name
    assert torch.equal(grown.ring_kv, planned.ring_kv) and torch.equal(grown.ring_valid, planned.ring_valid)
    assert torch.equal(grown.kept(), planned.kept()) and torch.equal(grown.type_counts, planned.type_counts)
    assert int(grown.n_global.min()) > GROW_STEPS  # the rows did need more room than planned without a reserve


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nats_grows_on_cuda_with_the_fused_kernels():
    """The Triton prefill (from the scorer's logits) and fused step: a run that grows decodes as one planned with
    enough room (the split-K count follows the pool's size, so the outputs agree to rounding), the same types kept."""
    core = nats_core().cuda()
    runs = []
    for reserve in (None, 40):
        cache = layer("nats", reserve, core=core, backend="auto", prefill_kernel="auto")
        runs.append((cache, *decode(cache, dtype=torch.float32, device="cuda")))
    (grown, y0, ys), (planned, y1, yp) = runs
    assert grown.reallocations >= 1 and planned.reallocations == 0
    torch.testing.assert_close(y0, y1)
    torch.testing.assert_close(ys, yp, rtol=1e-5, atol=1e-5)
    assert torch.equal(grown.type_counts, planned.type_counts) and torch.equal(grown.kept(), planned.kept())
    assert torch.equal(grown.ring_valid, planned.ring_valid) and torch.equal(grown.n_global, planned.n_global)


def test_maintain_says_when_it_reallocated_and_trusts_its_host_count_until_it_runs_out():
    cache = layer("full", 3)
    cache.prefill(*prompt(10))
    cache.length.copy_(cache.cap)  # rows full on the device: only a look at the device can tell
    pool = cache.kv_pool
    said = [cache.maintain() for _ in range(3)]
    assert said == [False] * 3 and cache.kv_pool is pool  # the 3 planned free steps: no look
    assert cache.maintain() is True and cache.kv_pool is not pool and cache.reallocations == 1
    assert int((cache.cap - cache.length).min()) == GROW_STEPS
    assert cache.free_steps == GROW_STEPS - 1
    assert [cache.maintain() for _ in range(GROW_STEPS - 1)] == [False] * (GROW_STEPS - 1)
    ring = layer("streaming_llm", None, sinks=2)  # a fixed-size rule never grows
    decode(ring, steps=30, budget=6)
    assert ring.free_steps is None and not ring.maintain() and ring.kept().tolist() == [6] * R


# ------------------------------------------------------------------------------------------------------ measurements
def whole(prompt_part, steps, i):
    """The prompt's q, k, v (item i = 0, 1, 2, ``[B, heads, n, D]``) or x (i = 3, ``[B, n, C]``) with the steps'
    (`tokens`) after it, in the prompt's layout."""
    if i == 3:
        return torch.cat([prompt_part, torch.stack([t[i] for t in steps], 1)], 1)
    heads = prompt_part.shape[1]
    return torch.cat([prompt_part, torch.stack([t[i].reshape(B, heads, D) for t in steps], 2)], 2)


def test_nats_measurements_equal_the_definitions():
    """A NAtS layer's outputs, kept tokens, area and peak fractions, type fractions and bytes after a prompt and 20
    steps, against NAtS' definitions over the whole sequence with the scorer's types (token 0 global): the attention
    of the types' mask, the cache sizes c_i = sum_j M_ij (spec section 6), what the types keep (globals, live
    locals, the sliding tokens of the last W - 1 positions)."""
    W = 4
    core = nats_core(window=W, bias=(0.0, 0.0, 0.0))
    cache = layer("nats", None, core=core)
    q, k, v, x = prompt(12, torch.float32)
    ys = [cache.prefill(q, k, v, x)]
    steps = tokens(20, torch.float32)
    for qr, kr, vr, xr in steps:
        ys.append(cache.step(qr, kr, vr, xr).reshape(B, HQ, 1, D))
    qa, ka, va, xa = (whole(t, steps, i) for i, t in enumerate((q, k, v, x)))
    N = qa.shape[2]
    with torch.no_grad():
        types = core.hard_types(xa)  # [B, Hkv, N]
    ref = NF.nats_attention_types(qa, ka, va, types, W, backend="reference")
    torch.testing.assert_close(torch.cat(ys, 2), ref, rtol=1e-5, atol=1e-5)
    t = types.reshape(R, N)
    keep, _ = kept_after_prompt(t)
    ring = (t == NF.TOKEN_SLIDING) & (torch.arange(N) > N - W)
    assert torch.equal(cache.kept(), keep.sum(1) + ring.sum(1))
    sizes = NF.nats_mask(t, W).sum(-1).double()  # [R, N]
    fr = cache.fractions()
    assert torch.equal(fr["area"], sizes.sum(-1) / (N * (N + 1) / 2))
    assert torch.equal(fr["peak"], sizes.amax(-1) / N)
    counts = torch.stack([(t == i).sum(-1) for i in range(3)], -1).double()
    types_fr = cache.type_fractions()
    assert torch.equal(types_fr, counts / N)
    assert torch.allclose(types_fr.sum(-1), torch.ones(R, dtype=torch.float64))
    assert bool((types_fr > 0).all())  # every type occurs
    assert cache.kept_nbytes() == int(cache.kept().sum()) * 2 * D * 4
    assert cache.kv_nbytes() == cache.storage_kv_nbytes() < cache.nbytes()
    untracked = layer("nats", None, track=False, core=core)
    untracked.prefill(q, k, v, x)
    with pytest.raises(RuntimeError, match="counts no token types"):
        untracked.type_fractions()
    with pytest.raises(RuntimeError, match="track=False"):
        untracked.fractions()


@pytest.mark.parametrize(
    "policy,options",
    [("full", {}), ("nats", {}), ("streaming_llm", {"budget": 12, "sinks": 2}), ("h2o", {"budget": 12})],
)
def test_measurements_equal_static_policy_cache(policy, options):
    """The same prompt and tokens through `nats.hf.StaticPolicyCache` (its attention entry point, by hand) and
    through engine layers: the same outputs, kept tokens, fractions, bytes and (NAtS) type fractions."""
    pytest.importorskip("transformers")
    from test_hf_nats import tiny_model  # noqa: PLC0415

    from nats.hf import StaticPolicyCache, attach_nats, use_policy_caches  # noqa: PLC0415

    model = tiny_model("llama")
    model = attach_nats(model, window=4, init_std=0.5) if policy == "nats" else use_policy_caches(model)
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    budget = options.pop("budget", None)
    cache = StaticPolicyCache(model, policy, max_new_tokens=6, budget=budget, **options)
    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    L = cache.n_layer
    layers = [EngineLayer(cache.rule, RuleContext(i, L, 6, True, "auto"), cache.cores[i]) for i in range(L)]
    for n in (20, 1, 1, 1, 1, 1):
        for i, own in enumerate(layers):
            q, k, v, x = rand(2, hq, n, d), rand(2, hkv, n, d), rand(2, hkv, n, d), rand(2, n, cfg.hidden_size)
            cache.layers[i].update(k, v)
            y = cache.attend(i, q, x, None)
            if own.t == 0:
                mine = own.prefill(q, k, v, x, budget=budget)
            else:
                mine = own.step(q.reshape(-1, hq // hkv, d), k.reshape(-1, d), v.reshape(-1, d), x[:, 0])
            assert torch.equal(mine.reshape(y.shape), y)
    ours = [own.fractions() for own in layers]
    for key in ("area", "peak"):
        assert torch.equal(torch.stack([f[key].view(2, hkv) for f in ours]), cache.fractions()[key]), key
    assert torch.equal(torch.stack([own.kept().view(2, hkv) for own in layers]), cache.kept())
    for what in ("nbytes", "kv_nbytes", "kept_nbytes"):
        assert sum(getattr(own, what)() for own in layers) == getattr(cache, what)(), what
    if policy == "nats":
        got = cache.type_fractions()
        assert torch.equal(torch.stack([own.type_fractions().view(2, hkv, 3) for own in layers]), got)
        assert torch.allclose(got.sum(-1), torch.ones_like(got[..., 0]))
    else:
        with pytest.raises(RuntimeError, match="counts no token types"):
            cache.type_fractions()


@pytest.mark.parametrize("policy,options", [("nats", {}), ("snapkv", {"budget": 0.5, "window": 4})])
def test_engine_cache_driven_directly_as_static_policy_cache(policy, options):
    """`EngineCache` over a model's layers without transformers (its own entry point, left padding given as token
    counts, positions counted on the host) runs as `nats.hf.StaticPolicyCache` does given transformers' 4-D mask:
    the same outputs, kept tokens, fractions and bytes; the engine module imports no transformers."""
    pytest.importorskip("transformers")
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from test_hf_nats import tiny_model  # noqa: PLC0415

    from nats.cache.engine_cache import EngineCache  # noqa: PLC0415
    from nats.hf import StaticPolicyCache, attach_nats, use_policy_caches  # noqa: PLC0415

    check = "import sys, nats.cache.engine_cache; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)
    model = tiny_model("llama")
    model = attach_nats(model, window=4, init_std=0.5) if policy == "nats" else use_policy_caches(model)
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    budget = options.pop("budget", None)
    cache = StaticPolicyCache(model, policy, max_new_tokens=4, budget=budget, prefill_kernel="torch", **options)
    own = EngineCache(policy, cache.cores, reserve=4, budget=budget, prefill_kernel="torch", **options)
    pads, P = torch.tensor([3, 0]), 16
    mask = (torch.arange(P) >= pads[:, None])[:, None, None, :].expand(2, 1, P, P)
    g = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    for n in (P, 1, 1, 1, 1):
        for i in range(cache.n_layer):
            q, k, v, x = rand(2, hq, n, d), rand(2, hkv, n, d), rand(2, hkv, n, d), rand(2, n, cfg.hidden_size)
            cache.layers[i].update(k, v)
            y = cache.attend(i, q, x, mask if n > 1 else None)
            assert torch.equal(own.attend(i, q, k, v, x, pads if n > 1 else None), y)
    assert torch.equal(own.kept(), cache.kept())
    for key in ("area", "peak"):
        assert torch.equal(own.fractions()[key], cache.fractions()[key]), key
    for what in ("nbytes", "kv_nbytes", "kept_nbytes", "overflowed"):
        assert getattr(own, what)() == getattr(cache, what)(), what
    if policy == "nats":
        assert torch.equal(own.type_fractions(), cache.type_fractions())


# ------------------------------------------------------------------------------------------- streaming exact prefill
@pytest.mark.parametrize("exact", [True, False])
def test_ring_rule_exact_prefill_and_decode_as_the_streaming_mask(exact):
    """StreamingLLM's ring rule over a prompt and 10 steps: the prompt's attention is causal over every prompt key
    (``exact_prefill``) or the StreamingLLM mask, the steps that mask over the whole sequence (the sinks and the
    last B - sinks keys); its sizes c_i the mask's rows, B tokens held."""
    budget, n, sinks = 6, 14, 2
    cache = layer("streaming_llm", None, sinks=sinks, exact_prefill=exact)
    q, k, v, x = prompt(n)
    ys = [cache.prefill(q, k, v, x, budget=budget)]
    steps = tokens(10)
    for qr, kr, vr, xr in steps:
        ys.append(cache.step(qr, kr, vr, xr).reshape(B, HQ, 1, D))
    qa, ka, va = (whole(t, steps, i) for i, t in enumerate((q, k, v)))
    N = qa.shape[2]
    mask = streaming_mask(N, budget, sinks)
    if exact:
        mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    ka, va = (t.repeat_interleave(G, 1) for t in (ka, va))
    s = (qa @ ka.transpose(-1, -2)) / D**0.5
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ va
    # the same keys, laid out in another order (the ring's slots): equal up to the summation order
    torch.testing.assert_close(torch.cat(ys, 2), ref, rtol=1e-12, atol=1e-12)
    assert cache.kept().tolist() == [budget] * R
    sizes = mask.sum(-1).double()
    fr = cache.fractions()
    assert torch.equal(fr["area"], torch.full((R,), float(sizes.sum() / (N * (N + 1) / 2)), dtype=torch.float64))
    assert torch.equal(fr["peak"], torch.full((R,), float(sizes.max() / N), dtype=torch.float64))
    assert (float(sizes.max()) == n) == exact  # the exact prompt's last query read every prompt key


# ------------------------------------------------------------------------------------------------------------ backend
@pytest.mark.parametrize("policy", ["full", "nats"])
def test_the_contexts_backend_reaches_the_attention_ops(policy):
    core = nats_core() if policy == "nats" else None
    cache = layer(policy, 4, core=core, backend="bogus")
    q, k, v, x = prompt(6, torch.float32)
    cache.prefill(q, k, v, x)
    qr, kr, vr, xr = tokens(1, torch.float32)[0]
    with pytest.raises(ValueError, match="unknown decode attention backend 'bogus'"):
        cache.step(qr, kr, vr, xr)


@interpreted
@pytest.mark.parametrize("policy", ["full", "nats"])
def test_triton_backend_decodes_as_torch(policy):
    outs = []
    for backend in ("torch", "triton"):
        cache = layer(policy, 4, core=nats_core() if policy == "nats" else None, backend=backend)
        outs.append(decode(cache, n=6, steps=3, dtype=torch.float32)[1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
