"""The GPT model: shapes, causality, GQA, positions, the LSE cross-entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.models.gpt import GPT, GPTConfig, LSECrossEntropy


def small(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=101, block_size=40, n_layer=2, n_head=4, n_embd=32, **kw)).eval()


@pytest.mark.parametrize("pos_emb", ["rope", "learned", "none"])
@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_causal_and_shapes(pos_emb, n_kv_head):
    model = small(pos_emb=pos_emb, n_kv_head=n_kv_head)
    x = torch.randint(0, 101, (2, 33))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 101, (2, 13))
    a, b = model(x).logits, model(y).logits
    assert a.shape == (2, 33, 101)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5) and not torch.allclose(a[:, 20:], b[:, 20:])


def test_gpt2_small_shape_and_init():
    model = GPT(GPTConfig())
    n = sum(p.numel() for p in model.parameters())
    assert n == 123_587_328 + 0  # 124M with tied embeddings, no biases, RoPE (no position table)
    assert model.lm_head.weight is model.wte.weight
    std = model.blocks[0].mlp.proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * 12) ** 0.5, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_rope_is_relative():
    """RoPE: scores depend only on the offset between positions."""
    model = small()
    rope = model.rope
    q = torch.randn(1, 1, 1, 8).expand(1, 30, 1, 8)  # [B, N, H, D]: one vector at every position
    k = torch.randn(1, 1, 1, 8).expand(1, 30, 1, 8)
    pos = torch.arange(30)
    rq, rk = rope(q, pos), rope(k, pos)
    s = torch.einsum("bnhd,bmhd->nm", rq, rk)
    assert torch.allclose(s[5, 2], s[25, 22], atol=1e-5) and torch.allclose(s[9, 9], s[0, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lse_cross_entropy_matches_torch(dtype):
    torch.manual_seed(1)
    x = torch.randn(37, 101, dtype=dtype, requires_grad=True)
    t = torch.randint(0, 101, (37,))
    t[::5] = -100
    a = LSECrossEntropy.apply(x, t)
    b = F.cross_entropy(x, t, ignore_index=-100)
    ga, = torch.autograd.grad(a * 1.7, x)
    gb, = torch.autograd.grad(b * 1.7, x)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(a.item() - b.item()) < tol and (ga - gb).abs().max() < tol
    x64 = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    t5 = torch.tensor([1, -100, 3, 0, 6])
    assert torch.autograd.gradcheck(lambda z: LSECrossEntropy.apply(z, t5), (x64,))


def test_model_loss_impls_agree():
    a, b = small(), small(lse_cross_entropy=True)
    x = torch.randint(0, 101, (2, 30))
    assert a(x, x).loss.item() == pytest.approx(b(x, x).loss.item(), rel=1e-6)


def test_output_gate_shapes():
    for gate in ("headwise", "elementwise"):
        model = small(attention={"name": "dense", "output_gate": gate})
        assert model(torch.randint(0, 101, (1, 9))).logits.shape == (1, 9, 101)
    with pytest.raises(ValueError, match="output_gate"):
        small(attention={"name": "dense", "output_gate": "bogus"})


def test_logits_detached_when_targets_given():
    """With targets the loss carries the gradient and the logits are detached (a compiled graph would otherwise
    get a zero [B, N, V] tangent for them); the gradients equal those of a CE over the attached logits."""
    model = small().train()
    x, y = torch.randint(0, 101, (2, 17)), torch.randint(0, 101, (2, 17))
    out = model(x, y)
    assert out.loss.requires_grad and not out.logits.requires_grad
    assert all(not v.requires_grad for v in out.stats.values())
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    free = model(x).logits
    assert free.requires_grad  # without targets the logits stay differentiable
    ref = torch.autograd.grad(F.cross_entropy(free.flatten(0, 1), y.flatten()), list(model.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
