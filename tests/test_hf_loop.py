"""`nats.hf.loop.generate`: the decode loop without a host synchronisation per token (nats-generate's) gives
``model.generate``'s tokens through the same cache: eager and compiled, unpadded and left-padded, greedy, with end
tokens; transformers' StaticCache too."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402
from test_hf_static_cache import greedy, nats_model  # noqa: E402

from nats.hf import StaticPolicyCache, use_policy_caches  # noqa: E402
from nats.hf.loop import generate  # noqa: E402

NEW = 12


def model_for(policy):
    return nats_model() if policy == "nats" else use_policy_caches(tiny_model("llama"))


@pytest.mark.parametrize("policy,kw", [("nats", {}), ("full", {}), ("streaming_llm", {"budget": 12})])
def test_equals_model_generate(policy, kw):
    model = model_for(policy)
    prompt = ids(n=40, b=2, seed=3)
    ref = greedy(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw), n=NEW)
    got = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw), NEW, compile=False)
    assert torch.equal(got, ref)


def test_growing_cache_decodes_eagerly_and_refuses_the_compiled_step():
    """A cache made without max_new_tokens grows its pools between eager steps: the loop decodes it eagerly (the
    tokens of a planned cache, past its first growth) and refuses to compile its step, in one line."""
    model = model_for("nats")
    prompt = ids(n=40, b=2, seed=3)
    new = 30  # past the 16 free slots a row gets without a plan
    ref = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=new), new, compile=False)
    cache = StaticPolicyCache(model, "nats", max_len=prompt.shape[1] + new)
    assert torch.equal(generate(model, prompt, cache, new), ref)
    assert cache.reallocations() > 0
    with pytest.raises(ValueError, match="without max_new_tokens .* make it with max_new_tokens=N"):
        generate(model, prompt, StaticPolicyCache(model, "nats", max_len=80), 8, compile=True)


@pytest.mark.parametrize("policy", ["nats", "full"])
def test_left_padded_batch_equals_model_generate(policy):
    model = model_for(policy)
    prompt = ids(n=30, b=3, seed=4)
    mask = torch.ones_like(prompt)
    mask[0, :7] = 0
    mask[2, :2] = 0
    ref = greedy(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), mask=mask, n=NEW)
    cache = StaticPolicyCache(model, policy, max_new_tokens=NEW)
    got = generate(model, prompt, cache, NEW, attention_mask=mask, compile=False)
    assert torch.equal(got, ref)


def test_compiled_step_equals_eager_and_is_reused():
    """Compiled by inductor (on the CPU: no CUDA graphs), the loop's tokens equal the eager loop's; a second call
    with a new cache, prompt and number of new tokens compiles nothing new (the step's token input once carried
    the stride of a buffer of max_new_tokens columns: at 8B a recompile of ~37 s inside a timed run)."""
    from torch._dynamo.utils import counters

    model = model_for("nats")
    torch._dynamo.reset()
    for seed, new in ((5, NEW), (6, NEW + 9)):
        prompt = ids(n=33, b=2, seed=seed)
        eager = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=new), new, compile=False)
        got = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=new), new, compile=True)
        assert torch.equal(got, eager), seed
        if seed == 5:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_generate_hands_its_inductor_settings_to_the_compiled_step():
    """``generate(..., inductor=)`` reaches torch.compile with the step (which checks inductor's settings at once: a
    str where inductor wants a bool fails before the first decode step), and a backend by name compiles the step
    without a mode or settings: the eager loop's tokens. (That the default mode records CUDA graphs is checked on the
    GPU: test_gpu_cuda_graph_loop_equals_eager.)"""
    model = model_for("full")
    prompt = ids(n=20, b=2, seed=7)
    eager = generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=4), 4, compile=False)
    with pytest.raises(RuntimeError, match="combo_kernels"):
        generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=4), 4, compile=True,
                 inductor={"combo_kernels": "yes"})  # fmt: skip
    got = generate(
        model,
        prompt,
        StaticPolicyCache(model, "full", max_new_tokens=4),
        4,
        compile="aot_eager",
        inductor={"combo_kernels": "yes"},
    )  # fmt: skip  (a backend by name takes no inductor settings)
    assert torch.equal(got, eager)


def test_one_compiled_step_per_settings():
    """The compiled steps are kept by model, mode and settings: the same settings (however given) reuse one, other
    settings make another; the settings reach torch.compile, which checks them at once; the defaults are read
    only."""
    from nats.hf import loop

    model = model_for("full")
    default = loop.decode_step(model, True)
    assert loop.decode_step(model, True, inductor={}) is default
    assert loop.decode_step(model, True, inductor={"combo_kernels": True}) is default
    other = loop.decode_step(model, True, inductor={"combo_kernels": False})
    assert other is not default and loop.decode_step(model, True, inductor={"combo_kernels": False}) is other
    gemm = loop.decode_step(model, True, inductor={"max_autotune_gemm_backends": "ATEN"})
    assert gemm is not default and gemm is not other
    assert loop.decode_step(model, "aot_eager", inductor={"combo_kernels": False}) is loop.decode_step(
        model, "aot_eager"
    )  # a backend by name takes no inductor settings
    with pytest.raises(RuntimeError, match="combo_kernels"):  # torch.compile got it: a str where inductor wants a bool
        loop.decode_step(model, True, inductor={"combo_kernels": "yes"})
    with pytest.raises(TypeError):
        loop.STEP_INDUCTOR["combo_kernels"] = False


def test_settings_key_tells_values_and_their_types_apart():
    from nats.utils import settings_key

    assert settings_key({"b": 1, "a": [2]}) == settings_key({"a": [2], "b": 1})  # a list: by its repr
    assert hash(settings_key({"a": [2], "b": {"c": 1}}))
    assert settings_key({"a": True}) != settings_key({"a": 1})  # equal in Python, not as settings
    assert settings_key({"a": [2]}) != settings_key({"a": "[2]"})


def test_on_prefill_is_called_once_between_the_prompt_and_the_decode_steps():
    model = model_for("full")
    forwards, seen = [], []
    model.register_forward_hook(lambda m, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[1]),
                                with_kwargs=True)  # fmt: skip
    prompt = ids(n=20, b=2, seed=7)
    generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=NEW), NEW, compile=False,
             on_prefill=lambda: seen.append(list(forwards)))  # fmt: skip
    assert seen == [[20]] and forwards == [20] + [1] * (NEW - 1)


def test_end_tokens_pad_the_row_and_stop_when_every_row_ended():
    model = model_for("full")
    prompt = ids(n=20, b=2, seed=7)
    free = generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=40), 40, compile=False)
    end = int(free[0, 20 + 3])  # row 0's 4th new token ends it
    got = generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=40), 40, eos_token_id=end,
                   pad_token_id=0, compile=False, check_every=4)  # fmt: skip
    for row in range(2):
        new, ref = got[row, 20:], free[row, 20:]
        hits = (ref == end).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else len(ref)
        assert torch.equal(new[: min(stop, len(new))], ref[: min(stop, len(new))])
        assert bool((new[stop:] == 0).all())
    if bool((free[:, 20:] == end).any(1).all()):  # both rows ended: stopped early, at a check
        assert got.shape[1] < 60 and (got.shape[1] - 20) % 4 == 0


def test_transformers_static_cache_equals_model_generate():
    from transformers import StaticCache

    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    prompt = ids(n=25, b=2, seed=8)
    ref = greedy(model, prompt, StaticCache(config=model.config, max_cache_len=25 + NEW), n=NEW)
    cache = StaticCache(config=model.config, max_cache_len=2 * (25 + NEW))
    got = generate(model, prompt, cache, NEW, compile=False)
    assert torch.equal(got, ref)
    # transformers' cache keeps no ids to check a conversation against: a second call through it is refused
    with pytest.raises(ValueError, match=r"this StaticCache already holds \d+ tokens of an earlier generate call"):
        generate(model, got, cache, NEW, compile=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["nats", "full"])
def test_gpu_cuda_graph_loop_equals_eager(policy):
    """On a GPU the step is compiled with CUDA graphs (the Triton kernels inside): tokens equal the eager loop's,
    in float32, for two prompts through new caches (a replay over an earlier cache's buffers would repeat it)."""
    from nats.hf.loop import cudagraph_recordings

    model = model_for(policy).cuda()
    recorded = cudagraph_recordings()
    for seed in (9, 10):
        prompt = ids(n=70, b=2, seed=seed).cuda()
        eager = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW, compile=False)
        got = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW, compile=True)
        assert torch.equal(got, eager), (policy, seed)
    assert cudagraph_recordings() > recorded  # the default mode (reduce-overhead) replays the step as a CUDA graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["nats", "full"])
def test_gpu_sampled_decode_steps_never_synchronise(policy):
    """Sampling on the device (`nats.sampling`), the compiled steps replayed as CUDA graphs from fixed buffers: from
    the first decode step to the end of the loop nothing waits for the GPU (torch's sync debug mode set to "error"
    by the loop's ``on_prefill``; no end token, no streamer, so no read every ``check_every`` tokens)."""
    from nats.hf import CacheBuffers

    model = model_for(policy).cuda()
    buffers = CacheBuffers()
    prompt = ids(n=40, b=2, seed=11).cuda()

    def run(strict: bool):
        cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, row_slots=64, buffers=buffers)
        gen = torch.Generator("cuda").manual_seed(3)
        on = (lambda: torch.cuda.set_sync_debug_mode("error")) if strict else None
        try:
            return generate(model, prompt, cache, NEW, temperature=0.8, top_k=20, top_p=0.9, generator=gen,
                            compile=True, on_prefill=on)  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")

    first = run(strict=False)  # compiles the step and records its graph over the buffers
    assert torch.equal(run(strict=True), first)  # replays, the same seeded draws


def test_a_changing_workload_compiles_few_graphs_and_never_falls_back_to_eager(monkeypatch):
    """One process serving requests of batch 1-16 and prompts of different lengths (the split-K count chosen as on a
    132-SM GPU): the compiled step is reused after at most two graphs, and dynamo never reaches its recompile limit
    (made an error here; past it, it would decode eagerly); each request's tokens equal the eager loop's."""
    from torch._dynamo.utils import counters

    from nats.cache import engine

    monkeypatch.setattr(engine, "num_sms", lambda device: 132)
    model = model_for("nats")
    model.config.max_position_embeddings = 512  # prompts of up to 300 tokens: past the tiny model's 256 on purpose
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    requests = [(1, 40), (2, 90), (16, 33), (3, 300), (8, 64), (1, 250), (5, 120), (16, 200), (2, 45), (1, 37)]
    for i, (b, n) in enumerate(requests):
        prompt = ids(n=n, b=b, seed=20 + i)
        eager = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=6), 6, compile=False)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
            got = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=6), 6, compile="aot_eager")
        assert torch.equal(got, eager), (b, n)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] <= 2 and graphs[3:] == [graphs[-1]] * (len(requests) - 3), graphs


@pytest.mark.parametrize("policy,kw", [("full", {}), ("nats", {}), ("streaming_llm", {"budget": 12}),
                                       ("h2o", {"budget": 30})])  # fmt: skip
@pytest.mark.parametrize("compile", [False, "inductor"])
def test_a_finished_requests_cache_is_freed_at_once(policy, kw, compile):
    """A cache no longer referenced is freed at once, without Python's cyclic collector: its layers reach it by a
    weak reference. A reference cycle kept each request's buffers until a collection (at 8B, batch 8 x 32k: 34 GB
    per request, out of memory after three requests on a 140 GB GPU)."""
    import gc
    import weakref

    model = model_for(policy)
    prompt = ids(n=40, b=2, seed=8)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # the second request through an already compiled step
            cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw)
            generate(model, prompt, cache, NEW, compile=compile)
            refs = [weakref.ref(cache), weakref.ref(cache.layers[0].kv_pool)]
            del cache
            assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()
