"""The decode path of the GPT model kind: a decode step is the model's own forward with the layers' caches, the
caches are planned for the tokens `generate` decodes (no reallocation, hence no CUDA-graph re-capture, while
decoding), the overflow rule beyond the reserve, CUDA-graph decoding on CUDA by default (eager on the CPU), and
the benchmark's CPU smoke mode. GPU tests are marked `gpu`."""

from __future__ import annotations

import importlib.util
import inspect
import json

import pytest
import torch
from test_cache import nats_model, onehot_probe, tiny

from conftest import REPO
from nats import functional as NF
from nats.attention.nats import NAtSAttention
from nats.attention.registry import AttentionDims
from nats.cache import decode
from nats.cache.decode import (
    GraphDecoder,
    decode_step,
    eval_mode,
    generate,
    make_caches,
    policy_logits,
    prefill,
    resolve_policy,
)
from nats.cache.engine import GROW_STEPS, EngineLayer
from nats.cache.policies.nats import NAtSRule, TypeTable, kept_after_prompt
from nats.cache.policies.snapkv import SnapKVRule
from nats.cache.registry import CACHE_POLICIES
from nats.cache.rule import RuleContext

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V = 61
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def count_maintain(monkeypatch) -> list[bool]:
    """Record every EngineLayer.maintain() result (True = the layer's pool was reallocated)."""
    calls: list[bool] = []
    original = EngineLayer.maintain

    def maintain(self):
        changed = original(self)
        calls.append(changed)
        return changed

    monkeypatch.setattr(EngineLayer, "maintain", maintain)
    return calls


# ----------------------------------------------------------------------------------------------------
# one decode step = the model's forward with the caches
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "nats"])
def test_forward_with_caches_equals_parallel_forward(kind):
    model = tiny({"name": "dense"}) if kind == "dense" else nats_model()
    policy = "full" if kind == "dense" else "nats"
    torch.manual_seed(3)
    idx = torch.randint(0, V, (2, 40))
    P = 17
    with eval_mode(model):
        ref = model(idx).logits
        caches = make_caches(model, policy, 2, 40)
        out = [model(idx[:, :P], caches=caches).logits]
        pos = torch.tensor([P])
        for i in range(P, 40):  # an int position and a device tensor position
            step = model(idx[:, i : i + 1], caches=caches, pos=i if i % 2 else pos).logits
            assert step.shape == (2, 1, V)
            out.append(step)
            pos += 1
    assert torch.allclose(torch.cat(out, 1), ref, atol=1e-10, rtol=0)
    # the thin wrappers are this forward
    seq, _ = policy_logits(model, idx, policy, sequential=True, prefill_len=P)
    assert torch.equal(seq, torch.cat(out, 1))


@pytest.mark.parametrize("kind", ["dense", "nats"])
def test_compiled_decode_equals_eager_with_one_compile_for_every_layer(kind):
    """GPT.compiled_decode: the dense work around the caches traced as one graph per part (fullgraph), shared by
    every layer (no compile per block), the same logits as the eager step, the eager parts back after the block."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny({"name": "dense"}) if kind == "dense" else nats_model()
    policy = "full" if kind == "dense" else "nats"
    torch.manual_seed(3)
    idx = torch.randint(0, V, (2, 24))
    P = 12
    eager_parts = model.blocks[0].decode_parts
    with eval_mode(model):
        caches, compiled = make_caches(model, policy, 2, 24), make_caches(model, policy, 2, 24)
        model(idx[:, :P], caches=caches), model(idx[:, :P], caches=compiled)
        for i in range(P, 24):
            want = model(idx[:, i : i + 1], caches=caches, pos=i).logits
            with model.compiled_decode("aot_eager"):
                assert model.blocks[-1].decode_parts != eager_parts
                got = model(idx[:, i : i + 1], caches=compiled, pos=torch.tensor([i])).logits
            assert torch.allclose(got, want, atol=1e-5, rtol=0), i
    assert all(b.decode_parts == eager_parts for b in model.blocks)
    assert len(model.blocks) > 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_compiled_decode_parts_are_kept_by_backend_and_settings(monkeypatch):
    """GPT.compiled_decode(inductor=...): the parts are compiled once per backend and settings (over
    `DECODE_INDUCTOR`'s: the same settings, however given, share the parts; others get their own), the settings
    reach torch.compile (which checks them at once), the other backends take none; GraphDecoder passes its own."""
    from nats.models import gpt

    model = tiny({"name": "dense"})

    def parts(**kw):
        with model.compiled_decode(**kw):
            return model.blocks[0].decode_parts

    default = parts()
    assert parts(inductor={}) == default and parts(inductor=dict(gpt.DECODE_INDUCTOR)) == default
    combo = parts(inductor={"combo_kernels": True})
    assert all(a is not b for a, b in zip(combo, default)) and parts(inductor={"combo_kernels": True}) == combo
    assert parts(backend="aot_eager", inductor={"combo_kernels": True}) == parts(backend="aot_eager")
    with pytest.raises(RuntimeError, match="combo_kernels"):  # a str where inductor wants a bool
        parts(inductor={"combo_kernels": "yes"})
    assert model.blocks[0].decode_parts == (gpt.before_cache, gpt.after_cache)
    with pytest.raises(TypeError):
        gpt.DECODE_INDUCTOR["combo_kernels"] = True
    monkeypatch.setattr(decode, "graph_capturable", lambda caches: True)  # on the CPU: the step, not its graph
    dec = GraphDecoder(model, make_caches(model, "full", 2, 24), inductor={"combo_kernels": "yes"})
    with eval_mode(model), pytest.raises(RuntimeError, match="combo_kernels"):
        dec._step()


def test_decode_module_does_not_run_the_block_itself():
    """The block is written once (nats/models/gpt.py): the decode functions call the model's forward."""
    src = inspect.getsource(decode)
    for piece in ("ln_1", "ln_2", "mlp", "ln_f", "lm_head", "gate_and_project", ".project(", "embed("):
        assert piece not in src, piece


def test_forward_with_caches_errors():
    model = tiny({"name": "dense"})
    idx = torch.randint(0, V, (1, 4))
    caches = make_caches(model, "full", 1, 8)
    with pytest.raises(ValueError, match="pass the layers' caches"):
        model(idx, pos=3)
    with pytest.raises(ValueError, match="one cache per layer"):
        model(idx, caches=[caches[0]])
    with pytest.raises(ValueError, match="one token per sequence"):
        model(idx, caches=caches, pos=3)
    with pytest.raises(ValueError, match="without targets"):
        model(idx, idx, caches=caches)


def test_policy_name_resolved_once(monkeypatch):
    """generate turns the policy name into its class once and passes the class on."""
    import nats.cache.decode as d

    calls = []
    original = d.get_cache_class

    def spy(name):
        calls.append(name)
        return original(name)

    monkeypatch.setattr(d, "get_cache_class", spy)
    model = nats_model()
    idx = torch.randint(0, V, (1, 6))
    generate(model, idx, 3, "nats", return_caches=True)
    assert calls == ["nats"]
    assert resolve_policy(NAtSRule) is NAtSRule and resolve_policy("nats") is NAtSRule


# ----------------------------------------------------------------------------------------------------
# planned capacity: no reallocation within the reserve; the overflow rule
# ----------------------------------------------------------------------------------------------------
def test_generate_nats_never_reallocates(monkeypatch):
    """generate plans the NAtS pools for max_new_tokens at the prefill: no layer ever needs to check for room
    (maintain() is not called) or reallocates; the tokens are those of the unplanned decode, whose pools grow."""
    model = nats_model(window=2, block_size=96)
    torch.manual_seed(5)
    idx = torch.randint(0, V, (2, 20))
    new = 40
    calls = count_maintain(monkeypatch)
    out, cache = generate(model, idx, new, "nats", return_caches=True)
    assert calls == [] and cache.reallocations() == 0 and cache.reserve == new
    assert not cache.overflowed() and all(bool((lay.cap >= lay.length).all()) for lay in cache.layers)
    # the same greedy tokens by teacher forcing through a cache without a reserve (its pools grow)
    seq, plain = policy_logits(model, out[:, :-1], "nats", sequential=True, prefill_len=20)
    assert any(calls) and plain.reallocations() == sum(calls) > 0  # without a reserve the same decode reallocates
    assert torch.equal(seq[:, 19:].argmax(-1), out[:, 20:])


C = 8  # the block input of the NAtS layers driven directly (their scorer's input)


def nats_layer(B, H, N, window, reserve, types):
    """One NAtS layer of the engine driven directly (float64, H KV heads of one query head, head dim N: the
    probe's), its types given for every position by a TypeTable (types [B, H, N]), a random scorer beside them."""
    torch.manual_seed(0)
    dims = AttentionDims(n_embd=C, n_head=H, n_kv_head=H, head_dim=N, block_size=256, layer_idx=0, n_layer=1)
    core = NAtSAttention(dims, window=window, backend="reference").double().eval()
    table = TypeTable(types.permute(2, 0, 1).reshape(N, B * H), 0)
    rule = NAtSRule.rule(type_table=table)
    return EngineLayer(rule, RuleContext(0, 1, reserve, True, "torch", "torch"), core)


def load_prompt(layer, q, k, v, x, P):
    """The prefill of the first P positions of the probe (q [R, 1, N, D], k and v [R, N, D], x [B, N, C])."""
    B = x.shape[0]
    R, _, N, D = q.shape
    H = R // B
    y = layer.prefill(q[:, 0, :P].reshape(B, H, P, D), k[:, :P].reshape(B, H, P, D), v[:, :P].reshape(B, H, P, D),
                      x[:, :P])  # fmt: skip
    return y.reshape(R, P, D)


def one_step(layer, q, k, v, x, i):
    """Step position i of the probe: the layer's eager step (growth first, `EngineLayer.maintain`) -> [R, D]."""
    return layer.step(q[:, :, i], k[:, i], v[:, i], x[:, i])[:, 0]


def nats_reference(q, k, v, types, window):
    """The NAtS attention of the given types over the whole probe (spec section 2) [R, N, D], and what a cache
    holds after it: every global, the live locals, the sliding tokens of the last W - 1 positions [R]."""
    R, _, N, D = q.shape
    t = types.reshape(R, N)
    y = NF.nats_attention_types(q[:, :1].transpose(0, 1), k[None], v[None], t[None], window, backend="reference")
    keep, _ = kept_after_prompt(t)
    ring = (t == NF.TOKEN_SLIDING) & (torch.arange(N) > N - window)
    return y[0], keep.sum(1) + ring.sum(1)


@pytest.mark.parametrize("reserve", [0, 3])
def test_nats_overflow_rule(reserve):
    """Beyond the reserve: maintain() trusts its host count of free steps, reads the lengths once it runs out and
    grows the pool only when a row is full; the attention equals the NAtS attention of the types at every step and
    the tokens held are those the types keep."""
    torch.manual_seed(2)
    B, H, N, W = 2, 2, 24, 3
    P = 6
    types = torch.randint(0, 3, (B, H, N))
    types[..., 0] = 0
    types[0, 0, P:] = 1  # row 0 gets a local at every step: it fills its reserve first
    types[1, 1, P:] = 2  # row 3 only sliding tokens: never grows
    q, k, v = onehot_probe(B * H, N)
    x = torch.randn(B, N, C, dtype=torch.float64)
    ref, kept = nats_reference(q, k, v, types, W)
    layer = nats_layer(B, H, N, W, reserve, types)
    assert torch.allclose(load_prompt(layer, q, k, v, x, P), ref[:, :P], atol=1e-12)
    assert torch.equal(layer.cap - layer.length, torch.full((B * H,), reserve)) and layer.free_steps == reserve
    changed = []
    for i in range(P, N):
        before = layer.reallocations
        y = one_step(layer, q, k, v, x, i)
        changed.append(layer.reallocations > before)
        assert torch.allclose(y, ref[:, i], atol=1e-12), i
    # row 0 adds a token per step: full after `reserve` steps, the step after that grows the pool (by at least
    # GROW_STEPS free slots a row, so the next growth comes GROW_STEPS steps later)
    assert not any(changed[:reserve]) and changed[reserve]
    assert [i for i, c in enumerate(changed) if c] == list(range(reserve, N - P, GROW_STEPS))
    assert layer.reallocations == sum(changed) >= 1
    assert torch.equal(layer.kept(), kept)
    assert int(layer.n_global[1 * H + 1]) == int((types[1, 1] == 0).sum())  # the sliding row kept its globals


def test_nats_reserve_with_room_left_never_grows():
    """Only sliding tokens after the prompt: the reserve never fills, so there is nothing to reallocate even far
    beyond it (the guarantee is extended by the free slots read once)."""
    B, H, N, W, P = 1, 2, 30, 2, 4
    types = torch.full((B, H, N), 2)
    types[..., 0] = 0
    q, k, v = onehot_probe(B * H, N)
    x = torch.randn(B, N, C, dtype=torch.float64)
    ref, kept = nats_reference(q, k, v, types, W)
    layer = nats_layer(B, H, N, W, 2, types)
    load_prompt(layer, q, k, v, x, P)
    pool = layer.kv_pool
    for i in range(P, N):
        assert torch.allclose(one_step(layer, q, k, v, x, i), ref[:, i], atol=1e-12), i
    assert layer.reallocations == 0 and layer.kv_pool is pool
    assert torch.equal(layer.length, torch.ones(B * H, dtype=torch.long)) and torch.equal(layer.kept(), kept)


def test_reserve_errors_and_snapkv_plan():
    model = tiny({"name": "dense"})
    with pytest.raises(ValueError, match="reserve"):
        make_caches(model, "full", 1, 8, reserve=-1)
    idx = torch.randint(0, V, (1, 30))
    cache = make_caches(model, SnapKVRule, 1, 40, budget=12, window=4, reserve=2)
    prefill(model, cache, idx[:, :20])
    for layer in cache.layers:  # the budget's tokens + the reserve, per row
        assert layer.cap.tolist() == [12 + 2] * 2 and layer.length.tolist() == [12] * 2
    with eval_mode(model):
        decode_step(model, cache, idx[:, 20], 20)
        decode_step(model, cache, idx[:, 21], 21)
        assert not cache.overflowed() and cache.kept().flatten().tolist() == [14] * 6
        # past the reserve the capacity binds (no reallocation): the rows stop admitting, the cache says so
        decode_step(model, cache, idx[:, 22], 22)
    assert cache.overflowed() and cache.kept().flatten().tolist() == [14] * 6 and cache.reallocations() == 0


# ----------------------------------------------------------------------------------------------------
# CUDA graphs: the default on CUDA, eager on the CPU
# ----------------------------------------------------------------------------------------------------
def test_generate_defaults_to_eager_on_cpu():
    model = nats_model()
    idx = torch.randint(0, V, (1, 6))
    info = {}
    out, _ = generate(model, idx, 4, "nats", return_caches=True, info=info)
    assert info == {"decode": "eager"} and out.shape == (1, 10)
    with pytest.raises(ValueError, match="CUDA-graph decoding needs"):
        generate(model, idx, 4, "nats", return_caches=True, graph=True)
    with pytest.raises(ValueError, match="graph='yes' must be auto, true or false"):
        generate(model, idx, 4, "nats", return_caches=True, graph="yes")


def test_sequential_policy_logits_decode_eagerly_on_cpu():
    """The evaluation's token-by-token loop (`policy_logits(sequential=True)`) says how it decoded; on the CPU it
    decodes eagerly (graph=auto), refuses graph=True with the reason, and checks the setting."""
    model = tiny({"name": "dense"})
    idx = torch.randint(0, V, (2, 12))
    info = {}
    seq, _ = policy_logits(model, idx, "h2o", sequential=True, budget=6, info=info)
    assert info == {"decode": "eager"}
    assert torch.equal(seq, policy_logits(model, idx, "h2o", sequential=True, budget=6, graph=False)[0])
    with pytest.raises(ValueError, match="CUDA-graph decoding needs"):
        policy_logits(model, idx, "h2o", sequential=True, budget=6, graph=True)
    with pytest.raises(ValueError, match="graph='yes' must be auto, true or false"):
        policy_logits(model, idx, "h2o", sequential=True, budget=6, graph="yes")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["h2o", "streaming_llm"])
def test_sequential_policy_logits_graph_equals_eager(policy):
    """nats-eval's token-by-token methods on CUDA replay one captured graph per batch (graph=auto): the logits and
    the caches' KV measurements equal eager decoding's."""
    torch.manual_seed(0)
    model = tiny({"name": "dense"}, block_size=96).float().cuda()
    idx = torch.randint(0, V, (3, 96), device="cuda")
    info = {}
    got, cache = policy_logits(model, idx, policy, sequential=True, budget=24, info=info)
    want, eager = policy_logits(model, idx, policy, sequential=True, budget=24, graph=False)
    assert info == {"decode": "cuda_graph"}
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    fa, fb = cache.fractions(), eager.fractions()
    assert torch.allclose(fa["area"], fb["area"]) and torch.equal(fa["peak"], fb["peak"])
    assert torch.equal(cache.kept(), eager.kept()) and cache.t == eager.t == 96


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["nats", "full", "streaming_llm", "h2o", "snapkv"])
def test_graph_generate_equals_eager_without_recapture(policy, monkeypatch):
    torch.manual_seed(0)
    model = nats_model(window=4, block_size=128).float().cuda()
    idx = torch.randint(0, V, (3, 40), device="cuda")
    budget = 24 if policy in ("streaming_llm", "h2o", "snapkv") else None
    opts = {"snapkv": {"window": 4}}.get(policy, {})
    calls = count_maintain(monkeypatch)
    info = {}
    out, cache = generate(model, idx, 64, policy, budget=budget, return_caches=True, info=info, **opts)
    assert info == {"decode": "cuda_graph", "captures": 1}  # captured once, replayed for every later token
    assert calls and not any(calls) and cache.t == 40 + 63 and cache.reallocations() == 0
    eager, _ = generate(model, idx, 64, policy, budget=budget, return_caches=True, graph=False, **opts)
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_graph_decoder_replays_equal_eager_and_recapture_on_overflow():
    torch.manual_seed(0)
    model = nats_model(window=4, block_size=128).float().cuda()
    idx = torch.randint(0, V, (2, 80), device="cuda")
    P = 16
    for reserve, expect_recaptures in ((80 - P, False), (2, True)):
        # the graph's cache grows past a short reserve between replays; the eager one grows as it decodes
        cache = make_caches(model, "nats", 2, 80, reserve=reserve)
        eager = make_caches(model, "nats", 2, 80)
        prefill(model, cache, idx[:, :P])
        prefill(model, eager, idx[:, :P])
        dec = GraphDecoder(model, cache)
        with eval_mode(model):
            for i in range(P, 80):
                a = dec(idx[:, i], i)
                b = decode_step(model, eager, idx[:, i], i)
                assert torch.allclose(a, b, atol=1e-4, rtol=0), i
        assert (dec.captures > 1) == expect_recaptures == (cache.reallocations() > 0)
        assert cache.t == eager.t == 80
        assert torch.equal(cache.kept(), eager.kept())


# ----------------------------------------------------------------------------------------------------
# the benchmark's smoke mode
# ----------------------------------------------------------------------------------------------------
def test_bench_decode_smoke(tmp_path):
    """The CPU smoke run; the script's own baseline (`full_sdpa`) stays out of the library's cache registry, on
    import and when it runs."""
    from nats.cache.registry import CACHES

    CACHES.import_all()
    before = dict(CACHE_POLICIES)
    spec = importlib.util.spec_from_file_location("bench_decode_smoke", REPO / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert CACHE_POLICIES == before and "full_sdpa" not in CACHE_POLICIES
    rows = bench.main(["--smoke", "--out", str(tmp_path)])
    sdpa = bench.main(["--smoke", "--policies", "full_sdpa", "--out", str(tmp_path / "sdpa")])
    assert {(r["policy"], r["kept_share"]) for r in sdpa} == {("full (sdpa)", 1.0)} and len(sdpa) == 2
    assert CACHE_POLICIES == before and "full_sdpa" not in CACHE_POLICIES
    got = {(r["L"], r["policy"]) for r in rows}
    assert got == {(L, p) for L in (48, 64) for p in ("full", "nats", "streaming_llm")}
    for r in rows:
        assert r["ms_per_step"] > 0 and r["reallocations"] == 0 and "compactions" not in r
        if r["policy"] == "streaming_llm":  # the budget is NAtS' kept share of the prompt
            nats_row = next(x for x in rows if x["L"] == r["L"] and x["policy"] == "nats")
            assert abs(r["budget"] / r["L"] - nats_row["kept_share"]) < 0.1
    md = (tmp_path / "bench_decode.md").read_text()
    assert "vs streaming_llm" in md and "re-captures" in md and "| reallocations |" in md
    assert "bytes' bound" in md and "GB/s measured" in md
    for r in rows:  # against the bandwidth limit: a full cache reads the most, the others less
        assert r["step_gb"] > 0 and r["achieved_gbps"] > 0 and r["share_of_measured"] > 0
        assert (r["bound_vs_full"] == 1.0) == (r["policy"] == "full") and r["bound_vs_full"] <= 1.0


def test_bench_decode_profiles_each_row_and_takes_inductor_settings(tmp_path):
    """--profile writes each row's kernel table over the steps after the timed ones (the caches reserve them: no
    reallocation); --inductor gives the compiled decode parts' settings (over the defaults, which stay as they are),
    and a key inductor lacks is one clear line."""
    from nats.models import gpt

    spec = importlib.util.spec_from_file_location("bench_decode_profile", REPO / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--smoke", "--lengths", "48", "--policies", "full,nats", "--profile", "--out", str(tmp_path)]
    rows = bench.main([*args, "--inductor", "combo_kernels=True"])
    assert gpt.DECODE_INDUCTOR == {"emulate_precision_casts": True}
    assert {r["policy"] for r in rows} == {"full", "nats"}
    for r in rows:
        assert r["reallocations"] == 0 and r["profile"] is None  # eager rows: no replayed graph to split
        text = (tmp_path / f"profile_{r['policy']}_eager_L48.txt").read_text()
        assert f"{bench.PROFILE_STEPS} decode steps" in text and "Self CPU" in text
    meta = json.loads((tmp_path / "bench_decode.json").read_text())["meta"]
    assert meta["inductor"] == {"emulate_precision_casts": True, "combo_kernels": True}
    with pytest.raises(SystemExit, match="has no setting 'no_such_setting'"):
        bench.main([*args, "--inductor", "no_such_setting=1"])
