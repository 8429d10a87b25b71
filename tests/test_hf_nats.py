"""nats.hf: NAtS attached to tiny random transformers Llama / Mistral / Qwen2 models.

(a) all tokens global == the original model; (b) local/sliding types == a dense masked softmax over
nats.functional.nats_mask of the recorded types; (c) only scorers get gradients, the density is differentiable in
them; (d) unsupported architectures are refused; (e) attach twice, detach, scorer state_dict round trip; greedy
generate (cache, non-evicting decode) == the parallel forward token for token.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from nats import functional as NF  # noqa: E402
from nats.hf import attach_nats, detach_nats, nats_density, nats_stats, scorers, set_force_type  # noqa: E402
from nats.hf.scorers import load_nats_state_dict, nats_state_dict  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHS = ["llama", "mistral", "qwen2"]


def tiny_model(arch: str, seed: int = 0):
    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[arch]
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(**TINY)
    cfg._attn_implementation = "eager"
    return cls(cfg).eval()


def ids(n: int = 24, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("how", ["force", "zero_weights"])
def test_all_global_equals_original(arch, how):
    model = tiny_model(arch)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    attach_nats(model, window=4)
    assert model.config._attn_implementation == "nats"
    if how == "force":
        set_force_type(model, NF.TOKEN_GLOBAL)
    else:  # equal logits: argmax takes the first type, global
        for s in scorers(model):
            torch.nn.init.zeros_(s.scorer.weight)
    with torch.no_grad():
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    stats = nats_stats(model)
    assert stats["frac_global"].shape == (2, 2) and torch.allclose(stats["frac_global"], torch.ones(2, 2))


def _masked_reference(model, x, types_per_layer, window):
    """The original model with a dense masked softmax over nats_mask(recorded types) as its attention."""

    def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        types = types_per_layer[module.layer_idx]  # [B, Hkv, N]
        mask = NF.nats_mask(types, window)  # [B, Hkv, N, N]
        rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(rep, 1)
        v = value.repeat_interleave(rep, 1)
        s = (query @ k.transpose(-1, -2)) * scaling
        s = s.masked_fill(~mask.repeat_interleave(rep, 1), float("-inf"))
        return (F.softmax(s, -1) @ v).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("nats_test_masked", masked_attention)
    model.config._attn_implementation = "nats_test_masked"
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_types_equal_masked_reference(arch):
    window = 3
    model = tiny_model(arch)
    attach_nats(model, window=window, init_std=0.5)
    x = ids(n=32)
    types = {}
    with torch.no_grad():
        out = model(x).logits
    for i, s in enumerate(scorers(model)):
        types[i] = s.past_types.clone()  # eval mode: the hard types of the prefill, [B, Hkv, N]
        assert types[i].shape == (2, 2, 32)
    all_types = torch.stack(list(types.values()))
    for t in (NF.TOKEN_GLOBAL, NF.TOKEN_LOCAL, NF.TOKEN_SLIDING):  # the test exercises every type
        assert (all_types[..., 1:] == t).any()
    assert (all_types[..., 0] == NF.TOKEN_GLOBAL).all()
    stats = nats_stats(model)
    assert (stats["density"] < 1).all()
    state = model._nats_hf
    model.config._attn_implementation = state["attn_implementation"]
    ref = _masked_reference(model, x, types, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # and it differs from dense attention (the mask matters)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        dense = model(x).logits
    assert (out - dense).abs().max() > 1e-3


def test_forced_local_and_sliding_match_reference():
    window = 4
    model = tiny_model("llama")
    attach_nats(model, window=window)
    x = ids(n=20)
    for forced in (NF.TOKEN_LOCAL, NF.TOKEN_SLIDING):
        set_force_type(model, forced)
        model.config._attn_implementation = "nats"
        with torch.no_grad():
            out = model(x).logits
        types = torch.full((2, 2, 20), forced)
        types[..., 0] = NF.TOKEN_GLOBAL
        ref = _masked_reference(model, x, {0: types, 1: types}, window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_only_scorers_get_gradients_and_density_is_differentiable(arch):
    model = tiny_model(arch)
    attach_nats(model, window=4, init_std=0.5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.self_attn.nats_scorer.scorer.weight" for i in range(2)}
    model.train()
    torch.manual_seed(0)
    out = model(ids(n=16))
    rho = nats_density(model)
    assert rho.dim() == 0 and 0 < float(rho.detach()) <= 1
    (out.logits.float().pow(2).mean() + 0.5 * rho).backward()
    for n, p in model.named_parameters():
        if n in trainable:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    # the density alone has a gradient in the scorer weights
    model.zero_grad()
    model(ids(n=16))
    g = torch.autograd.grad(nats_density(model), [s.scorer.weight for s in scorers(model)])
    assert all(gi.abs().sum() > 0 for gi in g)


def test_argmax_density_in_training_is_the_inference_density():
    """nats_density(model, argmax=True) after a training forward is the density of the argmax types: layer 0 (whose
    input does not depend on the sampled types of earlier layers) equals an eval forward's density; the sampled
    density differs; in eval both are the same."""
    model = tiny_model("llama")
    attach_nats(model, window=4, init_std=0.05)  # small logits: unsure scorers, samples far from the argmax
    x = ids(n=64, b=4)
    model.eval()
    model(x)
    eval_layer0 = scorers(model)[0].last_density.clone()
    assert torch.equal(nats_density(model, argmax=True), nats_density(model))
    model.train()
    torch.manual_seed(0)
    model(x)
    first = scorers(model)[0]
    assert not first.last_density_argmax.requires_grad and first.last_density.requires_grad
    torch.testing.assert_close(first.last_density_argmax, eval_layer0)
    assert not torch.allclose(first.last_density.detach(), eval_layer0)
    assert float(nats_density(model, argmax=True)) != float(nats_density(model).detach())


def test_noise_scale_zero_trains_on_the_inference_types():
    """noise_scale = 0 (NoiseSchedule's end): a training forward takes the argmax types, so the density the loss
    sees is the inference density of every layer, and it still has a (straight-through) gradient in the scorers;
    noise_scale is passed through attach_nats and set on every scorer."""
    model = tiny_model("llama")
    attach_nats(model, window=4, init_std=0.05, noise_scale=0.0)
    assert [s.noise_scale for s in scorers(model)] == [0.0, 0.0]
    x = ids(n=64, b=4)
    model.eval()
    model(x)
    eval_density = [s.last_density.clone() for s in scorers(model)]
    model.train()
    torch.manual_seed(0)
    model(x)
    for s, ev in zip(scorers(model), eval_density):
        assert s.last_density.requires_grad
        torch.testing.assert_close(s.last_density.detach(), ev)
    g = torch.autograd.grad(nats_density(model), [s.scorer.weight for s in scorers(model)])
    assert all(gi.abs().sum() > 0 for gi in g)
    for s in scorers(model):
        s.noise_scale = 1.0  # the spec's noise again: the same seed now samples other types
    torch.manual_seed(0)
    model(x)
    assert not torch.allclose(scorers(model)[0].last_density.detach(), eval_density[0])


def test_unsupported_architecture_is_refused():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama, mistral, qwen2"):
        attach_nats(model)
    with pytest.raises(ValueError, match="unsupported architecture"):
        attach_nats(torch.nn.Linear(2, 2))


def test_attach_twice_detach_and_state_dict_round_trip():
    model = tiny_model("llama")
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    attach_nats(model, window=4, init_std=0.5)
    with pytest.raises(ValueError, match="already attached"):
        attach_nats(model)
    with torch.no_grad():
        out = model(x).logits
    sd = nats_state_dict(model)
    assert set(sd) == {f"model.layers.{i}.self_attn.nats_scorer.scorer.weight" for i in range(2)}
    assert sd["model.layers.0.self_attn.nats_scorer.scorer.weight"].shape == (3 * 2, 64)

    other = attach_nats(tiny_model("llama"), window=4)  # same backbone (seed), fresh scorers
    with torch.no_grad():
        assert not torch.allclose(other(x).logits, out)
    load_nats_state_dict(other, {k: v.clone() for k, v in sd.items()})
    with torch.no_grad():
        torch.testing.assert_close(other(x).logits, out)
    with pytest.raises(KeyError, match="missing"):
        load_nats_state_dict(other, {})
    # the full state dict carries the scorers too
    assert set(sd) <= set(model.state_dict())

    detach_nats(model)
    assert model.config._attn_implementation == "eager"
    assert not any("nats_scorer" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref)
    attach_nats(model, window=4)  # attaching again after detach works
    assert model.config._attn_implementation == "nats"


def test_padded_batch_is_refused():
    model = attach_nats(tiny_model("llama"), window=4)
    x = ids(n=8)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with pytest.raises(NotImplementedError, match="padded"):
        model(x, attention_mask=mask)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_generate_equals_parallel_forward(arch):
    """Decode steps with transformers' cache (no eviction) attend over exactly the NAtS mask rows."""
    model = attach_nats(tiny_model(arch), window=3, init_std=0.5)
    prompt = ids(n=12, b=1)
    with torch.no_grad():
        gen = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, min_new_tokens=10
        )
        decoded_types = [s.past_types.clone() for s in scorers(model)]  # [1, Hkv, 21]: prompt + fed-back tokens
        full = model(gen).logits  # the parallel forward over prompt + generated tokens
    assert gen.shape == (1, 22)
    for s, t in zip(scorers(model), decoded_types):  # the decode steps typed each token as the prefill does
        assert torch.equal(t, s.past_types[..., :21])
    greedy = full[:, prompt.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(greedy, gen[:, prompt.shape[1] :])


def test_scaling_other_than_inverse_sqrt_head_dim():
    model = attach_nats(tiny_model("llama"), window=4)
    set_force_type(model, NF.TOKEN_GLOBAL)
    x = ids()
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.5 / math.sqrt(16)
    with torch.no_grad():
        out = model(x).logits
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_type_bias_moves_the_inference_types_only():
    """`set_type_bias` offsets the logits before the argmax of eval mode: a global offset turns tokens global in the
    prefill and the decode steps alike (greedy generate still equals the parallel forward), a large sliding one
    makes every token but token 0 sliding; training types and the saved scorers are untouched."""
    from nats.attention.nats import set_type_bias

    model = attach_nats(tiny_model("llama"), window=3, init_std=0.5)
    x = ids(n=16, b=1)

    def globals_now():
        with torch.no_grad():
            model(x)
        return sum(int((s.past_types == NF.TOKEN_GLOBAL).sum()) for s in scorers(model))

    base = globals_now()
    assert set_type_bias(model, [1.0, 0.0, 0.0]) == 2  # one core per layer
    more = globals_now()
    assert more > base
    set_type_bias(model, [0.0, 0.0, 100.0])
    globals_now()
    for s in scorers(model):
        assert (s.past_types[..., 1:] == NF.TOKEN_SLIDING).all() and (s.past_types[..., 0] == NF.TOKEN_GLOBAL).all()
    set_type_bias(model, [0.7, 0.0, 0.0])
    with torch.no_grad():
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        decoded = [s.past_types.clone() for s in scorers(model)]
        full = model(gen).logits
    for s, t in zip(scorers(model), decoded):
        assert torch.equal(t, s.past_types[..., : t.shape[-1]])
    assert torch.equal(full[:, x.shape[1] - 1 : -1].argmax(-1), gen[:, x.shape[1] :])
    s0 = scorers(model)[0]
    z = torch.randn(1, 16, TINY["hidden_size"])
    s0.train()
    assert torch.equal(s0.type_logits(z), s0.scorer(z).float().view(1, 16, 2, 3).transpose(1, 2))
    s0.eval()
    assert not torch.equal(s0.type_logits(z), s0.scorer(z).float().view(1, 16, 2, 3).transpose(1, 2))
    assert not any("type_bias" in k for k in nats_state_dict(model))
    set_type_bias(model, None)
    assert globals_now() == base
    for bad in ([1.0, 2.0], [float("nan"), 0, 0]):
        with pytest.raises(ValueError, match="3 finite numbers"):
            set_type_bias(model, bad)


def test_importing_nats_hf_registers_the_attention_function_the_hooks_select():
    """The hooks (nats.hf.hooks, apart from the attention function: no import cycle) select the name under which
    importing nats.hf registered the attention function."""
    from nats.hf import attention, hooks

    assert hooks.ATTN_IMPLEMENTATION == attention.ATTN_IMPLEMENTATION
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS[hooks.ATTN_IMPLEMENTATION]  # what the model calls
    # the function itself, or a wrapper of it (kvpress' import wraps every registered attention function)
    inner = [c.cell_contents for c in registered.__closure__ or ()]
    assert registered is attention.nats_attention_forward or attention.nats_attention_forward in inner


def test_query_rescaling_compiles_fullgraph_across_scalings():
    """The query's rescaling to the model's attention scale stays in one compiled graph when a second model (another
    scaling) recompiles the step and dynamo traces the scaling as a symbolic float (math.isclose broke it there),
    and scales only where the model's scaling is not 1/sqrt(D)."""
    from nats.hf.attention import rescaled

    class Attn(torch.nn.Module):
        def __init__(self, scaling):
            super().__init__()
            self.scaling = scaling

        def forward(self, q):
            return rescaled(q, self.scaling, 64)

    torch._dynamo.reset()
    step = torch.compile(lambda m, q: m(q), fullgraph=True, backend="eager")
    q = torch.ones(2)
    for scaling, factor in ((0.125, 1.0), (0.25, 2.0), (0.5, 4.0), (0.125, 1.0), (None, 1.0)):
        assert torch.equal(step(Attn(scaling), q), q * factor), scaling
