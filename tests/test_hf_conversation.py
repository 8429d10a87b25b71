"""Generation as a conversation: a `StaticPolicyCache` that holds a conversation continues it. Each turn prefills only
the tokens after those the cache holds (the last answer's final token and the new text), onto what it kept, and
decodes what a fresh cache over the whole conversation decodes, for full, NAtS and StreamingLLM, through
`nats.hf.loop.generate` and ``model.generate``. A prompt that does not continue the conversation is refused in one
line and leaves the cache as it was; the other policies' continuation equals their decode steps token by token; a
streamer receives every token in order."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402
from test_hf_static_cache import greedy, nats_model  # noqa: E402

from nats.cache.registry import get_cache_class  # noqa: E402
from nats.cache.rule import fixed_policies  # noqa: E402
from nats.hf import StaticPolicyCache, attach_dms  # noqa: E402
from nats.hf.compat import cache_kwargs  # noqa: E402
from nats.hf.loop import generate  # noqa: E402

NEW = 6
TURNS = [(20, 11), (7, 12), (9, 13)]  # (new text tokens, seed) of the three turns
POLICIES = [("full", {}), ("nats", {}), ("streaming_llm", {"budget": 16})]


def user_text(n: int, seed: int) -> torch.Tensor:
    return ids(n=n, b=2, seed=seed)


def through_loop(model, conv, cache):
    return generate(model, conv, cache, NEW, compile=False)


def through_model_generate(model, conv, cache):
    return greedy(model, conv, cache, n=NEW)


PATHS = {"loop": through_loop, "model.generate": through_model_generate}


class Widths:
    """The token counts of the model's forwards (a pre-hook on the embeddings)."""

    def __init__(self, model):
        self.seen: list[int] = []
        self.handle = model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, args: self.seen.append(args[0].shape[1])
        )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy,kw", POLICIES)
def test_three_turns_equal_a_fresh_cache_over_the_conversation(policy, kw, path):
    model = nats_model()
    run = PATHS[path]
    cache = StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw)
    widths = Widths(model)
    conv = None
    for turn, (n, seed) in enumerate(TURNS):
        text = user_text(n, seed)
        conv = text if conv is None else torch.cat([conv, text], dim=1)
        first = len(widths.seen)
        out = run(model, conv, cache)
        if turn:  # only the new tokens went through the model: the answer's last token (not fed yet) and the text
            assert widths.seen[first] == n + 1, (turn, widths.seen[first:])
        fresh = run(model, conv, StaticPolicyCache(model, policy, max_new_tokens=NEW, **kw))
        assert torch.equal(out, fresh), (policy, path, turn)
        conv = out
    held = int(cache.get_seq_length())
    assert held == conv.shape[1] - 1
    assert not cache.overflowed()  # each turn's room was planned again for its new tokens
    if policy != "full":
        assert (cache.kept() < held).any()  # it evicted on the way
    widths.handle.remove()


@pytest.mark.parametrize("path", PATHS)
def test_a_prompt_that_does_not_continue_the_conversation_is_refused(path):
    model = nats_model()
    run = PATHS[path]
    cache = StaticPolicyCache(model, "nats", max_new_tokens=NEW)
    out = run(model, user_text(20, 11), cache)
    text = user_text(7, 12)
    foreign = torch.cat([out, text], dim=1)
    foreign[1, 3] = (foreign[1, 3] + 1) % 100  # one token of the history differs
    with pytest.raises(ValueError, match="does not continue the conversation this cache holds"):
        run(model, foreign, cache)
    with pytest.raises(ValueError, match="does not continue the conversation"):
        run(model, out[:, :-1], cache)  # no new token
    conv = torch.cat([out, text], dim=1)  # the cache is as it was: the true continuation still equals a fresh one
    assert torch.equal(run(model, conv, cache), run(model, conv, StaticPolicyCache(model, "nats", max_new_tokens=NEW)))


def test_tokens_fed_outside_generate_are_refused_as_a_history():
    model = nats_model()
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW)
    prompt = user_text(20, 11)
    with torch.no_grad():
        model(prompt, use_cache=True, **cache_kwargs(model, cache))
    with pytest.raises(ValueError, match="did not come from a finished generate call"):
        generate(model, torch.cat([prompt, user_text(3, 5)], dim=1), cache, NEW, compile=False)


def test_padding_inside_a_continuation_is_refused():
    model = nats_model()
    cache = StaticPolicyCache(model, "full", max_new_tokens=NEW)
    out = generate(model, user_text(20, 11), cache, NEW, compile=False)
    conv = torch.cat([out, user_text(4, 5)], dim=1)
    mask = torch.ones_like(conv)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="padding after the .* tokens the cache holds"):
        generate(model, conv, cache, NEW, attention_mask=mask, compile=False)


@pytest.mark.parametrize("policy", fixed_policies())
def test_a_continuation_equals_the_decode_steps(policy):
    """A continuation of 13 tokens in one forward leaves what 13 one-token forwards leave: the same outputs, kept
    tokens, fractions and (NAtS) type fractions. Full, NAtS and StreamingLLM compute it in parallel; a budgeted
    policy's prompt rule (SnapKV's selection) runs once, on the first prompt, and its continuation is its decode steps
    (SnapKV's family appends in parallel, H2O evicts step by step)."""
    cls = get_cache_class(policy)
    model = attach_dms(tiny_model("llama"), window=4, alpha_offset=0.0) if cls.requires_core == "dms" else nats_model()
    kw = {"budget": 16} if cls.budgeted else {}
    kw.update({"window": 4} if cls.prefill_time else {})
    prompt, more = user_text(30, 11), user_text(13, 12)
    caches = [StaticPolicyCache(model, policy, max_len=64, **kw) for _ in range(2)]  # growing: room for all
    with torch.no_grad():
        for cache in caches:
            model(prompt, use_cache=True, **cache_kwargs(model, cache))
        together = model(more, use_cache=True, **cache_kwargs(model, caches[0])).logits
        alone = torch.cat(
            [model(more[:, i : i + 1], use_cache=True, **cache_kwargs(model, caches[1])).logits for i in range(13)], 1
        )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0].kept(), caches[1].kept())
    for a, b in zip(caches[0].fractions().values(), caches[1].fractions().values()):
        torch.testing.assert_close(a, b)
    if policy == "nats":
        torch.testing.assert_close(caches[0].type_fractions(), caches[1].type_fractions())


class Recorder:
    """transformers' streamer interface: ``put`` and ``end``."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        assert self.ended == 0
        self.parts.append(value)

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("new,every", [(NEW, 2), (NEW, 4), (1, 2)])
def test_streamer_receives_every_token_in_order(new, every):
    model = nats_model()
    prompt = user_text(20, 11)
    rec = Recorder()
    out = generate(model, prompt, StaticPolicyCache(model, "nats", max_new_tokens=NEW), new, compile=False,
                   streamer=rec, check_every=every)  # fmt: skip
    assert rec.ended == 1 and torch.equal(rec.parts[0], prompt)
    assert all(p.device.type == "cpu" for p in rec.parts)
    assert torch.equal(torch.cat(rec.parts[1:], dim=1), out[:, prompt.shape[1] :])
    assert len(rec.parts) - 1 <= -(-new // every) + 1  # a read every `every` tokens, not one per token


def test_the_generate_hook_keeps_the_model_picklable_and_detach_removes_it():
    """The wrapper of prepare_inputs_for_generation that checks a conversation is a module-level object: the routed
    model pickles (and its copy checks too); detach_nats gives the class's method back."""
    import pickle

    from nats.hf import detach_nats

    model = nats_model()
    copy = pickle.loads(pickle.dumps(model))
    assert copy.prepare_inputs_for_generation.model is copy
    detach_nats(model)
    assert "prepare_inputs_for_generation" not in vars(model)
