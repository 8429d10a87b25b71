"""The `nats` attention core in the model: types, determinism, gradients, sparsity objective, logging."""

from __future__ import annotations

import pytest
import torch

from conftest import compose
from nats import functional as NF
from nats.attention.nats import NAtSAttention, collect_types, kv_report, kv_stats
from nats.models.gpt import GPT, GPTConfig
from nats.train import run


def tiny_nats(**attention) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(attention={"name": "nats", "window": 4, **attention}))


def test_eval_is_deterministic_and_token0_global():
    model = tiny_nats().eval()
    x = torch.randint(0, 97, (3, 40))
    a, b = model(x).logits, model(x).logits
    assert torch.equal(a, b)
    types = collect_types(model, x)
    assert set(types) == {0, 1}
    for t in types.values():
        assert t.shape == (3, 2, 40) and (t[..., 0] == NF.TOKEN_GLOBAL).all()
        # eval types are the argmax of the scorer logits (no noise)
    core = model.blocks[0].attn.core
    xn = model.blocks[0].ln_1(model.embed(x, torch.arange(40)))
    expect = core.type_logits(xn).argmax(-1)
    expect[..., 0] = NF.TOKEN_GLOBAL
    assert torch.equal(types[0], expect)


def test_training_types_are_noisy_straight_through():
    model = tiny_nats(sparsity_lambda=1.0).train()
    core: NAtSAttention = model.blocks[0].attn.core
    z = torch.randn(2, 2, 30, 3, requires_grad=True)
    torch.manual_seed(1)
    t1 = core.type_weights(z)
    torch.manual_seed(2)
    t2 = core.type_weights(z)
    assert not torch.equal(t1, t2)  # Gumbel noise in training
    hard = t1.detach()
    assert torch.equal(hard, torch.nn.functional.one_hot(hard.argmax(-1), 3).float())  # one-hot in value
    assert (hard[..., 0, 0] == 1).all()
    (t1 * torch.randn_like(t1)).sum().backward()
    assert z.grad[..., 1:, :].abs().sum() > 0  # straight-through gradient to the logits
    assert z.grad[..., 0, :].abs().sum() == 0  # token 0 is forced global without gradient


def test_noise_scale_scales_the_gumbel_noise():
    """type_weights samples argmax(z + s G): s = 1 is the spec's formula with the same draws, s = 0 the argmax
    types (with the straight-through gradient of softmax(z / tau)); s is checked and settable in place."""
    model = tiny_nats().train()
    core: NAtSAttention = model.blocks[0].attn.core
    assert core.noise_scale == 1.0
    z = torch.randn(2, 2, 30, 3, requires_grad=True)
    torch.manual_seed(3)
    t1 = core.type_weights(z)
    torch.manual_seed(3)
    gumbel = -torch.empty_like(z).exponential_().log()
    expect = torch.nn.functional.one_hot((z + gumbel).argmax(-1), 3).float()
    assert torch.equal(t1.detach()[..., 1:, :], expect[..., 1:, :])
    core.noise_scale = 0.0
    assert core.noise_buf.item() == 0.0
    t0 = core.type_weights(z)
    assert torch.equal(t0.detach(), core.argmax_weights(z))
    assert not torch.equal(t0.detach(), t1.detach())
    (t0 * torch.randn_like(t0)).sum().backward()
    assert z.grad[..., 1:, :].abs().sum() > 0  # straight-through, no noise
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="noise_scale must be >= 0"):
            core.noise_scale = bad
        with pytest.raises(ValueError, match="noise_scale must be >= 0"):
            tiny_nats(noise_scale=bad)


def test_future_tokens_do_not_change_the_past():
    model = tiny_nats().eval()
    x = torch.randint(0, 97, (2, 40))
    y = x.clone()
    y[:, 25:] = torch.randint(0, 97, (2, 15))
    assert torch.allclose(model(x).logits[:, :25], model(y).logits[:, :25], atol=1e-5)


def test_all_global_scorer_equals_dense():
    nats = tiny_nats().eval()
    dense = GPT(GPTConfig(**{**nats.config.to_dict(), "attention": {"name": "dense"}})).eval()
    state = {k: v for k, v in nats.state_dict().items() if "scorer" not in k}
    dense.load_state_dict(state)
    for blk in nats.blocks:  # logits (+inf, 0, 0): every token global
        with torch.no_grad():
            blk.attn.core.scorer.weight.zero_()
    x = torch.randint(0, 97, (2, 40))
    assert torch.allclose(nats(x).logits, dense(x).logits, atol=1e-5)


def test_sparsity_loss_and_scorer_gradient():
    model = tiny_nats(sparsity_lambda=0.5).train()
    x = torch.randint(0, 97, (2, 40))
    out = model(x, x)
    assert out.aux_loss is not None and out.aux_loss > 0
    dens = torch.stack([out.stats[f"layer{i}/density"] for i in range(2)]).mean()
    assert out.aux_loss.item() == pytest.approx(0.5 * dens.item(), rel=1e-5)
    (out.loss + out.aux_loss).backward()
    for blk in model.blocks:
        assert blk.attn.core.scorer.weight.grad.abs().sum() > 0
    # the scorer input is detached by default: the sparsity term alone sends no gradient to the backbone
    model.zero_grad()
    model(x, x).aux_loss.backward()
    assert model.wte.weight.grad is None or model.wte.weight.grad.abs().sum() == 0
    assert model.eval()(x, x).aux_loss is None  # no sparsity term in evaluation


def test_stats_and_report_match_the_mask():
    model = tiny_nats().eval()
    x = torch.randint(0, 97, (2, 40))
    out = model(x)
    for name in ("density", "peak", "frac_global", "frac_local", "frac_sliding"):
        assert f"layer0/{name}" in out.stats
    types = collect_types(model, x)[1]
    mask = NF.nats_mask(types, 4)
    area, peak = NF.kv_fractions(mask)
    assert out.stats["layer1/density"].item() == pytest.approx(area, rel=1e-6)
    report = kv_report(model, x)
    assert report["density"].shape == (2, 2)  # [layers, kv heads]
    per_head = kv_stats(types, 4)
    assert torch.allclose(report["density"][1], per_head["density"].mean(0))
    fr = report["frac_global"] + report["frac_local"] + report["frac_sliding"]
    assert torch.allclose(fr, torch.ones_like(fr))


def test_bad_window_and_noncausal():
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        tiny_nats(window=0)
    cfg = GPTConfig(
        vocab_size=97, block_size=16, n_layer=1, n_head=2, n_embd=16, causal=False, attention={"name": "nats"}
    )
    with pytest.raises(ValueError, match="causal only"):
        GPT(cfg)(torch.zeros(1, 8, dtype=torch.long))


def _final_density(tmp_path, lam: float) -> float:
    overrides = [
        "model/attention=nats",
        f"model.attention.sparsity_lambda={lam}",
        "model.attention.window=4",
        "model.block_size=64",
        "data.micro_batch_size=4",
        "global_batch_size=4",
        "trainer.max_steps=40",
        "optim.warmup_steps=5",
        "optim.lr=3e-3",
        "eval_every=40",
        "data.max_eval_windows=8",
        "logger=csv",
        "callbacks.progress_bar=null",
        "callbacks.throughput=null",
        "seed=3",
    ]
    metrics = run(compose(overrides, tmp_path / str(lam)))
    return metrics["val/density"]


def test_lambda_lowers_density(tmp_path):
    """A short CPU training run: lambda > 0 ends with a lower (validation, hard-type) density than lambda = 0."""
    d0 = _final_density(tmp_path, 0.0)
    d1 = _final_density(tmp_path, 2.0)
    assert d1 < d0 - 0.05, (d0, d1)
