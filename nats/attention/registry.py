"""One registry for attention cores: adding a method is adding one file with `@register_attention`.

An *attention core* receives the already projected (and position-encoded) queries, keys and values and
the block's normalised input, and returns the per-head attention output. Everything around it (the
projections, RoPE, the optional output gate, the output projection) lives in `nats.models.gpt`.

    core(q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D], x [B, N, C]) -> AttentionOutput

A core may return an auxiliary loss (added to the training loss, e.g. NAtS' sparsity term) and scalar
statistics (logged per layer, e.g. KV density).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from nats.registry import Registry


@dataclass(frozen=True)
class AttentionDims:
    """The shapes a core is built for (filled in by the model, not by the attention config)."""

    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    block_size: int
    layer_idx: int
    n_layer: int
    causal: bool = True


@dataclass
class AttentionOutput:
    y: torch.Tensor  # [B, Hq, N, D]
    aux_loss: torch.Tensor | None = None  # scalar, added to the training loss
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, logged per layer


class AttentionCore(nn.Module):
    """Base class. Subclasses take `dims: AttentionDims` first, then their own config keys."""

    name: str = "?"

    def __init__(self, dims: AttentionDims):
        super().__init__()
        self.dims = dims

    def forward(self, q, k, v, x) -> AttentionOutput:  # pragma: no cover - interface
        raise NotImplementedError


ATTENTIONS = Registry(
    "attention", "nats.attention", skip={"registry"},
    hint="model.attention.name=..., or add a file to nats/attention/ with @register_attention",
)
ATTENTION_CORES = ATTENTIONS.entries  # name -> core class
register_attention = ATTENTIONS.register
available_attention = ATTENTIONS.names


def build_attention(cfg: Mapping[str, Any], dims: AttentionDims) -> AttentionCore:
    """Build the core named by `cfg["name"]` with the remaining keys of `cfg` as keyword arguments."""
    cfg = dict(cfg)
    cls = ATTENTIONS.get(cfg.pop("name", None))
    name = cls.name
    try:
        return cls(dims, **cfg)
    except TypeError as err:
        raise TypeError(f"attention {name!r} does not accept the config {cfg}: {err}") from err
