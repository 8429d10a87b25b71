"""One matrix-vector product per layer where the model has several with the same input, for decoding.

A decode step of a Llama-family model reads every weight once, so its speed is the weights' bytes over the GPU's
bandwidth, if each product streams its matrix at that bandwidth. The key and value projections of a grouped-query
model are small (Llama-3.1-8B: 8 MB each, against 117 MB for an MLP matrix): cuBLAS splits them over the SMs and adds
a reduction kernel, and at batch 1 they ran at ~38% of the bandwidth (one H200, docs/results/bench_limit_h200.md): ~19
us of each layer's ~210 us with the reductions. `fuse_projections` concatenates, in each decoder layer, the query, key
and value weights into one ``[Hq*D + 2*Hkv*D, hidden]`` matrix (``self_attn.qkv_weight``) and the MLP's gate and up
weights into one (``mlp.gate_up_weight``), as gpt-fast's ``wqkv`` does, and runs the layer's attention and MLP
forwards with one product each: three products fewer per layer and the small products streamed together. Inputs of
more than `FUSED_MAX_TOKENS` tokens (a prefill) run the model's own products, the MLP over at most
`PREFILL_MLP_TOKENS` tokens at a time (a batched prefill's peak memory).

The original ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` weights become views of the fused matrices (no
second copy in memory; parameters, ``state_dict`` and the bytes a step reads are those of the model), and
``unfuse_projections`` restores the modules' own forwards. For inference: in-place changes of the weights reach the
fused matrices (shared storage), but a parameter replaced after fusing (``model.to(...)`` casting or moving it,
``load_state_dict(..., assign=True)``) no longer shares them, so fuse after loading and placing the model. Greedy
tokens equal the unfused model's (`tests/test_hf_fused.py`). ``nats-generate`` fuses the model it decodes with;
``benchmarks/bench_hf_decode.py`` fuses for every row but transformers' own caches (``static``, ``dynamic``: what a
transformers user runs).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nats.hf.compat import cache_argument, cache_from_kwargs, update_cache
from nats.hf.hooks import _check_supported, _decoder_layers

__all__ = ["fuse_projections", "unfuse_projections", "is_fused", "fused_sizes"]

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
#: inputs of more tokens (batch x length) run the model's own products: a prefill is bound by arithmetic, not by
#: reading the weights, and the fused gate/up output would double the MLP's peak memory (Llama-3.1-8B, batch 8 x 32k:
#: 15 GB instead of 7.5)
FUSED_MAX_TOKENS = 256
#: a prefill's MLP runs over at most this many tokens at a time: its intermediates (gate, up, their product; 3 x 28 KB
#: per token at Llama-3.1-8B's width) were the largest part of a batched prefill's peak memory (31 sequences x 32k at
#: once ran out of an H200's 141 GB with a KV cache of 8 GiB); the chunks' results are the same rows' products
PREFILL_MLP_TOKENS = 32768


def fused_sizes(module: nn.Module) -> list[int]:
    """The output sizes of the products a fused ``module`` (a decoder layer's attention or MLP) runs as one: q, k, v
    or gate, up; split the fused product's last dimension by them."""
    if not hasattr(module, "_nats_split"):
        raise ValueError(f"nats.hf.fused_sizes: {type(module).__name__} is not fused (call fuse_projections first)")
    return list(module._nats_split)


def is_fused(model: nn.Module) -> bool:
    """`fuse_projections` was applied to ``model`` (and not undone)."""
    return any(hasattr(layer.self_attn, "qkv_weight") for layer in _decoder_layers(model))


def _fuse(module: nn.Module, names: tuple[str, ...], weight: str, bias: str) -> None:
    """``module.<weight>`` (a non-persistent buffer): the ``names`` linears' weights stacked by output rows, each
    linear's weight then a view of its rows (and the same for the biases, if they have any)."""
    linears = [getattr(module, n) for n in names]
    for attr, target in (("weight", weight), ("bias", bias)):
        parts = [getattr(lin, attr) for lin in linears]
        if parts[0] is None:
            module.register_buffer(target, None, persistent=False)
            continue
        fused = torch.cat([p.detach() for p in parts], dim=0)
        module.register_buffer(target, fused, persistent=False)
        row = 0
        for lin, p in zip(linears, parts):
            n = p.shape[0]
            setattr(lin, attr, nn.Parameter(fused[row : row + n], requires_grad=p.requires_grad))
            row += n
    module._nats_split = [lin.weight.shape[0] for lin in linears]


def _attention_forward(attn: nn.Module):
    """``attn``'s forward (a Llama-family attention, `transformers.models.llama.modeling_llama.LlamaAttention`) with
    the query, key and value projections as one product; the rest as its class does it: rotary embedding and
    attention function from its own modeling module, the cache updated as its transformers release updates it
    (`nats.hf.compat.update_cache`), the sliding window passed where Mistral and Qwen2 pass it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(attn).__module__]
    rotary, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward
    new_style = cache_argument(attn) == "cache"
    window = {}
    if attn.config.model_type in ("mistral", "qwen2"):
        window = {"sliding_window": getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))}
    split = attn._nats_split

    def forward(hidden_states: Tensor, position_embeddings=None, attention_mask=None, *args, **kwargs):
        if args:  # older signatures take the cache and cache_position by position
            kwargs = {**dict(zip(("past_key_values", "cache_position"), args)), **kwargs}
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        if hidden_states.numel() // hidden_states.shape[-1] > FUSED_MAX_TOKENS:  # a prefill: the model's products
            q, k, v = attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)
        else:
            q, k, v = F.linear(hidden_states, attn.qkv_weight, attn.qkv_bias).split(split, dim=-1)
        query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        query, key = rotary(query, key, cos, sin)
        cache = cache_from_kwargs(kwargs)
        if cache is not None:
            key, value = update_cache(cache, key, value, attn.layer_idx, kwargs, cos, sin, new_style)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        rest = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "cache_position")}
        dropout = 0.0 if not attn.training else attn.attention_dropout
        out, weights = attend(
            attn, query, key, value, attention_mask, dropout=dropout, scaling=attn.scaling, **{**window, **rest}
        )
        return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


def _mlp_forward(mlp: nn.Module):
    """``mlp``'s forward, ``down(act(gate(x)) * up(x))``, with the gate and up projections as one product."""
    split = mlp._nats_split

    def own(x: Tensor) -> Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def forward(x: Tensor) -> Tensor:
        tokens = x.numel() // x.shape[-1]
        if tokens > PREFILL_MLP_TOKENS:  # a large prefill: the model's products, a chunk of tokens at a time
            flat = x.reshape(tokens, x.shape[-1])
            out = flat.new_empty(tokens, mlp.down_proj.out_features)
            for i in range(0, tokens, PREFILL_MLP_TOKENS):
                out[i : i + PREFILL_MLP_TOKENS] = own(flat[i : i + PREFILL_MLP_TOKENS])
            return out.view(*x.shape[:-1], -1)
        if tokens > FUSED_MAX_TOKENS:  # a prefill: the model's products (half the peak memory)
            return own(x)
        gate, up = F.linear(x, mlp.gate_up_weight, mlp.gate_up_bias).split(split, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    return forward


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse each decoder layer's q/k/v and gate/up projections (module docstring); returns ``model``, changed in
    place. A model already fused is left as it is."""
    _check_supported(model, "fuse_projections")
    layers = _decoder_layers(model)
    for layer in layers:  # every layer checked before any is changed: no half-fused model
        attn, mlp = layer.self_attn, layer.mlp
        if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in QKV) or not all(
            isinstance(getattr(mlp, n, None), nn.Linear) for n in GATE_UP
        ):
            raise ValueError(
                f"nats.hf.fuse_projections: {type(attn).__name__} / {type(mlp).__name__} have no nn.Linear "
                f"{'/'.join(QKV)} and {'/'.join(GATE_UP)} (a quantized model?); decode it unfused"
            )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_weight"):
            continue
        _fuse(attn, QKV, "qkv_weight", "qkv_bias")
        _fuse(mlp, GATE_UP, "gate_up_weight", "gate_up_bias")
        attn.forward = _attention_forward(attn)
        mlp.forward = _mlp_forward(mlp)
    return model


def unfuse_projections(model: nn.Module) -> nn.Module:
    """Undo `fuse_projections`: the modules' own forwards again (their weights stay views of the fused matrices,
    which are dropped from the modules: the views keep the storage alive, nothing is copied)."""
    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for module, names in ((attn, ("qkv_weight", "qkv_bias")), (mlp, ("gate_up_weight", "gate_up_bias"))):
            if names[0] in module._buffers:
                for name in names:
                    del module._buffers[name]
                module.__dict__.pop("forward", None)
                module.__dict__.pop("_nats_split", None)
    return model
