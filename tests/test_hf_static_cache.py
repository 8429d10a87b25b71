"""nats.hf.StaticPolicyCache: fixed-capacity buffers that ``generate`` compiles (one graph, no recompiles), whose
decoding equals the eager path, the same cache made for an unknown number of new tokens (``max_new_tokens=None``:
eager, growing steps) and (NAtS) the parallel forward; left-padded batches equal
each prompt alone; misuse is refused with a message. The GPU test runs the Triton kernels and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402

import nats_kernels  # noqa: E402
from nats.hf import StaticPolicyCache, attach_nats, use_policy_caches  # noqa: E402
from nats.hf.compat import cache_kwargs  # noqa: E402

PROMPT, NEW = 40, 12


def greedy(model, prompt, cache, mask=None, n=NEW, compile_config=None, **kw):
    with torch.no_grad():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt) if mask is None else mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=kw.pop("do_sample", False),
            compile_config=compile_config,
            disable_compile=compile_config is None,
            **kw,
            **cache_kwargs(model, cache),
        )


# Triton kernels on CPU tensors run only in Triton's interpreter, which the package chooses where there is no GPU
interpreted = pytest.mark.skipif(not nats_kernels.INTERPRET, reason="Triton on CPU tensors needs its interpreter")


def nats_model(arch="llama"):
    return attach_nats(tiny_model(arch), window=4, init_std=0.5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_nats_equals_growing_cache_and_parallel_forward(arch):
    model = nats_model(arch)
    prompt = ids(n=PROMPT, b=2)
    cache = StaticPolicyCache(model, "nats", max_new_tokens=NEW, max_len=PROMPT + NEW)
    out = greedy(model, prompt, cache)
    growing = StaticPolicyCache(model, "nats", max_new_tokens=None, max_len=PROMPT + NEW, backend="torch")
    ref = greedy(model, prompt, growing)
    assert torch.equal(out, ref)
    with torch.no_grad():
        full = model(out).logits
    assert torch.equal(full[:, PROMPT - 1 : -1].argmax(-1), out[:, PROMPT:])
    kept = cache.kept()
    assert kept.shape == (2, 2, 2) and int(kept.max()) < PROMPT + NEW - 1  # it evicted
    area = cache.fractions()["area"]
    assert bool(((area > 0) & (area < 1)).all())


@pytest.mark.parametrize(
    "policy,kw",
    [("full", {}), ("streaming_llm", {"budget": 16}), ("snapkv", {"budget": 20, "window": 4}),
     ("pyramidkv", {"budget": 20, "window": 4})],
)  # fmt: skip
def test_baselines_equal_growing_cache(policy, kw):
    model = use_policy_caches(tiny_model("llama"))
    prompt = ids(n=PROMPT, b=2)
    growing = StaticPolicyCache(model, policy, max_new_tokens=None, max_len=PROMPT + NEW, backend="torch", **kw)
    ref = greedy(model, prompt, growing)
    cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, max_len=PROMPT + NEW, **kw)
    assert torch.equal(greedy(model, prompt, cache), ref)
    if policy == "streaming_llm":
        assert int(cache.kept().max()) == 16


@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("policy,kw", [("nats", {}), ("full", {}), ("streaming_llm", {"budget": 12})])
def test_left_padded_batch_equals_each_prompt_alone(policy, kw, track):
    model = nats_model()
    p1, p2 = ids(n=26, b=1, seed=3), ids(n=40, b=1, seed=4)
    kw = {**kw, "track": track}  # without tracking the cache sizes are never computed
    alone = [greedy(model, p, StaticPolicyCache(model, policy, max_new_tokens=NEW, max_len=64, **kw)) for p in (p1, p2)]
    pad = torch.zeros(1, 14, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, p1], 1), p2])
    mask = torch.cat([torch.cat([pad, torch.ones_like(p1)], 1), torch.ones_like(p2)])
    cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, max_len=64, **kw)
    out = greedy(model, batch, cache, mask=mask)
    assert torch.equal(out[0, 40:], alone[0][0, 26:]) and torch.equal(out[1, 40:], alone[1][0, 40:])
    kept = cache.kept()[:, 0]  # the padded row keeps none of its padding
    assert int(kept.max()) <= 26 + NEW - 1


def test_left_padded_h2o_rows_take_the_batch_largest_budget():
    # a fraction budget resolves per sequence (13 and 20 tokens here); H2O's rows share one width, the largest
    model = nats_model()
    p1, p2 = ids(n=26, b=1, seed=3), ids(n=40, b=1, seed=4)
    alone = [
        greedy(model, p, StaticPolicyCache(model, "h2o", budget=20, max_new_tokens=NEW, max_len=64)) for p in (p1, p2)
    ]
    pad = torch.zeros(1, 14, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, p1], 1), p2])
    mask = torch.cat([torch.cat([pad, torch.ones_like(p1)], 1), torch.ones_like(p2)])
    out = greedy(model, batch, StaticPolicyCache(model, "h2o", budget=0.5, max_new_tokens=NEW, max_len=64), mask=mask)
    assert torch.equal(out[0, 40:], alone[0][0, 26:]) and torch.equal(out[1, 40:], alone[1][0, 40:])


def test_sampled_decoding_runs_and_right_padding_is_refused():
    model = nats_model()
    prompt = ids(n=PROMPT, b=2)
    torch.manual_seed(0)
    out = greedy(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=NEW), do_sample=True, top_k=5)
    assert out.shape == (2, PROMPT + NEW)
    mask = torch.ones_like(prompt)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left-padded"):
        greedy(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=NEW), mask=mask)


def test_compiled_decoding_one_graph_no_recompiles_equals_eager():
    from torch._dynamo.utils import counters

    model = nats_model()
    cc = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # generate compiles on CUDA only otherwise
    prompt = ids(n=PROMPT, b=2)
    eager = greedy(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=NEW))
    torch._dynamo.reset()
    counters.clear()
    out = greedy(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=NEW), compile_config=cc)
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1
    for seed, n in ((5, PROMPT), (6, 33)):  # a new cache, another prompt: the same graph
        greedy(model, ids(n=n, b=2, seed=seed), StaticPolicyCache(model, "nats", max_new_tokens=NEW), compile_config=cc)
    assert counters["stats"]["unique_graphs"] == 1


def test_new_pool_sizes_and_prompt_lengths_compile_a_few_graphs_not_one_per_prompt():
    """Across generate calls the graph is reused: a new pool size (prompts keeping different numbers of tokens)
    and a new prompt length each compile once more, after which dynamo treats those sizes as dynamic; prompts
    after that compile nothing. Each compiled call equals eager decoding."""
    from torch._dynamo.utils import counters

    model = nats_model()
    model.config.max_position_embeddings = 1024  # prompts of up to 700 tokens: past the tiny model's 256 on purpose
    cc = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    pools, graphs = set(), []
    for seed, n in ((11, 200), (12, 200), (14, 300), (13, 200), (15, 150), (16, 700)):
        prompt = ids(n=n, b=3, seed=seed)
        cache = StaticPolicyCache(model, "nats", max_new_tokens=24)
        got = greedy(model, prompt, cache, n=24, compile_config=cc)
        assert torch.equal(got, decode_24(model, "nats", {}, prompt)), (seed, n)
        pools.add(cache.layers[0].k_pool.shape[0])
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(pools) >= 3  # the prompts did make pools of different sizes
    assert graphs[-1] <= 3 and graphs[-3:] == [graphs[-1]] * 3, graphs


def test_prefill_reads_a_layers_pool_size_after_queuing_the_next_layer(monkeypatch):
    """The prefill does not wait for a layer's pool size before the next layer's work is queued (a blocking read
    per layer idles the GPU at every layer): layer l's pool is allocated during layer l + 1's prefill, the rest at
    the last layer; the decoding that follows is unchanged (the other tests)."""
    from nats.cache.engine import PoolLayout  # the engine's prefill (nats.cache.engine_cache) plans with it

    order = []
    real_init, real_size = PoolLayout.__init__, PoolLayout.size

    def init(self, *args):
        real_init(self, *args)
        self.n = sum(1 for o in order if o[0] == "plan")
        order.append(("plan", self.n))

    def size(self):
        order.append(("size", self.n))
        return real_size(self)

    monkeypatch.setattr(PoolLayout, "__init__", init)
    monkeypatch.setattr(PoolLayout, "size", size)
    model = nats_model()
    cache = StaticPolicyCache(model, "nats", max_new_tokens=NEW)
    greedy(model, ids(n=PROMPT, b=2), cache)
    assert model.config.num_hidden_layers == 2
    assert order == [("plan", 0), ("plan", 1), ("size", 0), ("size", 1)]
    assert all(layer.ready for layer in cache.layers)


def test_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="use_policy_caches"):
        StaticPolicyCache(model, "full", max_new_tokens=4)
    model = use_policy_caches(model)
    with pytest.raises(ValueError, match="needs the model.s nats attention in every layer .*nats.hf.attach_nats"):
        StaticPolicyCache(model, "nats", max_new_tokens=4)
    with pytest.raises(ValueError, match="is a parallel approximation and cannot decode"):
        StaticPolicyCache(model, "h2o_dense", max_new_tokens=4, budget=8)
    with pytest.raises(ValueError, match="needs a budget"):
        StaticPolicyCache(model, "streaming_llm", max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        StaticPolicyCache(model, "full", max_new_tokens=0)
    with pytest.raises(NotImplementedError, match="beam search"):
        greedy(model, ids(n=8, b=1), StaticPolicyCache(model, "full", max_new_tokens=4), n=4, num_beams=2)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two generated batches first differ (row, position), for an assertion's message."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    rows, cols = (a != b).nonzero(as_tuple=True)
    return "equal" if rows.numel() == 0 else f"row {int(rows[0])}, position {int(cols[0])} of {a.shape[1]}"


def decode_24(model, policy: str, kw: dict, prompt, compile_config=None):
    """24 greedy tokens through a new StaticPolicyCache (compiled where a compile_config is given)."""
    cache = StaticPolicyCache(model, policy, max_new_tokens=24, **kw)
    return greedy(model, prompt, cache, n=24, compile_config=compile_config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_cuda_graph_decoding_equals_eager():
    """The Triton kernels under generate's own compilation (reduce-overhead: CUDA graphs) on a GPU: compiled once
    (twice where the prompts' pools differ in size), really CUDA-graphed (no inductor skip), token for token the
    eager decoding. Each compiled call gets a new
    cache and, in turn, another prompt: a graph replaying buffers of an earlier cache would repeat that prompt's
    tokens. In float32: in bf16 inductor's fused kernels round differently from eager's op by op, and a random
    model's near-tied logits then flip an argmax now and then, so exact equality is a float32 property."""
    from torch._dynamo.utils import counters

    model = nats_model().cuda()
    prompts = [ids(n=200, b=3, seed=s).cuda() for s in (11, 12)]
    for policy, kw in (("nats", {}), ("full", {}), ("streaming_llm", {"budget": 64})):
        if policy != "nats":
            model = use_policy_caches(model)

        eager = [decode_24(model, policy, kw, p) for p in prompts]
        assert not torch.equal(eager[0][:, 200:], eager[1][:, 200:]), "the two prompts must decode differently"
        torch._dynamo.reset()
        counters.clear()
        cc = transformers.CompileConfig()  # generate's default: reduce-overhead
        for i in (0, 1, 0):
            got = decode_24(model, policy, kw, prompts[i], cc)
            assert torch.equal(got, eager[i]), (
                f"{policy}, prompt {i}: compiled differs from eager at {first_difference(got, eager[i])}"
            )
        # one graph, or two where the second prompt's pool has another size (then dynamic: see the CPU test above)
        assert counters["stats"]["unique_graphs"] <= 2, (policy, dict(counters["stats"]))
        assert counters["inductor"]["cudagraph_skips"] == 0, f"{policy}: inductor did not CUDA-graph the decode step"


def test_the_compiled_step_takes_few_tensors_per_layer_from_the_cache():
    """Every tensor the compiled decode step reads is an input of its graph, which dynamo guards before each call:
    host time at every step, where a batch-1 step is bound by the host. The NAtS cache packs its buffers (keys and
    values in one pool, the rows' bookkeeping in one integer tensor, the ring in one) and its layers share one
    position counter, so without `track` its step takes three inputs per layer more than transformers' StaticCache's
    (ring, ring validity, bookkeeping, the scorer, less one for keys and values in one pool and one for the counter)
    instead of ten."""
    inputs = {}

    def counting(name):
        def backend(gm, example_inputs):
            inputs[name] = len(example_inputs)
            return gm.forward

        return backend

    plain, model = tiny_model("llama"), nats_model()
    prompt = ids(n=PROMPT, b=2)
    for name, m, cache in (
        ("static", plain, transformers.StaticCache(config=plain.config, max_cache_len=PROMPT + NEW)),
        ("nats", model, StaticPolicyCache(model, "nats", max_new_tokens=NEW, track=False)),
    ):
        cc = transformers.CompileConfig(fullgraph=True, backend=counting(name), mode=None)
        cc._compile_all_devices = True
        torch._dynamo.reset()
        greedy(m, prompt, cache, compile_config=cc)
    per_layer = (inputs["nats"] - inputs["static"]) / model.config.num_hidden_layers
    assert 0 < per_layer <= 3.0, inputs  # 3.5 with a position counter per layer (StaticCache's: one per layer)


def test_inductor_compiled_step_equals_eager_with_several_rows():
    """The decode step compiled by inductor (on the CPU, no CUDA graphs): state and tokens equal the eager step's
    for a batch of several sequences, in the graph compiled with dynamic sizes (after a batch of one). The custom
    op takes the packed buffers whole: given several views of one buffer to mutate, inductor's copies of the
    mutated arguments overwrote each other's writes, and the cache lost its state after the first steps
    (aot_eager, the other tests' backend, does not show it)."""
    model = nats_model()
    cc = transformers.CompileConfig(mode=None)  # inductor
    cc._compile_all_devices = True
    torch._dynamo.reset()
    decode_24(model, "nats", {}, ids(n=200, b=1, seed=10), cc)  # then the step is recompiled with dynamic sizes
    prompt = ids(n=200, b=3, seed=11)
    caches = [StaticPolicyCache(model, "nats", max_new_tokens=24) for _ in range(2)]
    eager = greedy(model, prompt, caches[0], n=24)
    got = greedy(model, prompt, caches[1], n=24, compile_config=cc)
    assert torch.equal(got, eager), first_difference(got, eager)
    assert torch.equal(caches[1].kept(), caches[0].kept())
    assert torch.equal(caches[1].fractions()["area"], caches[0].fractions()["area"])


@pytest.mark.parametrize(
    "policy,kw", [("full", {}), ("streaming_llm", {"budget": 64}), ("nats", {}), ("h2o", {"budget": 300})]
)
def test_the_compiled_step_does_no_work_that_grows_with_the_pool(policy, kw):
    """The decode step compiled by inductor (on the CPU: C++ kernels) has no loop over the pool: its only work that
    grows with the cache is the attention's read of the kept keys and values (the custom op). Appending the new
    key and value through the pool's key and value views made inductor copy the whole pool back at every layer
    and step (on an H100/H200 two copies of the cache per token: the full cache at ~22% of the memory
    bandwidth at 8B / 32k)."""
    import re

    from torch._inductor.utils import run_and_get_code

    model = nats_model() if policy == "nats" else use_policy_caches(tiny_model("llama"))
    model.config.max_position_embeddings = 1024  # a prompt of 700 tokens: past the tiny model's 256 on purpose
    cc = transformers.CompileConfig(fullgraph=True, mode=None)  # inductor
    cc._compile_all_devices = True
    torch._dynamo.reset()
    cache = StaticPolicyCache(model, policy, max_new_tokens=8, **kw)
    _, code = run_and_get_code(greedy, model, ids(n=700, b=1, seed=12), cache, n=8, compile_config=cc)
    pool, D = cache.layers[0].kv_pool.shape[1:]
    bounds = [int(b) for src in code for b in re.findall(r"x\d+ < static_cast<int64_t>\((\d+)L?\)", src)]
    assert bounds, "no C++ kernel found in the compiled step (inductor's CPU code changed form?)"
    assert max(bounds) < pool, (policy, pool * D, sorted(set(bounds))[-5:])


@pytest.mark.parametrize(
    "n,pads,device",
    [pytest.param(37, (0, 0), "cpu", marks=interpreted), pytest.param(37, (0, 9), "cpu", marks=interpreted),
     pytest.param(5, (0, 2), "cpu", marks=interpreted),
     pytest.param(3000, (0, 700), "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                     reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_triton_prefill_writes_equal_the_torch_ones(n, pads, device):
    """`prefill_cache.prefill_rows` / `prefill_pool` (NAtS' prefill writes fused into two kernels) against the
    PyTorch reference `nats_rows` / `pool_fill`: the rows' bookkeeping, the pool's size, the ring and the pool,
    for left-padded rows (types -1), keys and values in the transposed layout transformers makes, and a prompt
    shorter than the window. On the CPU through Triton's interpreter; on a GPU at 3,000 tokens in bf16."""
    from nats.cache.engine import pool_fill
    from nats.cache.policies.nats import nats_rows
    from nats_kernels.nats_attention.prefill_cache import prefill_pool, prefill_rows

    torch.manual_seed(n + sum(pads))
    B, H, D, W, new = 2, 3, 16, 8, 5
    types = torch.randint(0, 3, (B, H, n))
    types[..., 0] = 0
    for b, p in enumerate(pads):
        types[b, :, :p] = -1
        types[b, :, p] = 0  # a row's first real token is global
    k = torch.randn(B, n, H, D).transpose(1, 2)  # [B, H, n, D], not contiguous
    v = torch.randn(B, n, H, D).transpose(1, 2)
    if device == "cuda":  # bf16, as generate's prefill
        types, k, v = types.cuda(), k.cuda().bfloat16(), v.cuda().bfloat16()
    keep, rank, rows, end, ring, ring_valid = nats_rows(types, k, v, W, new)
    size = int(end) + 3
    pool = pool_fill(keep, rank, rows, k, v, size)
    t_rows, t_end, t_ring, t_valid, last_g = prefill_rows(types, k, v, W, new)
    t_pool = prefill_pool(types, k, v, t_rows, last_g, size)
    assert torch.equal(t_end, end)
    assert torch.equal(t_rows, rows)  # the starts, written by prefill_pool, included
    assert torch.equal(t_valid, ring_valid) and torch.equal(t_ring, ring)
    assert not ring_valid[:, n % W].any()  # the first step's ring slot is closed: its decode attention skips it
    assert torch.equal(t_pool[:, :-1], pool[:, :-1])  # the last slot takes the reference's skipped writes
    assert int(rows[1].min()) < n  # something was dropped


@pytest.mark.parametrize(
    "n,D,device",
    [pytest.param(37, 16, "cpu", marks=interpreted),
     pytest.param(3000, 64, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_prefill_kernels_equal_the_kernels_one_by_one(n, D, device):
    """`prefill_cache.PrefillKernels` (a prefill's layers through one object, launched directly after the first
    layer on a GPU) gives, layer after layer, what `nats_prefill_scored`, `prefill_rows` and `prefill_pool` give;
    tensors it cannot take as they are (unaligned, keys and values strided differently) get None (the cache then
    calls those functions)."""
    from nats_kernels.nats_attention import nats_prefill_scored
    from nats_kernels.nats_attention.prefill_cache import prefill_kernels, prefill_pool, prefill_rows

    B, Hq, H, W, new = 2, 6, 3, 8, 5
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(n)

    def layer():  # transformers' layouts: q, k, v [B, N, H, D] transposed, the scorer's logits a view of [B, N, 3H]
        q, k, v = (torch.randn(B, n, h, D, generator=g).to(device, dt).transpose(1, 2) for h in (Hq, H, H))
        logits = (torch.randn(B, n, 3 * H, generator=g) * 2).to(device, dt).view(B, n, H, 3).transpose(1, 2)
        return q, k, v, logits

    bias = torch.tensor([0.0, 0.5, 1.0], device=device, dtype=dt)
    first = None
    for _ in range(3):
        q, k, v, logits = layer()
        kernels = prefill_kernels(q, k, v, logits, bias, W, new)
        first = first or kernels
        assert kernels is first  # one object for the layers of a kind
        o, types, rows, end, ring, valid, last_g = kernels.attend(q, k, v, logits, bias)
        size = int(end) + 3
        pool = kernels.pool(types, k, v, rows, last_g, size)
        o_ref, t_ref = nats_prefill_scored(q, k, v, logits, bias, W)
        rows_ref, end_ref, ring_ref, valid_ref, last_ref = prefill_rows(t_ref, k, v, W, new)
        pool_ref = prefill_pool(t_ref, k, v, rows_ref, last_ref, size)
        assert torch.equal(o, o_ref) and torch.equal(types, t_ref)
        for a, b in ((rows, rows_ref), (end, end_ref), (ring, ring_ref), (valid, valid_ref), (last_g, last_ref)):
            assert torch.equal(a, b)
        assert torch.equal(pool, pool_ref)
        assert int(types.eq(0).sum()) > B * H and int(types.eq(2).sum()) > 0  # all three types occur
    if device == "cuda":  # the later layers were launched directly
        assert all(b._kernel is not None for b in (first._plan, first._fwd, first._rows, first._pool))
    odd = torch.empty(q.numel() + 1, device=device, dtype=dt)[1:].view(B, n, Hq, D).transpose(1, 2)
    assert prefill_kernels(odd.copy_(q), k, v, logits, bias, W, new) is None  # 2 or 4 bytes off: unaligned
    assert prefill_kernels(q, k, v.contiguous(), logits, bias, W, new) is None
    # keys and values strided differently (fused q/k/v projections: rotary makes the keys contiguous, the values
    # stay a view of the fused product) are taken as well
    got = prefill_rows(t_ref, k, v.contiguous(), W, new)
    assert torch.equal(got[0][1:], rows_ref[1:])  # (the starts, row 0, are written by prefill_pool)
    for a, b in zip(got[1:], (end_ref, ring_ref, valid_ref, last_ref)):
        assert torch.equal(a, b)
    assert torch.equal(prefill_pool(t_ref, k.contiguous(), v, rows_ref, last_ref, size), pool_ref)


@pytest.mark.parametrize(
    "pad,device",
    [pytest.param(0, "cpu", marks=interpreted), pytest.param(7, "cpu", marks=interpreted),
     pytest.param(7, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_triton_prefill_generates_as_the_torch_prefill(pad, device, monkeypatch):
    """StaticPolicyCache(prefill_kernel="triton") generates the same tokens and keeps and records the same as the
    default PyTorch prefill, also for a left-padded batch; its attention takes the types from the scorer's logits
    in the plan kernel: an unpadded batch through `prefill_cache.PrefillKernels` (every layer's kernels in one
    object), a padded one row by row through `nats_prefill_scored`; the PyTorch prefill from `hard_types`. On a GPU
    in bf16 (the model's type offsets then in bf16 too)."""
    import nats_kernels.nats_attention as kernels
    from nats_kernels.nats_attention import prefill_cache

    scored, direct = kernels.nats_prefill_scored, prefill_cache.prefill_kernels
    calls, direct_calls = [], []
    monkeypatch.setattr(kernels, "nats_prefill_scored", lambda *a, **kw: calls.append(1) or scored(*a, **kw))
    monkeypatch.setattr(prefill_cache, "prefill_kernels", lambda *a, **kw: direct_calls.append(1) or direct(*a, **kw))
    model = nats_model()
    prompt = ids(n=PROMPT, b=2, seed=3)
    mask = torch.ones_like(prompt)
    mask[1, :pad] = 0
    if device == "cuda":
        model, prompt, mask = model.to("cuda", torch.bfloat16), prompt.cuda(), mask.cuda()
    runs = {}
    for kernel in ("torch", "triton"):
        cache = StaticPolicyCache(model, "nats", max_new_tokens=NEW, prefill_kernel=kernel)
        runs[kernel] = (greedy(model, prompt, cache, mask=mask), cache.kept(), cache.fractions()["area"])
        layers = model.config.num_hidden_layers
        assert len(calls) == (0 if kernel == "torch" or pad == 0 else layers * 2)
        assert len(direct_calls) == (layers if kernel == "triton" and pad == 0 else 0)
        calls.clear(), direct_calls.clear()
    for a, b in zip(runs["torch"], runs["triton"], strict=True):
        assert torch.equal(a, b)
    default = StaticPolicyCache(model, "nats", max_new_tokens=NEW)  # "auto": Triton for CUDA tensors only
    assert default.prefill_kernel == "auto"
    assert not default.rule.triton_writes(default.layers[0].context, prompt.cpu().float())
    with pytest.raises(ValueError, match="prefill_kernel"):
        StaticPolicyCache(model, "nats", max_new_tokens=NEW, prefill_kernel="cuda")
