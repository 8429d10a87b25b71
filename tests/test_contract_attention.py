"""The contract of an attention core, checked for every registered core (kvpress' default_presses pattern).

Adding a core (one file in nats/attention/ with @register_attention, one conf/model/attention/<name>.yaml) puts
it under these tests with its default arguments: the output has the queries' shape, position t does not depend
on tokens after t (causal cores), gradients reach q, k, v and the core's parameters, grouped-query attention
works or is refused as the class declares (`supports_gqa`), and KV-cache decoding works through the declared
`decode_policy` (reproducing the model's forward) or is refused with a message naming the core.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from nats.attention.registry import ATTENTIONS, AttentionDims, build_attention, decodable_attention
from nats.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CORES = ATTENTIONS.names()
B, N, C, HQ = 2, 12, 32, 4


def dims(n_kv_head: int = HQ, causal: bool = True) -> AttentionDims:
    return AttentionDims(
        n_embd=C, n_head=HQ, n_kv_head=n_kv_head, head_dim=8, block_size=N, layer_idx=0, n_layer=1, causal=causal
    )


def inputs(n_kv_head: int, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_kv_head, N, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_kv_head, N, 8, generator=g, dtype=torch.float64)
    x = torch.randn(B, N, C, generator=g, dtype=torch.float64)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, x)]


def core(name: str, n_kv_head: int = HQ):
    """The core as the model builds it: a core that reads its layer's query projection (``bind_query``, DMS' decisions)
    gets one (C -> Hq * head_dim, as the model's fused qkv projection starts)."""
    c = build_attention({"name": name}, dims(n_kv_head))
    if hasattr(c, "bind_query"):
        torch.manual_seed(5)
        c.bind_query(torch.nn.Linear(C, HQ * 8).double())
    return c.double()


def test_every_core_has_a_config_and_the_registry_lists_them():
    configs = {p.stem for p in (REPO / "conf/model/attention").glob("*.yaml")}
    assert set(CORES) <= configs, f"cores without conf/model/attention/<name>.yaml: {set(CORES) - configs}"
    assert {"dense", "nats", "anna", "softmax_surrogate"} <= set(CORES)
    assert set(decodable_attention()) == {n for n in CORES if ATTENTIONS.get(n).decode_policy is not None}


@pytest.mark.parametrize("name", CORES)
@pytest.mark.parametrize("n_kv_head", [HQ, 2])
def test_shape_and_causality(name, n_kv_head):
    cls = ATTENTIONS.get(name)
    if n_kv_head != HQ and not cls.supports_gqa:
        with pytest.raises(ValueError, match="grouped-query"):
            core(name, n_kv_head)
        return
    m = core(name, n_kv_head).eval()
    q, k, v, x = inputs(n_kv_head)
    with torch.no_grad():
        out = m(q, k, v, x)
    assert out.y.shape == q.shape and torch.isfinite(out.y).all()
    for value in out.stats.values():
        assert value.dim() == 0 and torch.isfinite(value)
    # the output at positions <= t is independent of the tokens after t
    t = N // 2
    q2, k2, v2, x2 = inputs(n_kv_head, seed=1)
    mixed = [torch.cat([a[..., : t + 1, :], b[..., t + 1 :, :]], dim=-2) for a, b in ((q, q2), (k, k2), (v, v2))]
    mixed.append(torch.cat([x[:, : t + 1], x2[:, t + 1 :]], dim=1))
    with torch.no_grad():
        y2 = m(*mixed).y
    assert torch.allclose(y2[..., : t + 1, :], out.y[..., : t + 1, :], atol=1e-12, rtol=0), name
    assert not torch.allclose(y2[..., t + 1 :, :], out.y[..., t + 1 :, :])  # the later tokens do matter


@pytest.mark.parametrize("name", CORES)
def test_gradients_flow(name):
    torch.manual_seed(0)
    m = core(name, 2 if ATTENTIONS.get(name).supports_gqa else HQ).train()
    q, k, v, x = inputs(m.dims.n_kv_head, requires_grad=True)
    out = m(q, k, v, x)
    loss = (out.y * torch.randn_like(out.y)).sum() + (out.aux_loss if out.aux_loss is not None else 0)
    loss.backward()
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0, (name, label)
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, (name, pname)


def tiny_model(name: str) -> GPT:
    torch.manual_seed(0)
    gqa = 2 if ATTENTIONS.get(name).supports_gqa else None
    cfg = GPTConfig(
        vocab_size=37, block_size=24, n_layer=2, n_head=HQ, n_kv_head=gqa, n_embd=C, attention={"name": name}
    )
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # spread learned scorers (NAtS) so that every kind of token occurs
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", CORES)
def test_decoding_as_declared(name):
    """A core with a decode_policy: decoding through that policy (prefill, then one token at a time) gives the
    model's own forward. A core without one: the cache decoder refuses the model, naming the core."""
    from nats.cache import make_caches, policy_logits

    model = tiny_model(name)
    idx = torch.randint(0, 37, (2, 20), generator=torch.Generator().manual_seed(0))
    policy = ATTENTIONS.get(name).decode_policy
    if policy is None:
        with pytest.raises(ValueError, match=f"attention '{name}'"):
            make_caches(model, "full", 1, 8)
        return
    with torch.no_grad():
        ref = model(idx).logits
    out, _ = policy_logits(model, idx, policy, sequential=True, prefill_len=7)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0), name
