"""`nats.hf.limits`: what a generate call may ask of a model and a cache, refused in one line before any work. A
second generate call through the same cache once continued the first call's sequence with a prompt it never checked
and gave other tokens (through `StaticPolicyCache` decoding the new prompt one token at a time: 333 s at
Llama-3.1-8B's shape and 32k where a new cache took 2 s); now a `StaticPolicyCache` continues a conversation and
refuses, before it changes, a prompt that does not continue the tokens it holds (tests/test_hf_conversation.py has
the conversations). More new tokens than a `StaticPolicyCache` was made for and a prompt + new tokens past
``max_position_embeddings`` ran silently. A new cache per prompt still gives the same tokens."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402
from test_hf_static_cache import greedy, nats_model  # noqa: E402

from nats.hf import StaticPolicyCache, use_policy_caches  # noqa: E402
from nats.hf.compat import cache_kwargs  # noqa: E402
from nats.hf.limits import context_length  # noqa: E402
from nats.hf.loop import generate  # noqa: E402

NEW = 6
FOREIGN = r"^\S+: the prompt \(.*\) does not continue the conversation this cache holds"


def model_for(policy):
    return nats_model() if policy == "nats" else use_policy_caches(tiny_model("llama"))


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("policy", ["full", "nats"])
@pytest.mark.parametrize("path", ["loop", "model.generate"])
def test_the_same_prompt_again_is_refused_before_the_cache_changes(policy, path):
    model = model_for(policy)
    prompt = ids(n=24, b=2, seed=3)

    def run(cache):
        if path == "loop":
            return generate(model, prompt, cache, NEW, compile=False)
        return greedy(model, prompt, cache, n=NEW)

    cache = StaticPolicyCache(model, policy, max_new_tokens=NEW)
    first = run(cache)
    held = int(cache.get_seq_length())
    with pytest.raises(ValueError, match=FOREIGN) as err:
        run(cache)
    assert "make a new cache for another prompt" in one_line(err)
    assert int(cache.get_seq_length()) == held == 24 + NEW - 1
    assert torch.equal(run(StaticPolicyCache(model, policy, max_new_tokens=NEW)), first)  # a new cache: the same


def test_a_forward_of_several_tokens_continues_and_generate_then_refuses_unknown_ids():
    """A forward of several tokens through a cache that holds a sequence continues it (transformers' meaning); the
    ids it fed are not the cache's to check, so a generate call after it is refused."""
    model = model_for("full")
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW)
    out = greedy(model, ids(n=24, b=1), cache, n=NEW)
    with torch.no_grad():
        model(ids(n=5, b=1, seed=9), **cache_kwargs(model, cache))
    assert int(cache.layers[0].cumulative_length) == 24 + NEW - 1 + 5
    with pytest.raises(ValueError, match="did not come from a finished generate call") as err:
        greedy(model, torch.cat([out, ids(n=5, b=1, seed=9)], 1), cache, n=NEW)
    one_line(err)


@pytest.mark.parametrize("policy", ["full", "nats"])
def test_a_growing_cache_refuses_the_same_prompt_again_before_it_changes(policy):
    """Made for an unknown number of new tokens (eager steps), the cache refuses a prompt that does not continue its
    conversation as the fixed one does, before it counts the prompt's tokens; it cannot be reset (a new cache gives
    the first call's tokens)."""
    model = model_for(policy)
    prompt = ids(n=24, b=1, seed=3)
    cache = StaticPolicyCache(model, policy, max_new_tokens=None, backend="torch")  # max_len: the context
    first = greedy(model, prompt, cache, n=NEW)
    held = (int(cache.get_seq_length()), cache.seen)
    assert held == (24 + NEW - 1,) * 2
    with pytest.raises(ValueError, match=FOREIGN) as err:
        greedy(model, prompt, cache, n=NEW)
    one_line(err)
    assert (int(cache.get_seq_length()), cache.seen) == held
    with pytest.raises(NotImplementedError, match="make a new cache for a new conversation"):
        cache.reset()
    again = StaticPolicyCache(model, policy, max_new_tokens=None, backend="torch")
    assert torch.equal(greedy(model, prompt, again, n=NEW), first)


def test_the_loop_refuses_a_prompt_of_one_token_that_does_not_continue():
    """A prompt of one token looks like a decode step to the cache; the loop checks it against the cache's ids."""
    model = model_for("full")
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW)
    generate(model, ids(n=24, b=1), cache, NEW, compile=False)
    with pytest.raises(ValueError, match=FOREIGN):
        generate(model, ids(n=1, b=1), cache, NEW, compile=False)


def test_more_new_tokens_than_the_cache_was_made_for_are_refused():
    model = model_for("nats")
    cache = StaticPolicyCache(model, "nats", max_new_tokens=NEW)
    planned = rf"max_new_tokens={NEW + 1} exceeds the {NEW} new tokens this StaticPolicyCache was made for"
    with pytest.raises(ValueError, match=rf"^nats.hf.loop.generate: {planned}: make it with max_new_tokens={NEW + 1}$"):
        generate(model, ids(n=24, b=1), cache, NEW + 1, compile=False)
    assert not cache.layers[0].is_initialized  # refused before the prompt's forward
    out = generate(model, ids(n=24, b=1), cache, NEW - 2, compile=False)  # fewer: fine
    assert out.shape == (1, 24 + NEW - 2)


@pytest.mark.parametrize("path", ["loop", "model.generate", "max_len"])
def test_a_prompt_and_new_tokens_past_the_models_context_are_refused(path):
    model = model_for("full")
    assert model.config.max_position_embeddings == 256
    prompt = ids(n=250, b=1)
    context = r"exceeds the model's context of 256 positions \(config\.max_position_embeddings\)"
    if path == "max_len":  # a cache made for an unknown number of new tokens: its max_len, when made
        with pytest.raises(ValueError, match=rf"^StaticPolicyCache: max_len=257 \(prompt \+ new tokens\) {context}"):
            StaticPolicyCache(model, "full", max_new_tokens=None, max_len=257)
        assert StaticPolicyCache(model, "full", max_new_tokens=None, max_len=256).max_len == 256
        return
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW + 1)
    who = "nats.hf.loop.generate" if path == "loop" else "StaticPolicyCache"
    new = "max_new_tokens" if path == "loop" else "the max_new_tokens it was made for"
    with pytest.raises(ValueError, match=rf"^{who}: the prompt \(250 tokens\) \+ {new} \(7\) = 257 {context}") as e:
        if path == "loop":
            generate(model, prompt, cache, NEW + 1, compile=False)
        else:
            greedy(model, prompt, cache, n=NEW + 1)
    assert "raise model.config.max_position_embeddings" in one_line(e)
    assert not cache.layers[0].is_initialized  # refused before any work
    # up to the context it runs; raising the config's context is the explicit way past it
    assert generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=NEW), NEW).shape[1] == 256
    model.config.max_position_embeddings = 512
    assert generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=NEW + 1), NEW + 1).shape[1] == 257


def test_context_length_counts_a_stretching_rope_scaling():
    plain = transformers.LlamaConfig(max_position_embeddings=8192)
    assert context_length(plain) == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(transformers.LlamaConfig(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # fmt: skip
    assert context_length(transformers.LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)) == 131072
