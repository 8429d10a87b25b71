"""`nats.hf.CacheBuffers` and ``row_slots``: successive requests decode from the same addresses, their pools of one
size per batch, with the tokens they decode without them (every policy the fixed-capacity cache runs)."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_loop import model_for  # noqa: E402
from test_hf_nats import ids  # noqa: E402

from nats.hf import CacheBuffers, StaticPolicyCache  # noqa: E402
from nats.hf.loop import generate  # noqa: E402

NEW = 8
POLICIES = [("full", {}), ("nats", {}), ("streaming_llm", {"budget": 12}), ("h2o", {"budget": 30})]


def decode_pointers(cache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers for t in layer.tensors()]


@pytest.mark.parametrize("policy,kw", POLICIES)
def test_requests_decode_from_the_same_buffers_with_the_same_tokens(policy, kw):
    model = model_for(policy)
    buffers = CacheBuffers()
    pointers, shapes = {}, {}
    for i, (b, n) in enumerate([(2, 40), (1, 25), (2, 60), (1, 33), (2, 31)]):
        prompt = ids(n=n, b=b, seed=30 + i)
        ref = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw), NEW, compile=False)
        cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, row_slots=80, buffers=buffers, **kw)
        got = generate(model, prompt, cache, NEW, compile=False)
        assert torch.equal(got, ref), (policy, b, n)
        # the same addresses for every request (each buffer's view starts at its flat buffer), the same pool size
        # for every request of a batch (rows x 80 slots + the scratch slot hold each of these prompts)
        pointers.setdefault(b, decode_pointers(cache))
        assert decode_pointers(cache) == pointers[b]
        shapes.setdefault(b, cache.layers[0].kv_pool.shape)
        rows = b * model.config.num_key_value_heads
        assert cache.layers[0].kv_pool.shape == shapes[b] and shapes[b][1] == rows * 80 + 1
        del cache
        gc.collect()
    assert pointers[1] == pointers[2]  # the larger batch came first: the smaller one's views fit the same buffers


def test_a_prompt_larger_than_the_row_slots_gets_a_larger_pool():
    model = model_for("full")
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW, row_slots=16, buffers=CacheBuffers())
    prompt = ids(n=40, b=1, seed=3)
    ref = generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=NEW), NEW, compile=False)
    assert torch.equal(generate(model, prompt, cache, NEW, compile=False), ref)
    assert cache.layers[0].kv_pool.shape[1] > model.config.num_key_value_heads * 16 + 1


def test_a_cache_made_while_another_holds_the_buffers_keeps_its_own():
    model = model_for("nats")
    buffers = CacheBuffers()
    prompt = ids(n=30, b=2, seed=5)
    first = StaticPolicyCache(model, "nats", max_new_tokens=NEW, buffers=buffers)
    out_first = generate(model, prompt, first, NEW, compile=False)
    second = StaticPolicyCache(model, "nats", max_new_tokens=NEW, buffers=buffers)
    out_second = generate(model, prompt, second, NEW, compile=False)  # `first` is alive: no sharing
    assert torch.equal(out_first, out_second)
    assert not set(decode_pointers(first)) & set(decode_pointers(second))
    held = buffers.nbytes()
    del first
    gc.collect()
    third = StaticPolicyCache(model, "nats", max_new_tokens=NEW, buffers=buffers)
    assert torch.equal(generate(model, prompt, third, NEW, compile=False), out_first)
    assert buffers.nbytes() == held  # the same buffers again, none added


def test_each_layers_fresh_pool_is_freed_once_adopted(monkeypatch):
    """Layer by layer, during the prefill (before the last layer is ready): when a layer's pool is placed in the
    buffers, the earlier layers' fresh pools are gone (the cache's memory is not held twice for the whole prefill)."""
    import weakref

    model = model_for("full")
    buffers, fresh = CacheBuffers(), []
    place = CacheBuffers._place

    def watched(self, key, t):
        if key[1] == "kv_pool":
            assert [r() for r in fresh] == [None] * len(fresh), key
            assert key[0] == len(fresh) and not cache.layers[-1].ready or key[0] == len(cache.layers) - 1, key
            fresh.append(weakref.ref(t))
        return place(self, key, t)

    monkeypatch.setattr(CacheBuffers, "_place", watched)
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW, buffers=buffers)
    generate(model, ids(n=30, b=2, seed=6), cache, NEW, compile=False)
    assert len(fresh) == model.config.num_hidden_layers


def test_row_slots_must_be_a_positive_integer():
    model = model_for("full")
    with pytest.raises(ValueError, match="row_slots must be a positive integer"):
        StaticPolicyCache(model, "full", max_new_tokens=NEW, row_slots=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["nats", "full"])
def test_gpu_a_changing_workload_records_one_graph_per_batch(policy):
    """CUDA graphs: once each batch size has been seen, the requests after it record no graph (same addresses, same
    sizes) and decode the eager loop's tokens (float32)."""
    from nats.hf.loop import cudagraph_recordings

    model = model_for(policy).cuda()
    start = cudagraph_recordings()
    buffers, after = CacheBuffers(), []
    for i, (b, n) in enumerate([(2, 70), (1, 40), (2, 90), (1, 55), (2, 64), (1, 81)]):
        prompt = ids(n=n, b=b, seed=40 + i).cuda()
        eager = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW, compile=False)
        cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, row_slots=128, buffers=buffers)
        got = generate(model, prompt, cache, NEW, compile=True)
        assert torch.equal(got, eager), (policy, b, n)
        del cache
        after.append(cudagraph_recordings() - start)
    assert after[1] > 0 and after[2:] == [after[1]] * 4, after
