"""Gated attention (output gate): a gate fixed at 1 is the ungated model; the diagnostics (first-token
attention share, mean gate) against direct computation; the gate-study configs."""

from __future__ import annotations

import math

import pytest
import torch

from nats.analysis import AttentionSinkMonitor, attention_diagnostics, dataset_diagnostics
from nats.attention.registry import available_attention
from nats.models.gpt import GPT, GPTConfig

CORES = ["dense", "softmax_surrogate", "nats"]


def config(core="dense", gate="none", bias=True, causal=True, n_kv_head=None, **attn):
    extra = {"beta": 2.0} if core == "softmax_surrogate" else {}
    return GPTConfig(
        vocab_size=97,
        block_size=32,
        n_layer=2,
        n_head=4,
        n_kv_head=n_kv_head,
        n_embd=32,
        bias=bias,
        causal=causal,
        attention={"name": core, "output_gate": gate, **extra, **attn},
    )


def pair(core="dense", gate="headwise", **kw):
    """(ungated, gated) models sharing every weight; the gated one's gate is fixed at exactly 1."""
    if core not in available_attention():
        pytest.skip(f"attention core {core!r} does not exist yet")
    torch.manual_seed(0)
    plain = GPT(config(core, "none", **kw)).eval()
    torch.manual_seed(1)
    gated = GPT(config(core, gate, **kw)).eval()
    missing, unexpected = gated.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(".attn.gate." in m for m in missing) and missing
    for block in gated.blocks:
        torch.nn.init.zeros_(block.attn.gate.weight)
        torch.nn.init.constant_(block.attn.gate.bias, 100.0)  # sigmoid(100) == 1.0 in float32
    return plain, gated


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@pytest.mark.parametrize("causal", [True, False])
def test_gate_fixed_at_one_is_the_ungated_model(core, gate, causal):
    if core == "nats" and not causal:
        pytest.skip("NAtS is causal only")
    plain, gated = pair(core, gate, causal=causal)
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        assert bool((torch.sigmoid(gated.blocks[0].attn.gate(torch.randn(3, 32))) == 1.0).all())
        torch.testing.assert_close(gated(x).logits, plain(x).logits, atol=0, rtol=0)


def test_gate_fixed_at_one_with_grouped_query_attention():
    plain, gated = pair("dense", "elementwise", n_kv_head=2)
    x = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(gated(x).logits, plain(x).logits, atol=0, rtol=0)


def test_half_gate_halves_the_attention_output():
    """sigmoid(0) = 0.5 on every head = the ungated model with the output projection halved."""
    plain, gated = pair("dense", "headwise")
    for gb, pb in zip(gated.blocks, plain.blocks):
        torch.nn.init.zeros_(gb.attn.gate.bias)
        with torch.no_grad():
            pb.attn.proj.weight.mul_(0.5)
    x = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(gated(x).logits, plain(x).logits, atol=1e-5, rtol=1e-5)


def test_headwise_gate_can_close_one_head():
    """Closing head h (gate -> 0) removes exactly head h's channels from the output projection's input."""
    plain, gated = pair("dense", "headwise")
    h, D = 2, 8
    for gb, pb in zip(gated.blocks, plain.blocks):
        with torch.no_grad():
            gb.attn.gate.bias[h] = -100.0  # sigmoid(-100) ~ 4e-44: closed
            pb.attn.proj.weight[:, h * D : (h + 1) * D] = 0.0
    x = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(gated(x).logits, plain(x).logits, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- diagnostics
def manual_dense_diagnostics(model, idx):
    """First-token share and gate mean by re-running the blocks by hand (dense cores only)."""
    B, N = idx.shape
    positions = torch.arange(N)
    x = model.embed(idx, positions)
    shares, gates = [], []
    for block in model.blocks:
        h = block.ln_1(x)
        q, k, v = block.attn.project(h, model.rope, positions)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if model.config.causal:
            s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
        shares.append(float(torch.softmax(s, -1)[..., 0].mean()))
        gates.append(float(torch.sigmoid(block.attn.gate(h)).mean()) if block.attn.output_gate != "none" else math.nan)
        x, _ = block(x, model.rope, positions)
    return shares, gates


@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
@pytest.mark.parametrize("causal", [True, False])
def test_diagnostics_match_direct_computation(gate, causal):
    torch.manual_seed(0)
    model = GPT(config("dense", gate, causal=causal, n_kv_head=2)).eval()
    idx = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        d = attention_diagnostics(model, idx)
        shares, gates = manual_dense_diagnostics(model, idx)
    assert d["first_token_share"] == pytest.approx(shares, abs=1e-6)
    if gate == "none":
        assert all(math.isnan(g) for g in d["gate_mean"])
    else:
        assert d["gate_mean"] == pytest.approx(gates, abs=1e-6)
        assert all(0 < g < 1 for g in d["gate_mean"])


def test_first_token_share_of_the_first_query_is_one():
    torch.manual_seed(0)
    model = GPT(config("dense")).eval()
    one = attention_diagnostics(model, torch.randint(0, 97, (2, 1)))
    assert one["first_token_share"] == pytest.approx([1.0, 1.0])
    idx = torch.randint(0, 97, (2, 16))
    full = attention_diagnostics(model, idx)["first_token_share"]
    skip = attention_diagnostics(model, idx, skip_first=True)["first_token_share"]
    assert all(f == pytest.approx((1 + 15 * s) / 16, abs=1e-6) for f, s in zip(full, skip))


def test_diagnostics_through_the_core_for_sparse_cores():
    """The probe reads P[i, 0] of ANNA (masked softmax) too, not a dense stand-in."""
    from nats.attention.anna import use_anna

    torch.manual_seed(0)
    model = GPT(config("softmax_surrogate", causal=False)).eval()
    anna = use_anna(model, l=1, z=3, seed=0)
    idx = torch.randint(0, 97, (2, 20))
    got = attention_diagnostics(anna, idx)["first_token_share"]
    positions = torch.arange(20)
    with torch.no_grad():
        x = anna.embed(idx, positions)
        for layer, block in enumerate(anna.blocks):
            q, k, _ = block.attn.project(block.ln_1(x), anna.rope, positions)
            core = block.attn.core
            mask, _ = core.attention_mask(q, k)
            p = torch.softmax(core.scores(q, k).masked_fill(~mask, -math.inf), -1)
            assert got[layer] == pytest.approx(float(p[..., 0].mean()), abs=1e-6)
            x, _ = block(x, anna.rope, positions)


def test_diagnostics_run_on_nats():
    if "nats" not in available_attention():
        pytest.skip("no nats core yet")
    torch.manual_seed(0)
    model = GPT(config("nats", "elementwise")).eval()
    d = attention_diagnostics(model, torch.randint(0, 97, (2, 24)))
    assert all(0 < s <= 1 for s in d["first_token_share"]) and all(0 < g < 1 for g in d["gate_mean"])


def test_dataset_diagnostics_weights_batches_and_restores_mode():
    torch.manual_seed(0)
    model = GPT(config("dense", "headwise")).train()
    a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (3, 12))
    d = dataset_diagnostics(model, [(a, None), (b, None)])
    da, db = attention_diagnostics(model, a), attention_diagnostics(model, b)
    for key in d:
        assert d[key] == pytest.approx([(x + 3 * y) / 4 for x, y in zip(da[key], db[key])], abs=1e-9)
    assert model.training


# ---------------------------------------------------------------------- configs and logging
def compose(overrides):
    from nats.train import compose_config

    return compose_config(overrides + ["paths.output_dir=/tmp/nats_test_gated"])


@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
def test_gate_study_config_composes(gate):
    from omegaconf import OmegaConf

    cfg = compose(["experiment=gate_study", f"model.attention.output_gate={gate}"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert model["attention"] == {"name": "dense", "output_gate": gate}
    GPTConfig.from_dict(model)
    assert cfg.callbacks.attention_sink._target_ == "nats.analysis.AttentionSinkMonitor"
    assert cfg.data._target_.endswith("TokenDataModule")  # the default (gutenberg) data


@pytest.mark.parametrize("name,gate", [("gated_headwise", "headwise"), ("gated_elementwise", "elementwise")])
def test_gated_attention_group_configs(name, gate):
    cfg = compose([f"model/attention={name}"])
    assert cfg.model.attention.name == "dense" and cfg.model.attention.output_gate == gate


def test_attention_sink_monitor_logs_in_validation():
    from nats.train import build

    cfg = compose(
        [
            "experiment=anna_match2",
            "debug=default",
            "data.n_train=64",
            "data.n_test=32",
            "model.attention.output_gate=headwise",
            "+callbacks.attention_sink._target_=nats.analysis.AttentionSinkMonitor",
        ]
    )
    datamodule, module, trainer = build(cfg)
    assert any(isinstance(c, AttentionSinkMonitor) for c in trainer.callbacks)
    trainer.fit(module, datamodule=datamodule)
    m = trainer.callback_metrics
    assert 0 < float(m["val/first_token_share"]) <= 1 and 0 < float(m["val/gate_mean"]) < 1
    assert "val_layers/layer0/first_token_share" in m
