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
from test_cache import nats_model, new_cache, onehot_probe, step_all, tiny

from conftest import REPO
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
from nats.cache.policies.nats import NAtSCache
from nats.cache.policies.snapkv import SnapKVCache
from nats.cache.registry import CACHE_POLICIES

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V = 61
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def count_maintain(monkeypatch) -> list[bool]:
    """Record every NAtSCache.maintain() result (True = the storage was reallocated)."""
    calls: list[bool] = []
    original = NAtSCache.maintain

    def maintain(self):
        changed = original(self)
        calls.append(changed)
        return changed

    monkeypatch.setattr(NAtSCache, "maintain", maintain)
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
        model(idx, caches=caches[:1])
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
    assert resolve_policy(NAtSCache) is NAtSCache and resolve_policy("nats") is NAtSCache


# ----------------------------------------------------------------------------------------------------
# planned capacity: no reallocation within the reserve; the overflow rule
# ----------------------------------------------------------------------------------------------------
def test_generate_nats_never_reallocates(monkeypatch):
    """generate plans the NAtS pool for max_new_tokens at the prefill: maintain() never reallocates, even with a
    compaction period that reallocates without a reserve; the tokens are those of the unplanned decode."""
    model = nats_model(window=2, block_size=96)
    torch.manual_seed(5)
    idx = torch.randint(0, V, (2, 20))
    new = 40
    calls = count_maintain(monkeypatch)
    out, caches = generate(model, idx, new, "nats", return_caches=True, check_every=2)
    assert len(calls) == (new - 1) * len(caches) and not any(calls)
    assert all(c.compactions == 0 for c in caches)
    assert all(c.reserve == new for c in caches)
    # the same greedy tokens by teacher forcing through caches without a reserve (periodic compaction)
    calls.clear()
    seq, plain = policy_logits(model, out[:, :-1], "nats", sequential=True, prefill_len=20, check_every=2)
    assert any(calls) and any(c.compactions for c in plain)  # without a reserve the same decode reallocates
    assert torch.equal(seq[:, 19:].argmax(-1), out[:, 20:])


def load_prompt(cache, k, v, types, P):
    """The state after the first P positions of the probe (k, v [R, N, D]) written by `load`."""
    B, H = cache.batch, cache.n_kv_head
    cache.load(k[:, :P].reshape(B, H, P, -1), v[:, :P].reshape(B, H, P, -1), types[..., :P])


def one_step(cache, q, k, v, types, i):
    """Step position i of the probe (q [R, 1, N, D], k and v [R, N, D]) with the given types."""
    B, H, D = cache.batch, cache.n_kv_head, q.shape[-1]
    return cache.step(
        q[:, :, i].reshape(B, H, 1, D),
        k[:, i].reshape(B, H, 1, D),
        v[:, i].reshape(B, H, 1, D),
        None,
        torch.tensor([i]),
        types=types[..., i],
    )


@pytest.mark.parametrize("reserve", [0, 3])
def test_nats_overflow_rule(reserve):
    """Beyond the reserve: maintain() reads the lengths once the guarantee runs out and compacts only when a row
    is full; the attention equals a cache without a reserve at every step."""
    torch.manual_seed(2)
    B, H, N, W = 2, 2, 24, 3
    P = 6
    types = torch.randint(0, 3, (B, H, N))
    types[..., 0] = 0
    types[0, 0, P:] = 1  # row 0 gets a local at every step: it fills its reserve first
    types[1, 1, P:] = 2  # row 3 only sliding tokens: never grows
    q, k, v = onehot_probe(B * H, N)
    ref_cache = new_cache(NAtSCache, B, H, N, window=W, check_every=4)
    ref = step_all(ref_cache, q, k, v, types=types)
    cache = new_cache(NAtSCache, B, H, N, window=W, check_every=4, reserve=reserve)
    load_prompt(cache, k, v, types, P)
    assert torch.equal(cache.cap - cache.length, torch.full((B * H,), reserve))
    changed = []
    cache.auto_maintain = False
    for i in range(P, N):
        changed.append(cache.maintain())
        y = one_step(cache, q, k, v, types, i)
        assert torch.allclose(y.reshape(B * H, N), ref[:, 0, i], atol=1e-12), i
    # row 0 adds a token per step: full after `reserve` steps, the step after that compacts (once: the new
    # layout leaves at least check_every free slots, and row 0 grows by one per step)
    assert not any(changed[:reserve]) and changed[reserve]
    assert cache.compactions == sum(changed) >= 1
    assert torch.equal(cache.kept(), ref_cache.kept())


def test_nats_reserve_with_room_left_never_compacts():
    """Only sliding tokens after the prompt: the reserve never fills, so there is nothing to reallocate even far
    beyond it (the guarantee is extended by the free slots read once)."""
    B, H, N, W, P = 1, 2, 30, 2, 4
    types = torch.full((B, H, N), 2)
    types[..., 0] = 0
    q, k, v = onehot_probe(B * H, N)
    cache = new_cache(NAtSCache, B, H, N, window=W, check_every=2, reserve=2)
    load_prompt(cache, k, v, types, P)
    for i in range(P, N):
        one_step(cache, q, k, v, types, i)
    assert cache.compactions == 0


def test_reserve_errors_and_snapkv_plan():
    with pytest.raises(ValueError, match="reserve"):
        new_cache(NAtSCache, 1, 1, 8, window=2, reserve=-1)
    model = tiny({"name": "dense"})
    idx = torch.randint(0, V, (1, 30))
    caches = make_caches(model, SnapKVCache, 1, 40, budget=12, window=4, reserve=2)
    prefill(model, caches, idx[:, :20])
    assert caches[0].capacity == 12 + 2
    with eval_mode(model):
        decode_step(model, caches, idx[:, 20], 20)
        decode_step(model, caches, idx[:, 21], 21)
        with pytest.raises(RuntimeError, match="reserve=2"):
            decode_step(model, caches, idx[:, 22], 22)


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
    got, caches = policy_logits(model, idx, policy, sequential=True, budget=24, info=info)
    want, eager = policy_logits(model, idx, policy, sequential=True, budget=24, graph=False)
    assert info == {"decode": "cuda_graph"}
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for a, b in zip(caches, eager, strict=True):
        fa, fb = a.fractions(), b.fractions()
        assert torch.allclose(fa["area"], fb["area"]) and torch.equal(fa["peak"], fb["peak"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["nats", "full", "streaming_llm", "h2o", "snapkv"])
def test_graph_generate_equals_eager_without_recapture(policy, monkeypatch):
    torch.manual_seed(0)
    model = nats_model(window=4, block_size=128).float().cuda()
    idx = torch.randint(0, V, (3, 40), device="cuda")
    budget = 24 if policy in ("streaming_llm", "h2o", "snapkv") else None
    # nats: a period that would reallocate without a reserve
    opts = {"nats": {"check_every": 2}, "snapkv": {"window": 4}}.get(policy, {})
    calls = count_maintain(monkeypatch)
    info = {}
    out, caches = generate(model, idx, 64, policy, budget=budget, return_caches=True, info=info, **opts)
    assert info == {"decode": "cuda_graph", "captures": 1}  # captured once, replayed for every later token
    assert not any(calls) and all(c.t == 40 + 63 for c in caches)
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
        caches = make_caches(model, "nats", 2, 80, reserve=reserve, check_every=2)
        eager = make_caches(model, "nats", 2, 80, reserve=reserve, check_every=2)
        prefill(model, caches, idx[:, :P])
        prefill(model, eager, idx[:, :P])
        dec = GraphDecoder(model, caches)
        with eval_mode(model):
            for i in range(P, 80):
                a = dec(idx[:, i], i)
                b = decode_step(model, eager, idx[:, i], i)
                assert torch.allclose(a, b, atol=1e-4, rtol=0), i
        assert (dec.captures > 1) == expect_recaptures
        assert caches[0].t == eager[0].t == 80


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
        assert r["ms_per_step"] > 0 and r["reallocations"] == 0 and r["compactions"] == 0
        if r["policy"] == "streaming_llm":  # the budget is NAtS' kept share of the prompt
            nats_row = next(x for x in rows if x["L"] == r["L"] and x["policy"] == "nats")
            assert abs(r["budget"] / r["L"] - nats_row["kept_share"]) < 0.1
    md = (tmp_path / "bench_decode.md").read_text()
    assert "vs streaming_llm" in md and "re-captures" in md
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
