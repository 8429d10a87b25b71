"""DMS on a transformers model (nats/attention/dms.py, docs/dms.md): `attach_dms` gives each decoder layer a DMS core
that reads its keep / evict decisions from the layer's own query projection (``q_proj``: neuron 0 of each group's
first query head, before the rotary embedding), and routes the attention through the ``"nats"`` attention function,
which runs the core's masked attention on a forward without a cache and the engine's `dms` cache
(`nats.hf.StaticPolicyCache(model, "dms")`) when generating. The core holds no parameters of its own: the rows of
``q_proj`` it reads are the model's."""

from __future__ import annotations

from typing import Any

from torch import nn

from nats.attention.dms import DMSAttention
from nats.hf.hooks import SCORER_NAME, _check_supported, _decoder_layers, attach_hooks, layer_dims
from nats.hf.scorers import is_attached

__all__ = ["attach_dms"]


def attach_dms(model: nn.Module, window: int = 256, **options: Any) -> nn.Module:
    """Route a Llama / Mistral / Qwen2 model's attention through DMS (module docstring), in place: ``window`` is the
    eviction delay, ``options`` the rest of `nats.attention.dms.DMSAttention`'s arguments (``target_cr``,
    ``dms_lambda``, ``tau``, ``alpha_scale``, ``alpha_offset``, ``backend``). Undo with `nats.hf.detach_nats`."""
    _check_supported(model, "attach_dms")
    if is_attached(model):
        raise ValueError("nats.hf.attach_dms: NAtS or DMS is attached to this model already (detach_nats first)")
    attach_hooks(model)
    ref = next(model.parameters())
    for i, layer in enumerate(_decoder_layers(model)):
        attn = layer.self_attn
        core = DMSAttention(layer_dims(model, i), window=int(window), **options)
        core.bind_query(attn.q_proj)
        core.train(model.training)
        attn.add_module(SCORER_NAME, core.to(device=ref.device))
    model._nats_hf["window"] = int(window)
    return model
