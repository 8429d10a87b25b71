"""`dms`: Dynamic Memory Sparsification (Łańcucki et al., NeurIPS 2025, arXiv 2506.05345), the learned peer of NAtS
(docs/dms.md states exactly what is implemented and where it departs from the paper).

Per token and KV head a decision logit is read from the layer's own query projection, no new module: neuron 0 of the
first query head of the KV head's group before the rotary embedding, ``z_j = alpha_scale * (x_j W_q)[h * G, 0] -
alpha_offset`` (x_j: the block's normalised input; ``alpha_offset`` > 0 starts the model keeping nearly every token;
the rows of W_q it reads are trained by the loss as the rest of the projection). A token marked for eviction stays
visible for a window of ``window`` queries (itself included: query i sees it while ``i - j < window``), then leaves; a
kept token stays.

* **Training**: a Gumbel-sigmoid relaxation, ``alpha_j = sigmoid((z_j + logistic noise) / tau)``, the attention
  logit of key j for query i offset by ``log(1 - alpha_j)`` once ``i - j >= window`` (causal; the soft form of the
  delayed eviction), and the auxiliary loss ``dms_lambda * max(0, (1 - 1 / target_cr) - mean alpha) / n_layer``:
  the layers together evict at least the share a compression ratio ``target_cr`` asks for (annealed from 1 by
  `nats.callbacks.CompressionSchedule`, conf/callbacks/dms_schedule.yaml).
* **Inference**: hard decisions ``z_j > 0``; the mask is NAtS' with two types, kept = global, evicted = sliding with
  W = ``window`` (`nats.functional.nats_attention_types`), so the KV cache is the engine's `dms` policy
  (nats/cache/policies/dms.py) and decoding equals the eval forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nats import functional as NF
from nats.attention.registry import AttentionCore, AttentionDims, AttentionOutput, register_attention

KEEP, EVICT = NF.TOKEN_GLOBAL, NF.TOKEN_SLIDING  # the two types a DMS cache holds


@register_attention("dms")
class DMSAttention(AttentionCore):
    """The DMS core (module docstring). ``target_cr``: the compression ratio the auxiliary loss asks for (>= 1;
    1 = no pressure); ``dms_lambda`` its weight; ``tau`` the Gumbel-sigmoid temperature."""

    decode_policy = "dms"  # the engine's DMS cache reproduces the eval forward

    def __init__(
        self,
        dims: AttentionDims,
        window: int = 16,
        target_cr: float = 4.0,
        dms_lambda: float = 1.0,
        tau: float = 0.1,
        alpha_scale: float = 100.0,
        alpha_offset: float = 5.0,
        backend: str = "auto",
    ):
        super().__init__(dims)
        if not isinstance(window, int) or window < 1:
            raise ValueError(
                f"model.attention.window={window!r}: dms' eviction delay must be an integer >= 1 (the queries an "
                "evicted token stays visible to), e.g. model.attention.window=16"
            )
        if tau <= 0 or dms_lambda < 0 or alpha_scale <= 0:
            raise ValueError(
                f"dms attention: tau and alpha_scale must be > 0 and dms_lambda >= 0, got tau={tau}, "
                f"alpha_scale={alpha_scale}, dms_lambda={dms_lambda}"
            )
        if backend not in NF.BACKENDS:
            raise ValueError(f"dms attention: backend must be one of {NF.BACKENDS}, got {backend!r}")
        self.window, self.backend = window, backend
        self.dms_lambda, self.tau = float(dms_lambda), float(tau)
        self.alpha_scale, self.alpha_offset = float(alpha_scale), float(alpha_offset)
        # the target in a (non-persistent) buffer: a schedule changing it every step never recompiles the model
        self.register_buffer("target_buf", torch.tensor(0.0), persistent=False)
        self.target_cr = target_cr

    @property
    def target_cr(self) -> float:
        """The compression ratio the auxiliary loss asks for (1 = keep everything)."""
        return self._target_cr

    @target_cr.setter
    def target_cr(self, value: float) -> None:
        if not value >= 1:
            raise ValueError(f"dms attention: target_cr must be >= 1 (1 = no eviction asked), got {value}")
        self._target_cr = float(value)
        self.target_buf.fill_(1.0 - 1.0 / self._target_cr)  # the share of tokens to evict

    def bind_query(self, projection: torch.nn.Linear) -> None:
        """The layer's query projection (rows ``head * D + i`` of its weight are query head ``head``'s neuron i; a fused
        qkv projection starts with them), read, not owned: `decision_logits` takes neuron 0 of each group's first
        query head."""
        self._query = [projection]  # a list: not a submodule of the core (its parameters stay the layer's)
        d, group = self.dims.head_dim, self.dims.n_head // self.dims.n_kv_head
        self.register_buffer("rows", torch.arange(self.dims.n_kv_head) * group * d, persistent=False)

    def decision_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, N, C]`` (the block's normalised input) -> the eviction logits ``[B, Hkv, N]`` (float32)."""
        if not hasattr(self, "_query"):
            raise RuntimeError("dms attention: its layer's query projection is not bound (DMSAttention.bind_query)")
        proj = self._query[0]
        bias = None if proj.bias is None else proj.bias.index_select(0, self.rows)
        z = F.linear(x, proj.weight.index_select(0, self.rows), bias)  # [B, N, Hkv]
        return (self.alpha_scale * z.float() - self.alpha_offset).transpose(1, 2)

    def hard_types(self, x: torch.Tensor) -> torch.Tensor:
        """The inference types ``[B, Hkv, N]`` int64 of the block input x ``[B, N, C]``: `EVICT` where the logit is
        > 0, else `KEEP`."""
        return torch.where(self.decision_logits(x) > 0, EVICT, KEEP)

    def forward(self, q, k, v, x) -> AttentionOutput:
        if not self.dims.causal:
            raise ValueError("dms attention is causal only: set model.causal=true")
        if not self.training:
            types = self.hard_types(x)
            y = NF.nats_attention_types(q, k, v, types, self.window, backend=self.backend)
            return AttentionOutput(y, stats=_stats(types == EVICT, types, self.window))
        z = self.decision_logits(x)
        u = torch.rand_like(z).clamp(1e-6, 1 - 1e-6)
        alpha = torch.sigmoid((z + torch.log(u) - torch.log1p(-u)) / self.tau)  # Gumbel-sigmoid [B, Hkv, N]
        mask = soft_mask(alpha, self.window, q)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        evicted = alpha.mean()
        aux = self.dms_lambda * F.relu(self.target_buf - evicted) / self.dims.n_layer
        with torch.no_grad():
            types = torch.where(z > 0, EVICT, KEEP)
        stats = _stats(types == EVICT, types, self.window)
        stats["alpha"] = evicted.detach()
        return AttentionOutput(y, aux_loss=aux, stats=stats)


def soft_mask(alpha: torch.Tensor, window: int, q: torch.Tensor) -> torch.Tensor:
    """The additive attention mask of training ``[B, Hq, N, N]`` in q's dtype: causal (-inf above the diagonal), and
    ``log(1 - alpha_j)`` for key j once the query is ``window`` or more positions after it."""
    N = alpha.shape[-1]
    i = torch.arange(N, device=alpha.device)
    past = (i[:, None] - i[None, :]) >= window  # [N, N] (query, key)
    keep = torch.log1p(-alpha.clamp(max=1 - 1e-6))  # [B, Hkv, N]
    bias = torch.where(past, keep[..., None, :], 0.0)  # [B, Hkv, N, N]
    bias = bias.masked_fill(i[None, :] > i[:, None], -math.inf)
    group = q.shape[1] // alpha.shape[1]
    return bias.repeat_interleave(group, dim=1).to(q.dtype)


def _stats(evicted: torch.Tensor, types: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """The layer's statistics: the share of evicted tokens and the KV area and peak fractions of the hard decisions
    (spec section 6, NAtS' `kv_cache_sizes` with two types)."""
    N = types.shape[-1]
    sizes = NF.kv_cache_sizes(types, window).double()  # [B, Hkv, N]
    area = sizes.sum(-1) / (N * (N + 1) / 2)
    peak = sizes.amax(-1) / N
    return {"evicted": evicted.float().mean(), "density": area.float().mean(), "peak": peak.float().mean()}
