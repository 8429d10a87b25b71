"""Every registered policy through every decoding path (the contract of `nats.cache.engine`): adding a policy (one
file in nats/cache/policies/, one conf/cache/<name>.yaml) puts it under these tests on the GPT path and the
transformers paths, as tests/test_contract_cache.py does for the GPT path's measurements.

* a registered policy is a `FixedRule` (what it keeps of a prompt, how a step changes a row) whose ``rule(**options)``
  carries its flags; every decodable one runs in the engine on every path (`fixed_policies`) and the evaluation-only
  ones are refused with the reason;
* the GPT path: `nats.cache.decode.generate` (a cache planned for the new tokens) decodes the greedy tokens that
  teacher forcing through a cache that grows gives (`policy_logits(sequential=True)`);
* the transformers paths: ``model.generate`` through `StaticPolicyCache` planned for the new tokens, through one
  that does not know their number (eager steps, growth) and `nats.hf.loop.generate` decode the same greedy tokens and
  hold the same number of tokens after them;
* where the policy is exact (``full``, ``nats``) every path equals the model's parallel forward;
* batch equals alone: a left-padded batch planned for the new tokens, and a batch of equal-length prompts through a
  cache that grows, decode each sequence as it decodes alone.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_cache import nats_model as gpt_nats_model  # noqa: E402
from test_cache import tiny as gpt_tiny  # noqa: E402
from test_hf_nats import ids, tiny_model  # noqa: E402

from nats.cache import available_caches, get_cache_class  # noqa: E402
from nats.cache.decode import generate as gpt_generate  # noqa: E402
from nats.cache.decode import policy_logits  # noqa: E402
from nats.cache.rule import FixedRule, fixed_policies  # noqa: E402
from nats.hf import StaticPolicyCache, attach_dms, attach_nats, use_policy_caches  # noqa: E402
from nats.hf.compat import cache_kwargs  # noqa: E402
from nats.hf.loop import generate as loop_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

PROMPT, NEW, BUDGET = 40, 8, 20
DECODABLE = [n for n in available_caches() if get_cache_class(n).decodable]
FIXED = fixed_policies()
EXACT = ("full", "nats")  # decoding equals the model's parallel forward


def options(name: str) -> dict:
    """The budget (and SnapKV's observation window, below the budget) of a budgeted policy; none otherwise."""
    cls = get_cache_class(name)
    kw = {"budget": BUDGET} if cls.budgeted else {}
    if "window" in cls.accepted_options({"window": 4}) and cls.requires_core is None:
        kw["window"] = 4
    return kw


def model_for(name: str):
    """The tiny Llama in float64 (greedy tokens are compared across attention implementations)."""
    model = tiny_model("llama").double()
    if get_cache_class(name).requires_core == "nats":
        return attach_nats(model, window=4, init_std=0.5)
    if get_cache_class(name).requires_core == "dms":
        return attach_dms(model, window=4, alpha_offset=0.0)
    return use_policy_caches(model)


def hf_greedy(model, prompt, cache, mask=None, n=NEW, compile_config=None):
    """``model.generate``'s n greedy tokens through a cache (its end token held back: ``min_new_tokens``)."""
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt) if mask is None else mask,
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, compile_config=compile_config,
                              disable_compile=compile_config is None, **cache_kwargs(model, cache))  # fmt: skip


greedy = functools.partial(hf_greedy, n=NEW)  # NEW greedy tokens through a cache (compiled with compile_config=)


def test_every_decodable_policy_runs_in_the_engine():
    assert set(DECODABLE) == set(FIXED) and set(FIXED) < set(available_caches())
    for name in available_caches():  # the rule, made with the policy's options, carries the policy's flags
        cls = get_cache_class(name)
        assert issubclass(cls, FixedRule) and cls.name == name, name
        rule = cls.rule(**options(name))
        assert isinstance(rule, cls), name
        assert (rule.budgeted, rule.even_rows, rule.decodable) == (cls.budgeted, cls.even_rows, cls.decodable), name
    assert {"full", "nats", "streaming_llm", "snapkv", "h2o"} <= set(FIXED)
    no_rule = next(n for n in available_caches() if not get_cache_class(n).decodable)  # evaluation-only
    model = use_policy_caches(tiny_model("llama"))
    with pytest.raises(ValueError, match=f"'{no_rule}' is a parallel approximation and cannot decode"):
        StaticPolicyCache(model, no_rule, max_new_tokens=NEW, **options(no_rule))


@pytest.mark.parametrize("name", DECODABLE)
def test_gpt_generate_equals_teacher_forcing_through_a_growing_cache(name):
    """The GPT path: `generate` (pools planned for the new tokens, no growth) and the sequential `policy_logits`
    over the same tokens (no reserve: the pools grow) give the same greedy tokens; exact policies the forward's."""
    cls = get_cache_class(name)
    if cls.requires_core == "nats":
        model = gpt_nats_model(block_size=96)
    else:
        model = gpt_tiny({"name": cls.requires_core or "dense", "window": 4, "alpha_offset": 0.0}
                         if cls.requires_core == "dms" else {"name": "dense"}, block_size=96)  # fmt: skip
    P, new = 40, 24  # more new tokens than a growing pool's first room (GROW_STEPS)
    idx = torch.randint(0, 61, (2, P), generator=torch.Generator().manual_seed(3))
    kw = options(name)
    out, cache = gpt_generate(model, idx, new, name, return_caches=True, **kw)
    assert cache.reallocations() == 0 and cache.t == P + new - 1
    seq, grown = policy_logits(model, out[:, :-1], name, sequential=True, prefill_len=P, **kw)
    assert torch.equal(seq[:, P - 1 :].argmax(-1), out[:, P:]), name
    assert torch.equal(grown.kept(), cache.kept())
    if name in EXACT:
        with torch.no_grad():
            full = model(out[:, :-1]).logits
        assert torch.equal(full[:, P - 1 :].argmax(-1), out[:, P:])


@pytest.mark.parametrize("name", FIXED)
def test_transformers_paths_decode_alike(name):
    model, prompt, kw = model_for(name), ids(n=PROMPT, b=2), options(name)
    model.generation_config.eos_token_id = None  # greedy on every path: the loop holds no end token back
    planned = StaticPolicyCache(model, name, max_new_tokens=NEW, max_len=PROMPT + NEW, **kw)
    out = greedy(model, prompt, planned)
    growing = StaticPolicyCache(model, name, max_len=PROMPT + NEW, **kw)  # the number of new tokens unknown
    assert torch.equal(greedy(model, prompt, growing), out)
    looped = StaticPolicyCache(model, name, max_new_tokens=NEW, max_len=PROMPT + NEW, **kw)
    assert torch.equal(loop_generate(model, prompt, looped, NEW, compile=False), out)
    # the same tokens held after the last step on every path
    assert torch.equal(planned.kept(), growing.kept()) and torch.equal(planned.kept(), looped.kept())
    if name in EXACT:
        with torch.no_grad():
            full = model(out).logits
        assert torch.equal(full[:, PROMPT - 1 : -1].argmax(-1), out[:, PROMPT:])


@pytest.mark.parametrize("name", FIXED)
def test_fixed_engine_left_padded_batch_equals_each_prompt_alone(name):
    model, kw = model_for(name), options(name)
    p1, p2 = ids(n=26, b=1, seed=3), ids(n=40, b=1, seed=4)
    alone = [greedy(model, p, StaticPolicyCache(model, name, max_new_tokens=NEW, max_len=64, **kw)) for p in (p1, p2)]
    pad = torch.zeros(1, 14, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, p1], 1), p2])
    mask = torch.cat([torch.cat([pad, torch.ones_like(p1)], 1), torch.ones_like(p2)])
    out = greedy(model, batch, StaticPolicyCache(model, name, max_new_tokens=NEW, max_len=64, **kw), mask=mask)
    assert torch.equal(out[0, 40:], alone[0][0, 26:]) and torch.equal(out[1, 40:], alone[1][0, 40:])


@pytest.mark.parametrize("name", DECODABLE)
def test_growing_cache_batch_equals_each_prompt_alone(name):
    model, kw = model_for(name), options(name)
    prompt = ids(n=PROMPT, b=2)

    def run(p):
        return greedy(model, p, StaticPolicyCache(model, name, max_len=PROMPT + NEW, backend="torch", **kw))

    out = run(prompt)
    assert torch.equal(out[:1], run(prompt[:1])) and torch.equal(out[1:], run(prompt[1:]))


def test_decode_splits_take_few_values_over_a_changing_workload():
    """The split-K count (a launch shape of the decode kernel, captured in the CUDA graphs): batches 1-16 x prompts
    1k-32k (8 KV heads, a 132-SM GPU and the CPU) give at most seven values, each a power of two, with splits of at
    least 128 keys."""
    from nats.cache.engine import decode_splits

    for sms, head_dim in ((132, 128), (132, 64), (1, 128)):
        seen = set()
        for batch in range(1, 17):
            for prompt in range(1024, 32769, 509):
                s = decode_splits(batch * 8, prompt + 256, torch.device("cpu"), sms=sms, head_dim=head_dim)
                assert s & (s - 1) == 0 and 1 <= s <= 64 and (prompt + 256) / s >= 128 or s == 1
                seen.add(s)
        assert len(seen) <= 7, sorted(seen)
    # batch 8 of 8 KV heads on 132 SMs: 8 splits a row at head dim 128, 16 at 64 (the launch sweep's choice)
    assert [decode_splits(64, 8192, torch.device("cpu"), sms=132, head_dim=d) for d in (128, 64)] == [8, 16]


def test_the_pool_attention_op_chooses_its_split_count_from_the_shapes(monkeypatch):
    """On the Triton path the op chooses the split-K count when it runs, from the rows and the pool's slots per row
    (+ the ring): for a full cache's pool that is the rows' capacity, as the prefill planned it."""
    from nats.cache import attention, engine

    seen = []
    monkeypatch.setattr(attention, "resolve_backend", lambda backend, device: "triton")
    monkeypatch.setattr(attention, "pool_attention", lambda q, *a, splits=None, **k: seen.append(splits) or q.clone())
    monkeypatch.setattr(engine, "num_sms", lambda device: 132)
    R, D, cap = 8, 16, 32768 + 64
    q, pool = torch.zeros(R, 4, D), torch.zeros(R * cap + 1024, D)
    rows = torch.zeros(R, dtype=torch.long)
    engine.pool_attention_op(q, pool, pool, rows, rows, None, None, None)
    ring = torch.zeros(R, 64, D)
    engine.pool_attention_op(q, pool[: R * 300], pool[: R * 300], rows, rows, ring, ring, torch.zeros(R, 64).bool())
    expected = [engine.decode_splits(R, bound, q.device, sms=132, head_dim=D) for bound in (cap + 128, 300 + 64)]
    assert seen == expected
    assert seen[0] == 64
    q = torch.zeros(R, 4, 128)  # head dim 128 and few rows: the kernel's launch choice caps the splits at 16
    engine.pool_attention_op(q, pool[:, :1].expand(-1, 128), pool[:, :1].expand(-1, 128), rows, rows, None, None, None)
    assert seen[-1] == 16 == engine.pool_splits(R, cap + 128, 128, q.device)  # what the launch sweep calls default


@pytest.mark.parametrize("name", FIXED)
def test_a_policys_even_rows_holds_and_reaches_the_decode_attention(name, monkeypatch):
    """A policy that declares ``even_rows`` (the decode attention then splits each row alike rather than balancing
    its chunks over the rows) holds the same number of keys in every row of a layer after an unpadded prompt and its
    steps; every step's attention is told the policy's declaration."""
    from nats.cache import engine

    told = []
    real = engine.pool_attention_op

    def op(*args):
        told.append(args[8] if len(args) > 8 else False)
        return real(*args)

    monkeypatch.setattr(engine, "pool_attention_op", op)
    model, prompt = model_for(name), ids(n=PROMPT, b=2)
    cache = StaticPolicyCache(model, name, max_new_tokens=NEW, **options(name))
    greedy(model, prompt, cache)
    even = get_cache_class(name).even_rows
    # H2O attends with its own probabilities; NAtS' step is fused into its own attention op (nats::nats_decode), which
    # streams its uneven rows
    assert set(told) <= {even} and (told or name in ("h2o", "nats"))
    assert name != "nats" or not even
    held = cache.kept().flatten(1)  # [n_layer, rows]
    if even:
        assert bool((held == held[:, :1]).all()), held


@pytest.mark.parametrize("name", FIXED)
def test_fixed_engine_step_compiles_in_one_graph_and_equals_eager(name):
    """generate compiles StaticPolicyCache's decode step on a GPU: every rule's step must trace as one graph
    (fullgraph, no host synchronisation) and decode as eagerly (here aot_eager on the CPU)."""
    from torch._dynamo.utils import counters

    model, prompt, kw = model_for(name), ids(n=PROMPT, b=2), options(name)
    eager = greedy(model, prompt, StaticPolicyCache(model, name, max_new_tokens=NEW, **kw))
    cc = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # generate compiles on CUDA only otherwise
    torch._dynamo.reset()
    counters.clear()
    out = greedy(model, prompt, StaticPolicyCache(model, name, max_new_tokens=NEW, **kw), compile_config=cc)
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1
