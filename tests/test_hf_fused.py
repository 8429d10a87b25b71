"""`nats.hf.fuse_projections`: one q/k/v product and one gate/up product per layer give the unfused model's logits
and greedy tokens (transformers' caches and the project's, eager and compiled), keep its parameters and bytes, and
remove three matrix products per layer from the compiled decode step."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402
from test_hf_static_cache import greedy, nats_model  # noqa: E402

from nats.cache import roofline  # noqa: E402
from nats.hf import StaticPolicyCache, use_policy_caches  # noqa: E402
from nats.hf.fused import fuse_projections, is_fused, unfuse_projections  # noqa: E402
from nats.hf.loop import generate  # noqa: E402

NEW = 10


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fused_logits_and_tokens_equal_the_model(arch, attn):
    """Forward logits and greedy tokens through transformers' DynamicCache (the cache's update is called as the
    installed transformers calls it), for each supported family (Qwen2: biases in q/k/v)."""
    model = tiny_model(arch)
    model.config._attn_implementation = attn
    x = ids(n=20, b=2, seed=7)
    with torch.no_grad():
        ref = model(x).logits
    ref_tokens = greedy(model, x, transformers.DynamicCache(config=model.config))
    fuse_projections(model)
    assert is_fused(model)
    with torch.no_grad():
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(greedy(model, x, transformers.DynamicCache(config=model.config)), ref_tokens)


def test_long_inputs_run_the_models_products(monkeypatch):
    """Inputs of more than FUSED_MAX_TOKENS tokens (a prefill) take the model's own products: the same logits,
    the fused matrices not read."""
    from nats.hf import fused

    model = tiny_model("llama")
    x = ids(n=20, b=2, seed=7)
    with torch.no_grad():
        ref = model(x).logits
    fuse_projections(model)
    monkeypatch.setattr(fused, "FUSED_MAX_TOKENS", 8)
    for layer in model.model.layers:  # unreadable fused matrices: the products must not use them
        layer.self_attn.qkv_weight = layer.mlp.gate_up_weight = None
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)


def test_a_large_prefills_mlp_runs_in_chunks(monkeypatch):
    """Inputs of more than PREFILL_MLP_TOKENS tokens go through the MLP a chunk at a time (batch x length flattened,
    the last chunk shorter): the same logits, and no MLP call sees more tokens than a chunk."""
    from nats.hf import fused

    model = tiny_model("llama")
    x = ids(n=20, b=3, seed=8)  # 60 tokens: chunks of 16, 16, 16, 12
    with torch.no_grad():
        ref = model(x).logits
    fuse_projections(model)
    monkeypatch.setattr(fused, "FUSED_MAX_TOKENS", 8)
    monkeypatch.setattr(fused, "PREFILL_MLP_TOKENS", 16)
    seen = []
    up = model.model.layers[0].mlp.up_proj
    up.register_forward_hook(lambda m, args, out: seen.append(args[0].numel() // args[0].shape[-1]))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)
    assert seen == [16, 16, 16, 12]


def test_fused_sizes_split_the_fused_products():
    from nats.hf.fused import fused_sizes

    model = tiny_model("llama")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with pytest.raises(ValueError, match="not fused"):
        fused_sizes(attn)
    fuse_projections(model)
    assert fused_sizes(attn) == [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    assert fused_sizes(mlp) == [mlp.gate_proj.out_features, mlp.up_proj.out_features]


def test_fused_weights_are_views_and_the_bytes_stay():
    model = tiny_model("qwen2")
    names = [n for n, _ in model.named_parameters()]
    keys = set(model.state_dict())
    nbytes = roofline.weight_bytes(model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    fuse_projections(model)
    fuse_projections(model)  # a second call changes nothing
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # no second copy
    assert attn.v_proj.bias.untyped_storage().data_ptr() == attn.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    assert [n for n, _ in model.named_parameters()] == names and set(model.state_dict()) == keys
    assert roofline.weight_bytes(model) == nbytes
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    unfuse_projections(model)
    assert not is_fused(model) and "forward" not in attn.__dict__ and "forward" not in mlp.__dict__
    x = ids(n=12, b=1, seed=2)
    with torch.no_grad():
        out = model(x).logits
    ref = tiny_model("qwen2")
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["nats", "full"])
def test_fused_project_caches_equal_unfused(policy):
    """Through the project's fixed-capacity cache and nats-generate's loop (the nats attention function)."""
    model = nats_model() if policy == "nats" else use_policy_caches(tiny_model("llama"))
    prompt = ids(n=40, b=2, seed=3)
    ref = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW, compile=False)
    fuse_projections(model)
    got = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW, compile=False)
    assert torch.equal(got, ref)


def test_fused_compiled_step_has_three_products_fewer_per_layer():
    """The decode step compiled by inductor: one product for q/k/v and one for gate/up (4 per layer and the LM head),
    against 7 per layer unfused, with the same tokens."""
    from torch._inductor.utils import run_and_get_code

    def products(model):
        torch._dynamo.reset()
        cache = StaticPolicyCache(model, "full", max_new_tokens=4)
        out, code = run_and_get_code(generate, model, ids(n=30, b=1, seed=4), cache, 4, compile="inductor")
        return out, sum(len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", src)) for src in code)

    model = use_policy_caches(tiny_model("llama"))
    ref, unfused = products(model)
    out, fused = products(fuse_projections(model))
    layers = model.config.num_hidden_layers
    assert torch.equal(out, ref)
    assert (unfused, fused) == (7 * layers + 1, 4 * layers + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["nats", "full"])
def test_fused_on_cuda_equals_unfused(policy):
    """On a GPU: the Triton prefill writes (keys and values of the fused product strided differently) and the step
    replayed as a CUDA graph give the unfused model's tokens."""
    model = (nats_model() if policy == "nats" else use_policy_caches(tiny_model("llama"))).cuda()
    model.config.max_position_embeddings = 512  # a prompt of 300 tokens: past the tiny model's 256 on purpose
    prompt = ids(n=300, b=2, seed=5).cuda()
    ref = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW)
    fuse_projections(model)
    got = generate(model, prompt, StaticPolicyCache(model, policy, max_new_tokens=NEW), NEW)
    differ = (got != ref).nonzero().tolist()
    assert not differ, f"fused != unfused at (row, token) {differ[:4]} of {tuple(got.shape)}"


def test_projections_that_are_not_linear_layers_are_refused():
    """A layer whose projections are not nn.Linear (a quantized model) is refused with one line saying why, before
    any layer is changed."""

    class Quantized(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    attn.k_proj = Quantized(attn.k_proj)
    with pytest.raises(ValueError, match="have no nn.Linear q_proj/k_proj/v_proj"):
        fuse_projections(model)
    assert not is_fused(model)  # the first layer was left as it was too
