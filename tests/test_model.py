"""The GPT model: shapes, causality, GQA, positions, the output gate, the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.models.gpt import GPT, GPTConfig, OutputGate


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


def test_retired_config_key_is_one_error():
    """A model config saved before lse_cross_entropy was retired is one line naming the key that replaced it."""
    with pytest.raises(ValueError) as err:
        GPTConfig.from_dict({"n_layer": 2, "lse_cross_entropy": True})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(
        "retired model config keys: model.lse_cross_entropy (now model.fused_cross_entropy); delete them from the "
        "config"
    )
    with pytest.raises(ValueError, match="unknown model config keys"):
        GPTConfig.from_dict({"n_layr": 2})


def test_output_gate_shapes():
    for gate in ("headwise", "elementwise"):
        model = small(attention={"name": "dense", "output_gate": gate})
        assert model(torch.randint(0, 101, (1, 9))).logits.shape == (1, 9, 101)
        gate_module = model.blocks[0].attn.gate
        assert isinstance(gate_module, OutputGate) and gate_module.kind == gate
        assert gate_module.weight.shape == ((4, 32) if gate == "headwise" else (32, 32))
    assert small().blocks[0].attn.gate is None
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
