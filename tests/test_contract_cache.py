"""The contract of a KV-cache policy, checked for every registered policy (kvpress' default_presses pattern).

Adding a policy (one file in nats/cache/policies/ with @register_cache, one conf/cache/<name>.yaml) puts it
under these tests: float64, grouped-query attention (4 query heads, 2 KV heads), two layers, a prompt prefilled
in parallel and the rest decoded one token at a time.

* exact when nothing is evicted: with budget B = N (budgeted policies) decoding equals the model's forward;
* under eviction: decoding step by step equals the policy's own parallel (layer-wise) prefill of the whole
  sequence, and the budget changes the result; a prefill-time policy (`prefill_time`, e.g. SnapKV: an exact
  prefill, then the cache is compressed) instead equals the model's forward in its parallel prefill and when
  decoding from an empty prompt, and the budget changes what it decodes after a prompt;
* kept <= budget after every step (and <= the tokens seen), area and peak fractions in [0, 1], peak <= B / N;
  a prefill-time policy keeps on average (layers, heads) <= B plus the decoded tokens, and its prefill reads
  everything;
* prefill starts from an empty cache; an evaluation-only policy (`decodable = False`) refuses to decode;
* a policy that needs an attention core (`requires_core`) refuses other models;
* every policy has its conf/cache/<name>.yaml, and nats-eval's config composes all of them into `policies`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from nats.cache import available_caches, get_cache_class, make_caches, policy_logits
from nats.cache.decode import decode_step, eval_mode, prefill
from nats.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

POLICIES = available_caches()
V, N, P, BUDGET = 53, 40, 13, 10  # vocabulary, tokens, prompt (prefilled) tokens, the small budget


def model_for(cls) -> GPT:
    """A tiny float64 GQA model with the attention the policy needs (dense unless `requires_core` says)."""
    torch.manual_seed(0)
    attention = {"name": cls.requires_core or "dense"}
    if cls.requires_core in ("nats", "dms"):
        attention["window"] = 4
    cfg = GPTConfig(vocab_size=V, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, attention=attention)
    model = GPT(cfg).double().eval()
    if cls.requires_core == "nats":
        with torch.no_grad():  # spread the scorers so that all three token types occur
            g = torch.Generator().manual_seed(1)
            for block in model.blocks:
                w = block.attn.core.scorer.weight
                w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype))
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(seed))


def prefill_time(cls) -> bool:
    return getattr(cls, "prefill_time", False)


def budget_kw(cls, budget: int) -> dict:
    # budget_check_len: B = N keeps everything, which make_caches otherwise refuses (that is `full`)
    kw = {"budget": budget, "budget_check_len": N + 1} if cls.budgeted else {}
    return {**kw, "window": 4} if prefill_time(cls) else kw  # SnapKV's observation window must be below B


@pytest.mark.parametrize("name", POLICIES)
def test_exact_when_nothing_is_evicted(name):
    cls = get_cache_class(name)
    model = model_for(cls)
    idx = tokens()
    with torch.no_grad():
        ref = model(idx).logits
    par, _ = policy_logits(model, idx, name, **budget_kw(cls, N))
    assert torch.allclose(par, ref, atol=1e-10, rtol=0), name
    if cls.decodable:
        seq, _ = policy_logits(model, idx, name, sequential=True, prefill_len=P, **budget_kw(cls, N))
        assert torch.allclose(seq, ref, atol=1e-10, rtol=0), name
    else:
        with pytest.raises(ValueError, match="cannot decode"):
            policy_logits(model, idx, name, sequential=True, **budget_kw(cls, N))


@pytest.mark.parametrize("name", POLICIES)
def test_decoding_equals_the_parallel_prefill(name):
    cls = get_cache_class(name)
    model = model_for(cls)
    idx = tokens(1)
    par, _ = policy_logits(model, idx, name, **budget_kw(cls, BUDGET))
    if prefill_time(cls):
        with torch.no_grad():
            full = model(idx).logits
        assert torch.allclose(par, full, atol=1e-10, rtol=0), f"{name}: the prefill is not exact"
        seq, _ = policy_logits(model, idx, name, sequential=True, **budget_kw(cls, BUDGET))
        assert torch.allclose(seq, full, atol=1e-10, rtol=0), f"{name}: decoding from an empty prompt"
        seq, _ = policy_logits(model, idx, name, sequential=True, prefill_len=P, **budget_kw(cls, BUDGET))
        assert not torch.allclose(seq, full, atol=1e-3), f"{name}: the budget changes nothing"
        return
    if cls.budgeted:
        with torch.no_grad():
            assert not torch.allclose(par, model(idx).logits, atol=1e-3), f"{name}: the budget changes nothing"
    if not cls.decodable:
        return
    for prefill_len in (0, P):
        seq, _ = policy_logits(model, idx, name, sequential=True, prefill_len=prefill_len, **budget_kw(cls, BUDGET))
        assert torch.allclose(seq, par, atol=1e-10, rtol=0), (name, prefill_len)


@pytest.mark.parametrize("name", POLICIES)
def test_kept_within_budget_and_fractions(name):
    cls = get_cache_class(name)
    model = model_for(cls)
    idx = tokens(2)
    budget = BUDGET if cls.budgeted else None
    options = {"window": 4} if prefill_time(cls) else {}
    caches = make_caches(model, name, 2, N, budget=budget, backend="torch", **options)

    def check(t: int) -> None:
        kept = caches.kept()  # [layer, sequence, KV head]
        assert kept.shape == (2, 2, 2) and kept.dtype == torch.long
        assert (kept >= 1).all() and (kept <= t).all(), (name, t, kept)
        if budget is not None and not prefill_time(cls):
            assert (kept <= budget).all(), (name, t, kept)
        fr = caches.fractions()
        for key in ("area", "peak"):
            assert fr[key].shape == (2, 2, 2) and ((fr[key] >= 0) & (fr[key] <= 1)).all(), (name, key, fr[key])
        if budget is not None and not prefill_time(cls):
            assert (fr["peak"] <= budget / t + 1e-12).all()
        assert all(layer.nbytes() > 0 for layer in caches.layers) and caches.t == t
        if prefill_time(cls):  # per-layer (PyramidKV) or per-head (AdaKV) budgets: B on average, + decoded tokens
            mean = kept.double().mean()
            assert mean <= budget + t - P + 1e-12, (name, t, mean)

    with eval_mode(model):
        prefill(model, caches, idx[:, :P] if cls.decodable else idx)
        check(P if cls.decodable else N)
        if cls.decodable:
            for i in range(P, N):
                decode_step(model, caches, idx[:, i], i)
                check(i + 1)
        with pytest.raises(RuntimeError, match="starts from an empty cache"):
            prefill(model, caches, idx[:, :4])


@pytest.mark.parametrize("name", [n for n in POLICIES if get_cache_class(n).requires_core])
def test_required_core_is_checked(name):
    cls = get_cache_class(name)
    other = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16, attention={"name": "dense"}))
    with pytest.raises(ValueError, match=f"needs a model with {cls.requires_core} attention"):
        make_caches(other, name, 1, 8, budget=4 if cls.budgeted else None)


def test_every_policy_has_a_config_composed_by_nats_eval(tmp_path):
    from conftest import compose

    files = {p.stem for p in (REPO / "conf/cache").glob("*.yaml")}
    assert files == set(POLICIES), f"conf/cache/*.yaml {sorted(files)} vs registered policies {POLICIES}"
    cfg = compose([], tmp_path, config_name="eval")
    assert set(cfg.policies) == set(POLICIES)
    for name, pcfg in cfg.policies.items():
        assert pcfg.name == name and get_cache_class(pcfg.name).name == name
        assert not pcfg.sequential or get_cache_class(name).decodable, name
    assert set(cfg.methods) <= set(cfg.policies)


def _refusal(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("name", POLICIES)
def test_every_entry_point_refuses_a_misuse_in_the_rules_words(name):
    """A budget where the policy takes none (or none where it needs one), and decoding with a prefill-only policy:
    `FixedRule.check_use` words the refusal once, and the GPT path (make_caches, decoding) and the engine say it."""
    from nats.cache.engine_cache import EngineCache

    cls = get_cache_class(name)
    model = model_for(cls)
    cores = [b.attn.core if cls.requires_core else None for b in model.blocks]
    wrong = None if cls.budgeted else 4  # the budget this policy must refuse
    said = _refusal(lambda: cls.check_use(wrong, decode=False))
    assert ("needs a budget" if cls.budgeted else "takes no budget") in said
    assert said in _refusal(lambda: make_caches(model, name, 1, 8, budget=wrong))
    assert said in _refusal(lambda: EngineCache(name, cores, reserve=None, budget=wrong, decodable=False))
    if not cls.decodable:
        said = _refusal(cls.check_decodes)
        assert said in _refusal(lambda: policy_logits(model, tokens(), name, sequential=True, **budget_kw(cls, N)))
        assert said in _refusal(lambda: EngineCache(name, cores, reserve=None, budget=4 if cls.budgeted else None))
