"""The transformers integration against the release a fresh install resolves (``nats.hf.compat``).

transformers 5.24 renamed the cache argument (``past_key_values`` -> ``cache``): the attention modules then saw no
cache, and NAtS decoding silently fell back to the uncached path. These tests fail the day such a rename lands:
every layer's policy must see the prompt, and the project's ``generate`` path must not use a deprecated argument.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ARCHS, ids, tiny_model  # noqa: E402

from nats.hf import StaticPolicyCache, attach_nats, use_policy_caches  # noqa: E402
from nats.hf.compat import cache_argument, cache_from_kwargs, cache_kwargs, update_cache  # noqa: E402


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layer_policy_sees_the_prompt(arch):
    model = use_policy_caches(tiny_model(arch))
    cache = StaticPolicyCache(model, "full", max_new_tokens=None, max_len=32, backend="torch")
    with torch.no_grad():
        model(ids(n=10, b=1), use_cache=True, **cache_kwargs(model, cache))
    assert [layer.ready for layer in cache.layers] == [True] * len(cache.layers)  # each layer's prefill ran
    assert cache.kept().tolist() == [[[10] * model.config.num_key_value_heads]] * len(cache.layers)


def test_cache_argument_matches_the_installed_release():
    model = tiny_model("llama")
    name = cache_argument(model)
    attn_params = type(model.model.layers[0].self_attn).forward
    import inspect

    assert (name == "cache") == ("cache" in inspect.signature(attn_params).parameters)
    assert cache_from_kwargs({name: "c"}) == "c" and cache_from_kwargs({}) is None


def test_generate_path_uses_no_deprecated_argument():
    model = attach_nats(tiny_model("llama"), window=4, init_std=0.5)
    prompt = ids(n=12, b=1)
    cache = StaticPolicyCache(model, "nats", max_new_tokens=None, max_len=20, backend="torch")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            do_sample=False,
            **cache_kwargs(model, cache),
        )
    deprecated = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    assert deprecated == []
    # the prompt and every new token but the last went through each layer's rule (its token types counted)
    assert int(cache.get_seq_length()) == 12 + 3
    assert all(bool((layer.type_counts.sum(-1) == 12 + 3).all()) for layer in cache.layers)


def test_update_cache_calls_update_as_each_release_does():
    """5.23+: ``update(k, v, layer, kwargs=<the forward's kwargs>)``; before: ``update(k, v, layer, {sin, cos,
    cache_position})`` (the GPU image's 5.17 takes this branch)."""
    calls = []

    class Recorder:
        def update(self, k, v, layer_idx, *args, **kw):
            calls.append((layer_idx, args, kw))
            return k, v

    kwargs = {"cache_position": "pos", "other": 1}
    assert update_cache(Recorder(), "k", "v", 3, kwargs, "cos", "sin", new_style=True) == ("k", "v")
    update_cache(Recorder(), "k", "v", 3, kwargs, "cos", "sin", new_style=False)
    assert calls == [(3, (), {"kwargs": kwargs}), (3, ({"sin": "sin", "cos": "cos", "cache_position": "pos"},), {})]


def test_attention_functions_take_transformers_argument_order():
    # wrappers of registered attention functions (kvpress' head-wise masks) pass dropout and scaling by position
    import inspect

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nats.hf.attention import nats_attention_forward

    order = list(inspect.signature(sdpa_attention_forward).parameters)[:7]
    assert list(inspect.signature(nats_attention_forward).parameters)[:7] == order
