"""How a transformers model is routed through the ``"nats"`` attention function, without the function itself.

The pieces that `nats.hf.scorers` (the scorers), `nats.hf.cache` (the policy cache) and `nats.hf.attention` (the
attention function) share: the supported architectures, the name of the scorer submodule, the decoder layers of a
model, and the forward pre-hooks that stash each attention module's input hidden states and cache for the attention
function (`attach_hooks`). This module imports none of the three, so the attention function may import the cache
(it dispatches to a `StaticPolicyCache`) without an import cycle; the package (``nats/hf/__init__.py``) registers the
attention function in transformers' registry when it is imported, before any model can be routed to it.
"""

from __future__ import annotations

from torch import nn

from nats.hf.compat import cache_from_kwargs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: the attribute of a layer's attention module that holds its NAtS scorer
SCORER_NAME = "nats_scorer"
#: the name under which `nats.hf.attention.register` registers the attention function (its ATTN_IMPLEMENTATION)
ATTN_IMPLEMENTATION = "nats"


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"nats.hf: cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return layers


def layer_dims(model: nn.Module, layer_idx: int):
    """The `nats.attention.registry.AttentionDims` of decoder layer ``layer_idx`` of a transformers model (the cores
    `attach_nats` and `attach_dms` give its attention modules)."""
    from nats.attention.registry import AttentionDims  # noqa: PLC0415

    config = model.config
    return AttentionDims(
        n_embd=config.hidden_size,
        n_head=config.num_attention_heads,
        n_kv_head=config.num_key_value_heads or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        block_size=getattr(config, "max_position_embeddings", 0) or 0,
        layer_idx=layer_idx,
        n_layer=len(_decoder_layers(model)),
    )


def routed_cores(model: nn.Module, who: str) -> list:
    """Each decoder layer's NAtS scorer (None where it has none), once the model is checked to route its attention
    through nats (the hooks installed and the attention function selected); `who` names the caller in the error."""
    attn = [layer.self_attn for layer in _decoder_layers(model)]
    if not all(hasattr(a, "_nats_cache") for a in attn) or model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{who}: the model does not route its attention through nats (call nats.hf.attach_nats(model) for NAtS, "
            "or nats.hf.use_policy_caches(model) for the other policies, first)"
        )
    return [getattr(a, SCORER_NAME, None) for a in attn]


def _stash_hidden(module: nn.Module, args, kwargs):
    """Forward pre-hook of an attention module: its input hidden states (the scorer's input) and the cache it is
    given (a `nats.hf.StaticPolicyCache` runs its policy in the attention function)."""
    module._nats_hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module._nats_cache = cache_from_kwargs(kwargs)


def _check_supported(model: nn.Module, what: str) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"nats.hf.{what}: unsupported architecture {model_type!r} ({type(model).__name__}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


class _WatchedPrepare:
    """The model's ``prepare_inputs_for_generation`` (transformers' public hook of ``generate``, called with the whole
    sequence before every forward) after a cache with a ``history`` (`nats.hf.StaticPolicyCache`) has checked a
    continued conversation at a call's first forward (``is_first_iteration``: the prompt must continue the tokens it
    holds, `StaticPolicyCache.check_history`) and kept a reference to the sequence it will hold after the forward (no
    copy, no host read at the decode steps). A module-level class, so that the model still pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, input_ids, *args, **kwargs):
        cache = cache_from_kwargs(kwargs)
        if hasattr(cache, "check_history"):
            if kwargs.get("is_first_iteration"):
                cache.check_history(input_ids, kwargs.get("attention_mask"), "model.generate")
            cache.history = input_ids  # what the cache holds after this forward
        return type(self.model).prepare_inputs_for_generation(self.model, input_ids, *args, **kwargs)


def _watch_generate(model: nn.Module) -> None:
    """Route the model's ``prepare_inputs_for_generation`` through `_WatchedPrepare`; `nats.hf.detach_nats` removes
    it."""
    if hasattr(type(model), "prepare_inputs_for_generation"):
        model.prepare_inputs_for_generation = _WatchedPrepare(model)


def attach_hooks(model: nn.Module) -> nn.Module:
    """Route the model's attention through the ``"nats"`` attention function (registered when `nats.hf` is
    imported): add the pre-hooks that stash each attention module's input and cache, select it in the config.
    Idempotent; `nats.hf.attach_nats` and `nats.hf.cache.use_policy_caches` call it."""
    _check_supported(model, "use_policy_caches")
    if getattr(model, "_nats_hf", None) is not None:
        return model
    hooks = []
    for layer in _decoder_layers(model):
        attn = layer.self_attn
        attn._nats_hidden = attn._nats_cache = None
        hooks.append(attn.register_forward_pre_hook(_stash_hidden, with_kwargs=True))
    _watch_generate(model)
    model._nats_hf = {"hooks": hooks, "attn_implementation": model.config._attn_implementation, "window": None}
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model
