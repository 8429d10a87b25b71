"""`nats`: Neural Attention Search attention (NATS_SPEC.md sections 1-4).

A scorer per layer maps the block's normalised input x_j to type logits z_j = x_j W_s
(W_s: d_model x 3*n_kv_head, no bias; x detached by default). Training draws straight-through
Gumbel-softmax one-hots t_j = onehot(argmax y_j) + y_j - stopgrad(y_j), y_j = softmax((z_j + s G_j) / tau),
with s = ``noise_scale`` = 1 as in the spec (an option outside it: s < 1, down to 0 = the argmax types of
inference with a straight-through gradient; callbacks/noise_schedule.yaml anneals it; docs/hf_finetune.md).
Their gradient from the attention is the estimator `mask_grad` of spec section 3a ("dense" by default).
Evaluation takes onehot(argmax z_j) without noise. Token 0 is forced global (the attention sink), without
gradient. Attention is `nats.functional.nats_attention` with window W; the auxiliary loss is
`sparsity_loss`, lambda * density / n_layer, so that the model's summed auxiliary loss is lambda * mean(rho) over
sequences, layers and KV heads (spec section 4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nats import functional as NF
from nats import ops
from nats.attention.registry import AttentionCore, AttentionDims, AttentionOutput, register_attention


def sparsity_loss(density: torch.Tensor, sparsity_lambda: float, n_layer: int) -> torch.Tensor:
    """One layer's share of the sparsity term lambda * mean(rho) of NATS_SPEC.md section 4: ``density`` is the
    layer's rho per (sequence, KV head), ``[B, Hkv]``. Summed over the model's ``n_layer`` layers it is lambda times
    the mean of rho over sequences, layers and KV heads. This is what ``sparsity_lambda`` means everywhere: in the
    native model (`NAtSAttention`'s auxiliary loss, which the GPT sums and `nats.lit.LitGPT` adds to the
    cross-entropy) and in the distillation of a pretrained model's scorers (`nats.finetune.lit.LitNAtSDistill`, which
    adds it to the MSE). Its default is the config's, ``conf/model/attention/nats.yaml``."""
    return sparsity_lambda * density.mean() / n_layer


def kv_stats(types: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """Per-(sequence, head) KV statistics of hard types [B, H, N] (spec section 6).

    Returns tensors of shape [B, H]: density (= area fraction), peak (max_i c_i / N) and the fractions of
    global, local and sliding tokens.
    """
    values = ops.kv_stats(types, int(window))  # [B, H, 5], an opaque node under torch.compile
    return {name: values[..., i] for i, name in enumerate(ops.KV_STAT_NAMES)}


@register_attention("nats")
class NAtSAttention(AttentionCore):
    """The NAtS core (module docstring). ``sparsity_lambda`` is lambda of `sparsity_loss`; the constructor's 0.0
    means no sparsity term: the core as a plain layer (e.g. the scorers of `nats.hf`, whose LightningModule adds
    the term itself). Training runs take lambda from the config, ``conf/model/attention/nats.yaml``, the one place
    that documents its default."""

    decode_policy = "nats"  # the NAtS KV cache with the scorer's types reproduces the eval forward

    def __init__(
        self,
        dims: AttentionDims,
        window: int = 16,
        sparsity_lambda: float = 0.0,
        tau: float = 1.0,
        detach_scorer_input: bool = True,
        backend: str = "auto",
        mask_grad: str = "dense",
        noise_scale: float = 1.0,
    ):
        super().__init__(dims)
        if not isinstance(window, int) or window < 1:
            raise ValueError(
                f"model.attention.window={window!r}: nats attention's sliding window must be an integer >= 1 (the "
                "tokens a sliding token stays visible for), e.g. model.attention.window=16"
            )
        if tau <= 0:
            raise ValueError(f"nats attention: tau must be > 0, got {tau}")
        if sparsity_lambda < 0:
            raise ValueError(
                f"model.attention.sparsity_lambda={sparsity_lambda} must be >= 0: it weighs the KV-cache size "
                "against the loss (0 = no pressure to drop tokens, larger = a smaller cache); e.g. "
                "model.attention.sparsity_lambda=0.1"
            )
        _check_noise_scale(noise_scale)
        if backend not in NF.BACKENDS:
            raise ValueError(f"nats attention: backend must be one of {NF.BACKENDS}, got {backend!r}")
        if mask_grad not in NF.MASK_GRADS:
            raise ValueError(
                f"nats attention: mask_grad must be one of {NF.MASK_GRADS} (NATS_SPEC.md section 3a), got {mask_grad!r}"
            )
        self.window = window
        self.mask_grad = mask_grad
        self.sparsity_lambda = float(sparsity_lambda)
        # The Gumbel temperature lives in a (non-persistent) tensor, so that a schedule changing it every step
        # (nats.callbacks.TemperatureSchedule sets `core.tau = value`) never recompiles a compiled model, as a
        # Python float read in the forward would (torch.compile guards on it).
        self.register_buffer("tau_buf", torch.tensor(float(tau)), persistent=False)
        self._tau = float(tau)
        # the scale of the Gumbel noise, in a buffer for the same reason (nats.callbacks.NoiseSchedule)
        self.register_buffer("noise_buf", torch.tensor(float(noise_scale)), persistent=False)
        self._noise_scale = float(noise_scale)
        self.detach_scorer_input = detach_scorer_input
        self.backend = backend
        if backend == "triton" or (backend == "auto" and torch.cuda.is_available()):
            # import (or fail to import) the Triton kernel now, before any torch.compile traces the forward:
            # a trace with the backend cache still empty guards on it and recompiles once it is filled
            NF.triton_available()
        self.scorer = nn.Linear(dims.n_embd, 3 * dims.n_kv_head, bias=False)
        # offsets added to the (global, local, sliding) logits in eval mode only, before the argmax: a KV-budget knob
        # for a trained model (set_type_bias); zeros = the learned types
        self.register_buffer("type_bias", torch.zeros(3), persistent=False)
        self.record_types = False  # set by analysis code: keep the last hard types in `last_types`
        self.last_types: torch.Tensor | None = None

    @property
    def tau(self) -> float:
        """The Gumbel-softmax temperature (a float; the forward reads the buffer ``tau_buf``)."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        if value <= 0:
            raise ValueError(f"nats attention: tau must be > 0, got {value}")
        self._tau = float(value)
        self.tau_buf.fill_(self._tau)  # in place: no new tensor, no graph change

    @property
    def noise_scale(self) -> float:
        """The scale s of the Gumbel noise in training, argmax(z + s G): 1 is the spec's straight-through
        Gumbel-softmax; 0 trains on the argmax types of inference (no sampling, straight-through gradient)."""
        return self._noise_scale

    @noise_scale.setter
    def noise_scale(self, value: float) -> None:
        _check_noise_scale(value)
        self._noise_scale = float(value)
        self.noise_buf.fill_(self._noise_scale)

    def type_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> z [B, Hkv, N, 3] (float32)."""
        B, N, _ = x.shape
        xs = x.detach() if self.detach_scorer_input else x
        z = self.scorer(xs).float().view(B, N, self.dims.n_kv_head, 3).transpose(1, 2)
        return z if self.training else z + self.type_bias

    def type_weights(self, z: torch.Tensor) -> torch.Tensor:
        """Logits [B, H, N, 3] -> one-hot type weights (straight-through Gumbel-softmax in training)."""
        if self.training:
            gumbel = -torch.empty_like(z).exponential_().log()
            y = F.softmax((z + self.noise_buf * gumbel) / self.tau_buf, dim=-1)
            hard = F.one_hot(y.argmax(-1), 3).to(y.dtype)
            t = hard + (y - y.detach())  # exactly one-hot in value (y - y.detach() == 0)
            return _token0_global(t)
        return self.argmax_weights(z)

    @staticmethod
    def argmax_weights(z: torch.Tensor) -> torch.Tensor:
        """Logits [B, H, N, 3] -> the one-hot weights of the inference types (argmax, token 0 global), in training
        too (no noise, no gradient)."""
        return _token0_global(F.one_hot(z.detach().argmax(-1), 3).to(z.dtype))

    def hard_types(self, x: torch.Tensor) -> torch.Tensor:
        """The inference types of x [B, N, C]: [B, Hkv, N] int64 (argmax, token 0 global)."""
        types = self.type_logits(x).argmax(-1)
        types[..., 0] = NF.TOKEN_GLOBAL
        return types

    def forward(self, q, k, v, x) -> AttentionOutput:
        # q [B, Hq, N, D], k/v [B, Hkv, N, D], x [B, N, C]
        if not self.dims.causal:
            raise ValueError("nats attention is causal only: set model.causal=true")
        t = self.type_weights(self.type_logits(x))  # [B, Hkv, N, 3]
        y = NF.nats_attention(
            q,
            k,
            v,
            t.to(q.dtype) if q.dtype == torch.float64 else t,
            self.window,
            backend=self.backend,
            mask_grad=self.mask_grad,
        )
        aux, stats = self._sparsity_and_stats(t)
        return AttentionOutput(y, aux_loss=aux, stats=stats)

    # The O(N) scans behind the density and the statistics run as custom ops (nats/ops.py): opaque nodes
    # of a compiled graph, so torch.compile sees the whole layer without a graph break.
    def _sparsity_and_stats(self, t: torch.Tensor):
        """Auxiliary loss `sparsity_loss` (training, lambda > 0) and the layer's KV statistics."""
        density, values = ops.density_and_stats(t, self.window)  # [B, Hkv] differentiable in t; [B, Hkv, 5]
        aux = None
        if self.training and self.sparsity_lambda > 0:
            aux = sparsity_loss(density, self.sparsity_lambda, self.dims.n_layer)
        if self.record_types:
            self.last_types = t.detach().argmax(-1)  # [B, Hkv, N]
        stats = {name: values[..., i].mean() for i, name in enumerate(ops.KV_STAT_NAMES)}
        return aux, stats


def _check_noise_scale(value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ValueError(
            f"nats attention: noise_scale must be >= 0 (1 = the spec's Gumbel noise, 0 = none), got {value}"
        )


def _token0_global(t: torch.Tensor) -> torch.Tensor:
    """Type weights [..., N, 3] with token 0 global, without gradient."""
    first = torch.zeros_like(t[..., :1, :])
    first[..., 0] = 1.0
    return torch.cat([first, t[..., 1:, :]], dim=-2)


@torch.no_grad()
def collect_types(model: nn.Module, idx: torch.Tensor) -> dict[int, torch.Tensor]:
    """Run `model` (a GPT) on idx [B, N] in eval mode and return each NAtS layer's hard types [B, Hkv, N]."""
    cores = {i: blk.attn.core for i, blk in enumerate(model.blocks) if isinstance(blk.attn.core, NAtSAttention)}
    if not cores:
        raise ValueError("the model has no nats attention layers (model.attention.name=nats)")
    was_training = model.training
    model.eval()
    try:
        for core in cores.values():
            core.record_types = True
        model(idx)
        return {i: core.last_types for i, core in cores.items()}
    finally:
        for core in cores.values():
            core.record_types, core.last_types = False, None
        model.train(was_training)


@torch.no_grad()
def kv_report(model: nn.Module, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer and per-head KV statistics of a NAtS model on idx [B, N] (averaged over the batch).

    Returns tensors of shape [n_nats_layers, Hkv] for density (area fraction), peak, frac_global,
    frac_local and frac_sliding, plus "layers" (the layer indices).
    """
    types = collect_types(model, idx)
    rows: dict[str, list[torch.Tensor]] = {}
    for i, t in types.items():
        core = model.blocks[i].attn.core
        for name, value in kv_stats(t, core.window).items():
            rows.setdefault(name, []).append(value.mean(0))  # [Hkv]
    report = {name: torch.stack(values) for name, values in rows.items()}
    report["layers"] = torch.tensor(sorted(types))
    return report


def set_type_bias(model: nn.Module, bias) -> int:
    """Set the inference offsets of the type logits, ``bias = (global, local, sliding)`` (None: zeros), of every NAtS
    core in ``model``; returns how many. In eval mode the types are ``argmax(z + bias)``, in the parallel forward
    and in decoding alike; training is unaffected. Not part of the method (NATS_SPEC.md): a post-hoc knob that
    moves a trained model along its KV budget without retraining (docs/hf_eval.md measures it: the scorers' logits
    lie close to the decision boundary, so offsets of 0.1 already move many types)."""
    values = check_type_bias(bias)
    cores = [m for m in model.modules() if isinstance(m, NAtSAttention)]
    for core in cores:
        core.type_bias.copy_(torch.tensor(values))
    return len(cores)


def check_type_bias(bias) -> list[float]:
    """``bias`` as 3 floats (global, local, sliding); None gives zeros. Raises a ValueError naming the fix otherwise."""
    if bias is None:
        return [0.0, 0.0, 0.0]
    try:
        values = [float(b) for b in bias]
    except (TypeError, ValueError):
        values = []
    if len(values) != 3 or not all(math.isfinite(b) for b in values):
        raise ValueError(
            f"type_bias must be 3 finite numbers (global, local, sliding) or null, got {bias!r}: "
            "e.g. type_bias=[0,0.1,0]"
        )
    return values
