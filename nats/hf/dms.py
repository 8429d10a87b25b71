"""DMS on a transformers model (nats/attention/dms.py, docs/dms.md): `attach_dms` gives each decoder layer a DMS core
that reads its keep / evict decisions from the layer's own query projection (``q_proj``: neuron 0 of each group's
first query head, before the rotary embedding), and routes the attention through the ``"nats"`` attention function,
which runs the core's masked attention on a forward without a cache and the engine's `dms` cache
(`nats.hf.StaticPolicyCache(model, "dms")`) when generating. The core holds no parameters of its own: the rows of
``q_proj`` it reads are the model's."""

from __future__ import annotations

from torch import nn

from nats.attention.dms import DMSAttention
from nats.attention.registry import AttentionDims
from nats.hf.hooks import SCORER_NAME, _check_supported, _decoder_layers, attach_hooks

__all__ = ["attach_dms"]


def attach_dms(
    model: nn.Module,
    window: int = 256,
    target_cr: float = 4.0,
    dms_lambda: float = 1.0,
    tau: float = 0.1,
    alpha_scale: float = 100.0,
    alpha_offset: float = 5.0,
    backend: str = "auto",
) -> nn.Module:
    """Route a Llama / Mistral / Qwen2 model's attention through DMS (module docstring), in place; the arguments are
    `nats.attention.dms.DMSAttention`'s (``window``: the eviction delay). Undo with `nats.hf.detach_nats`."""
    _check_supported(model, "attach_dms")
    if getattr(model, "_nats_hf", None) is not None and any(
        hasattr(layer.self_attn, SCORER_NAME) for layer in _decoder_layers(model)
    ):
        raise ValueError(
            "nats.hf.attach_dms: NAtS or DMS is attached to this model already (nats.hf.detach_nats first)"
        )
    config = model.config
    attach_hooks(model)
    layers = _decoder_layers(model)
    n_kv = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ref = next(model.parameters())
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        dims = AttentionDims(n_embd=config.hidden_size, n_head=config.num_attention_heads, n_kv_head=n_kv,
                             head_dim=head_dim, block_size=getattr(config, "max_position_embeddings", 0) or 0,
                             layer_idx=i, n_layer=len(layers))  # fmt: skip
        core = DMSAttention(dims, window=int(window), target_cr=target_cr, dms_lambda=dms_lambda, tau=tau,
                            alpha_scale=alpha_scale, alpha_offset=alpha_offset, backend=backend)  # fmt: skip
        core.bind_query(attn.q_proj)
        core.train(model.training)
        attn.add_module(SCORER_NAME, core.to(device=ref.device))
    model._nats_hf["window"] = int(window)
    return model
