"""ANNA (LSH attention) and the softmax surrogate: semantics against brute force, causality, swapping cores."""

from __future__ import annotations

import math

import pytest
import torch

from nats.attention.anna import AnnaAttention, SoftmaxSurrogateAttention, swap_attention, use_anna
from nats.attention.registry import AttentionDims, available_attention, build_attention
from nats.models.gpt import GPT, GPTConfig


def dims(causal=True, n_head=2, n_kv_head=2, head_dim=8, layer_idx=0, block_size=64):
    return AttentionDims(
        n_embd=n_head * head_dim,
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        block_size=block_size,
        layer_idx=layer_idx,
        n_layer=2,
        causal=causal,
    )


def qkv(B=2, Hq=2, Hkv=2, N=12, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    return q, k, v


def brute_force_anna(core: AnnaAttention, q, k, v):
    """Loop reference: hash every vector bit by bit, build each query's key set, softmax over it."""
    B, Hq, N, D = q.shape
    group = Hq // k.shape[1]
    y = torch.zeros_like(q)

    def code(u, h, t):
        return tuple(int(float(core.planes[h, t, b] @ u) > 0) for b in range(core.z))

    for b in range(B):
        for h in range(Hq):
            hk = h // group
            for i in range(N):
                keys = []
                for j in range(N):
                    if core.dims.causal and j > i:
                        continue
                    if any(code(q[b, h, i], h, t) == code(k[b, hk, j], h, t) for t in range(core.l)):
                        keys.append(j)
                if not keys:
                    if core.empty == "zero":
                        continue
                    keys = [i]
                qi = q[b, h, i] / q[b, h, i].norm()
                s = torch.stack([core.beta * (qi @ (k[b, hk, j] / k[b, hk, j].norm())) for j in keys])
                p = torch.softmax(s, 0)
                y[b, h, i] = sum(p[n] * v[b, hk, j] for n, j in enumerate(keys))
    return y


def test_registered():
    assert {"anna", "softmax_surrogate"} <= set(available_attention())


@pytest.mark.parametrize("causal", [True, False])
def test_surrogate_is_cosine_softmax(causal):
    q, k, v = qkv()
    core = SoftmaxSurrogateAttention(dims(causal), beta=3.0)
    y = core(q, k, v, None).y
    s = 3.0 * torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-1, -2)
    if causal:
        s = s.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(y, torch.softmax(s, -1) @ v, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_z0_is_exactly_the_surrogate(causal):
    """z = 0 hash functions: one bucket, every key collides -> ANNA == surrogate."""
    q, k, v = qkv(N=16)
    anna = AnnaAttention(dims(causal), l=1, z=0, beta=2.5)
    sur = SoftmaxSurrogateAttention(dims(causal), beta=2.5)
    assert anna.collisions(q, k).all()
    out = anna(q, k, v, None)
    torch.testing.assert_close(out.y, sur(q, k, v, None).y, atol=1e-6, rtol=1e-5)
    assert float(out.stats["anna_density"]) == pytest.approx(1.0)
    assert float(out.stats["anna_empty"]) == 0.0


def test_many_tables_every_pair_collides_equals_surrogate():
    """z = 1 with l = 64 tables: all pairs collide (checked), so ANNA equals the surrogate."""
    q, k, v = qkv(N=10)
    anna = AnnaAttention(dims(False), l=64, z=1, beta=4.0, seed=3)
    assert anna.collisions(q, k).all()
    torch.testing.assert_close(
        anna(q, k, v, None).y, SoftmaxSurrogateAttention(dims(False), beta=4.0)(q, k, v, None).y, atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("l,z,empty", [(1, 2, "self"), (2, 3, "self"), (3, 4, "zero"), (1, 5, "zero")])
def test_matches_brute_force(causal, l, z, empty):
    q, k, v = qkv(N=9, seed=l * 10 + z)
    core = AnnaAttention(dims(causal), l=l, z=z, beta=5.0, seed=7, empty=empty)
    mask, isempty = core.attention_mask(q, k)
    assert not mask.all(), "few tables should leave some pairs apart (else the test checks nothing)"
    torch.testing.assert_close(core(q, k, v, None).y, brute_force_anna(core, q, k, v), atol=1e-5, rtol=1e-4)


def test_attends_only_to_colliding_keys():
    """Changing a non-colliding key/value leaves a query's output unchanged."""
    q, k, v = qkv(B=1, Hq=1, Hkv=1, N=10, seed=5)
    core = AnnaAttention(dims(False, n_head=1, n_kv_head=1), l=1, z=3, beta=1.0, seed=1)
    mask, _ = core.attention_mask(q, k)
    i = int((~mask[0, 0]).sum(-1).argmax())  # the query with the most non-colliding keys
    far = (~mask[0, 0, i]).nonzero().flatten()
    assert len(far) > 0
    v2 = v.clone()
    v2[0, 0, far] += 100.0
    torch.testing.assert_close(core(q, k, v2, None).y[0, 0, i], core(q, k, v, None).y[0, 0, i])


def test_grouped_query_attention():
    q, k, v = qkv(Hq=4, Hkv=2, N=8, seed=2)
    core = AnnaAttention(dims(True, n_head=4, n_kv_head=2), l=2, z=2, beta=3.0)
    torch.testing.assert_close(core(q, k, v, None).y, brute_force_anna(core, q, k, v), atol=1e-5, rtol=1e-4)


def test_causal_never_looks_ahead():
    q, k, v = qkv(N=14, seed=4)
    core = AnnaAttention(dims(True), l=2, z=1, beta=2.0)
    mask, _ = core.attention_mask(q, k)
    assert not mask.triu(1).any()
    y = core(q, k, v, None).y
    for t in (3, 9):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t + 1 :] = torch.randn_like(k2[:, :, t + 1 :])
        v2[:, :, t + 1 :] = torch.randn_like(v2[:, :, t + 1 :])
        q2 = q.clone()
        q2[:, :, t + 1 :] = torch.randn_like(q2[:, :, t + 1 :])
        torch.testing.assert_close(core(q2, k2, v2, None).y[:, :, : t + 1], y[:, :, : t + 1])


def test_empty_policy():
    """A query whose only causal key (position 0) does not collide: 'self' -> v_0, 'zero' -> 0."""
    q, k, v = qkv(B=64, Hq=1, Hkv=1, N=1, seed=6)
    d = dims(True, n_head=1, n_kv_head=1)
    selfp, zerop = AnnaAttention(d, l=1, z=2, empty="self"), AnnaAttention(d, l=1, z=2, empty="zero")
    _, empty = selfp.attention_mask(q, k)
    assert empty.any() and not empty.all()
    torch.testing.assert_close(selfp(q, k, v, None).y, v)  # one key: either collides or falls back to itself
    yz = zerop(q, k, v, None).y
    assert torch.all(yz[empty] == 0) and torch.allclose(yz[~empty], v[~empty])
    assert not torch.isnan(yz).any()


def test_planes_are_seeded_per_layer_and_head():
    a = AnnaAttention(dims(layer_idx=0), l=4, z=2, seed=0)
    assert torch.equal(a.planes, AnnaAttention(dims(layer_idx=0), l=4, z=2, seed=0).planes)
    assert not torch.equal(a.planes, AnnaAttention(dims(layer_idx=1), l=4, z=2, seed=0).planes)
    assert not torch.equal(a.planes, AnnaAttention(dims(layer_idx=0), l=4, z=2, seed=1).planes)
    assert not torch.equal(a.planes[0], a.planes[1])  # heads differ
    assert "planes" not in a.state_dict()  # follow from the config; state dicts stay interchangeable


def test_collision_rate_is_angular():
    """Random hyperplanes: two vectors at angle theta collide in one 1-bit table w.p. 1 - theta/pi."""
    D, n = 16, 4000
    core = AnnaAttention(dims(False, n_head=1, n_kv_head=1, head_dim=D), l=1, z=1)
    g = torch.Generator().manual_seed(0)
    hits = []
    for theta in (math.pi / 6, math.pi / 2):
        u = torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=-1)
        w = torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=-1)
        w = torch.nn.functional.normalize(w - (w * u).sum(-1, keepdim=True) * u, dim=-1)
        x = math.cos(theta) * u + math.sin(theta) * w
        cu, cx = core.codes(u[None, None]), core.codes(x[None, None])
        hits.append(float((cu == cx).float().mean()))
    # one fixed plane over many random pairs: the rate is the pair-averaged 1 - theta/pi
    assert hits[0] == pytest.approx(1 - 1 / 6, abs=0.03)
    assert hits[1] == pytest.approx(0.5, abs=0.03)


def _model(name="softmax_surrogate", causal=False, **attn):
    torch.manual_seed(0)
    head = dict(causal=causal, tie_embeddings=False, n_out=2)  # a classifier over the (causal or not) sequence
    cfg = GPTConfig.tiny(
        vocab_size=37, block_size=32, n_head=2, pos_emb="learned", attention={"name": name, **attn}, **head
    )
    return GPT(cfg).eval()


@pytest.mark.parametrize("causal", [True, False])
def test_use_anna_swaps_cores_and_keeps_weights(causal):
    model = _model(causal=causal, beta=3.0)
    x = torch.randint(0, 37, (3, 20))
    ref = model(x).logits
    full = use_anna(model, l=1, z=0)  # one bucket: the same function
    assert all(isinstance(b.attn.core, AnnaAttention) and b.attn.core.beta == 3.0 for b in full.blocks)
    assert all(
        isinstance(b.attn.core, SoftmaxSurrogateAttention) and not isinstance(b.attn.core, AnnaAttention)
        for b in model.blocks
    ), "the original is untouched"
    torch.testing.assert_close(full(x).logits, ref, atol=1e-5, rtol=1e-5)
    sparse = use_anna(model, l=1, z=4, seed=1)
    assert sparse.config.attention["name"] == "anna" and sparse.config.attention["l"] == 1
    assert not torch.allclose(sparse(x).logits, ref)
    assert not sparse.training
    # layers get different planes
    assert not torch.equal(sparse.blocks[0].attn.core.planes, sparse.blocks[1].attn.core.planes)


def test_surrogate_state_dict_loads_into_anna_model():
    sur = _model(beta=2.0)
    anna = _model("anna", beta=2.0, l=8, z=1)
    anna.load_state_dict(sur.state_dict())  # strict: no extra keys for the planes


def test_use_anna_needs_beta_for_other_cores():
    model = _model("dense")
    with pytest.raises(ValueError, match="beta"):
        use_anna(model, l=2, z=1)
    assert isinstance(use_anna(model, l=2, z=1, beta=1.0).blocks[0].attn.core, AnnaAttention)


def test_swap_keeps_output_gate_and_backprop_through_surrogate():
    model = _model(beta=1.0, output_gate="headwise").train()
    x = torch.randint(0, 37, (2, 16))
    y = torch.randint(0, 2, (2, 16))
    model(x, y).loss.backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None
    swapped = swap_attention(model, {"name": "anna", "l": 2, "z": 1, "beta": 1.0})
    assert swapped.config.attention["output_gate"] == "headwise"
    assert swapped.blocks[0].attn.output_gate == "headwise"


def test_build_from_config_and_bad_args():
    d = dims()
    assert isinstance(build_attention({"name": "anna", "l": 2, "z": 1, "beta": 10.0}, d), AnnaAttention)
    with pytest.raises(ValueError):
        AnnaAttention(d, l=0)
    with pytest.raises(ValueError):
        AnnaAttention(d, empty="nothing")
    with pytest.raises(ValueError):
        SoftmaxSurrogateAttention(d, beta=0.0)
