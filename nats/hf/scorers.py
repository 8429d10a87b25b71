"""Attach NAtS type scorers to a Hugging Face Llama-family model.

`attach_nats(model)` adds one scorer per decoder layer (``Linear(hidden, 3 * num_key_value_heads, bias=False)``:
one type triple per KV head, GQA) as ``layer.self_attn.nats_scorer``, a forward pre-hook on each attention module
that stashes its input hidden states for the scorer (`nats.hf.hooks.attach_hooks`), selects the ``"nats"``
attention function (`nats.hf.attention`, registered when `nats.hf` is imported) with
``model.config._attn_implementation = "nats"``, and freezes every other parameter. The scorer is
`nats.attention.nats.NAtSAttention` (the native model's core): the same type logits,
straight-through Gumbel-softmax in training, argmax in eval, token 0 global.
"""

from __future__ import annotations

import torch
from torch import nn

from nats import ops
from nats.attention.nats import NAtSAttention
from nats.attention.registry import AttentionDims
from nats.hf.hooks import SCORER_NAME, _check_supported, _decoder_layers, attach_hooks, layer_dims


class HFNAtSScorer(NAtSAttention):
    """A `NAtSAttention` used as the type scorer of one transformers attention module.

    Besides the core's parameters (``scorer.weight``) it holds what the last forward recorded: ``last_density``
    (``[B, Hkv]``, differentiable in the scorer weights in training), ``last_stats`` (``[B, Hkv]`` each, in the
    order of ``nats.ops.KV_STAT_NAMES``) and ``past_types`` (the hard types of the tokens a decode step attends
    over). ``force_type`` (None, or 0/1/2) overrides the scorer with one type for every token but token 0.
    """

    def __init__(self, dims: AttentionDims, **kwargs):
        super().__init__(dims, **kwargs)
        self.force_type: int | None = None
        self.last_density: torch.Tensor | None = None
        self.last_type_logits: torch.Tensor | None = None  # [B, Hkv, N, 3] of the last training forward
        self.last_stats: dict[str, torch.Tensor] = {}
        self.past_types: torch.Tensor | None = None

    @property
    def last_density_argmax(self) -> torch.Tensor | None:
        """``[B, Hkv]``, no gradient: the density of the argmax (inference) types of the last forward. After a
        training forward it is computed here from the stored logits (the sampled types' ``last_density`` can be
        much sparser); after an eval forward, or with ``force_type``, it is ``last_density``."""
        if self.last_type_logits is None:
            return None if self.last_density is None else self.last_density.detach()
        with torch.no_grad():
            return ops.density_and_stats(self.argmax_weights(self.last_type_logits), self.window)[0]


def is_attached(model: nn.Module) -> bool:
    """NAtS scorers (`attach_nats`) or DMS cores (`nats.hf.attach_dms`) are attached: the model has a window."""
    state = getattr(model, "_nats_hf", None)
    return state is not None and state.get("window") is not None


def attach_nats(
    model: nn.Module,
    window: int = 256,
    tau: float = 1.0,
    backend: str = "auto",
    mask_grad: str = "dense",
    init_std: float | None = None,
    freeze: bool = True,
    noise_scale: float = 1.0,
) -> nn.Module:
    """Add NAtS type scorers to a Llama / Mistral / Qwen2 transformers model and run its attention with NAtS.

    Args:
        model: a ``LlamaForCausalLM``-style model (or its base ``LlamaModel``) whose ``config.model_type`` is one of
            ``SUPPORTED_MODEL_TYPES``.
        window: the sliding window W of NAtS (spec section 2).
        tau: the Gumbel-softmax temperature in training.
        noise_scale: the scale s of the Gumbel noise in training, argmax(z + s G); 1 = the spec, 0 = the argmax types.
        backend / mask_grad: passed to `nats.functional.nats_attention` ("auto": Triton on CUDA, else reference).
        init_std: if given, the scorer weights are drawn from N(0, init_std^2); else nn.Linear's default init.
        freeze: set ``requires_grad=False`` on every parameter but the scorers (the paper trains the scorers only).

    Returns:
        the same model, modified in place (scorers in the model's dtype and device, ``config._attn_implementation``
        set to ``"nats"``; the previous implementation is restored by `detach_nats`).
    """
    _check_supported(model, "attach_nats")
    if is_attached(model):
        raise ValueError("nats.hf.attach_nats: NAtS is already attached to this model (nats.hf.detach_nats first)")
    attach_hooks(model)
    layers = _decoder_layers(model)
    ref = next(model.parameters())
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        dims = layer_dims(model, i)
        scorer = HFNAtSScorer(
            dims, window=int(window), tau=tau, backend=backend, mask_grad=mask_grad, noise_scale=noise_scale
        )
        if init_std is not None:
            nn.init.normal_(scorer.scorer.weight, std=init_std)
        scorer.train(model.training)  # a new module is in training mode (Gumbel noise): follow the model's mode
        attn.add_module(SCORER_NAME, scorer.to(device=ref.device, dtype=ref.dtype))
    model._nats_hf["window"] = int(window)
    if freeze:
        for name, p in model.named_parameters():
            p.requires_grad_(f".{SCORER_NAME}." in f".{name}")
    return model


def detach_nats(model: nn.Module) -> nn.Module:
    """Undo `attach_nats` (or `use_policy_caches`): remove the scorers and hooks and restore the attention
    implementation (parameters stay frozen; unfreeze them yourself if needed)."""
    state = getattr(model, "_nats_hf", None)
    if state is None:
        raise ValueError("nats.hf.detach_nats: NAtS is not attached to this model")
    for h in state["hooks"]:
        h.remove()
    for layer in _decoder_layers(model):
        if hasattr(layer.self_attn, SCORER_NAME):
            delattr(layer.self_attn, SCORER_NAME)
        layer.self_attn._nats_hidden = layer.self_attn._nats_cache = None
    model.config._attn_implementation = state["attn_implementation"]
    if "prepare_inputs_for_generation" in vars(model):  # the generate hook (nats.hf.hooks), the class's method again
        del model.prepare_inputs_for_generation
    model._nats_hf = None
    return model


def scorers(model: nn.Module) -> list[HFNAtSScorer]:
    """The NAtS scorers of an attached model, one per decoder layer."""
    if not is_attached(model):
        raise ValueError("nats.hf: NAtS is not attached to this model (nats.hf.attach_nats)")
    return [getattr(layer.self_attn, SCORER_NAME) for layer in _decoder_layers(model)]


def set_force_type(model: nn.Module, force_type: int | None) -> None:
    """Force one type (0 global, 1 local, 2 sliding; None: the scorers decide) for every token but token 0."""
    if force_type is not None and int(force_type) not in (0, 1, 2):
        raise ValueError(f"nats.hf: force_type must be None, 0, 1 or 2, got {force_type!r}")
    for s in scorers(model):
        s.force_type = None if force_type is None else int(force_type)


def nats_density(model: nn.Module, argmax: bool = False) -> torch.Tensor:
    """The mean density (spec section 4) over layers, KV heads and the batch of the last forward: a scalar,
    differentiable in the scorer weights after a training-mode forward. The sparsity term of the paper's loss is
    ``lambda * nats_density(model)``.

    ``argmax=True``: the density of the argmax types of the same forward (no gradient), what inference keeps. After
    a training-mode forward it can differ from the sampled types' density that the loss sees; in eval the two are
    equal."""
    values = [s.last_density_argmax if argmax else s.last_density for s in scorers(model)]
    if any(v is None for v in values):
        raise RuntimeError("nats.hf.nats_density: run a forward (prefill) through the model first")
    return torch.stack([v.float().mean() for v in values]).mean()


def nats_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """KV statistics of the last forward, per layer and KV head: ``{name: [n_layer, Hkv]}`` (batch mean) for
    density (area fraction), peak, frac_global, frac_local and frac_sliding (spec section 6)."""
    rows = [s.last_stats for s in scorers(model)]
    if any(not r for r in rows):
        raise RuntimeError("nats.hf.nats_stats: run a forward (prefill) through the model first")
    return {name: torch.stack([r[name].float().mean(0) for r in rows]) for name in rows[0]}


def nats_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The scorer weights only (the keys of ``model.state_dict()`` that belong to the scorers)."""
    scorers(model)  # checks attached
    return {k: v for k, v in model.state_dict().items() if f".{SCORER_NAME}." in f".{k}"}


def load_nats_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load scorer weights saved by `nats_state_dict` into an attached model (strict: every scorer key)."""
    expected = set(nats_state_dict(model))
    got = set(state_dict)
    if expected != got:
        raise KeyError(
            f"nats.hf.load_nats_state_dict: keys differ; missing {sorted(expected - got)}, unexpected "
            f"{sorted(got - expected)}"
        )
    model.load_state_dict(state_dict, strict=False)
