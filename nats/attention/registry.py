"""One registry for attention cores: adding a method is adding one file with `@register_attention`.

An *attention core* receives the already projected (and position-encoded) queries, keys and values and
the block's normalised input, and returns the per-head attention output. Everything around it (the
projections, RoPE, the optional output gate, the output projection) lives in `nats.models.gpt`.

    core(q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D], x [B, N, C]) -> AttentionOutput

A core may return an auxiliary loss (added to the training loss, e.g. NAtS' sparsity term) and scalar
statistics (logged per layer, e.g. KV density).

What a core supports is declared on its class (read by the model, the KV-cache decoder and nats-eval, and
checked for every registered core by tests/test_contract_attention.py):

* ``supports_gqa``: accepts fewer KV heads than query heads (``n_kv_head < n_head``);
* ``decode_policy``: the KV-cache policy (``nats.cache``) that reproduces the core's forward token by token,
  e.g. ``"full"`` for dense softmax attention; ``None`` when the cache policies cannot run a model with this
  core (``nats.cache.decode`` and ``nats-eval`` refuse it). ``decodable`` is ``decode_policy is not None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    supports_gqa: bool = True  # accepts n_kv_head < n_head (grouped-query attention)
    decode_policy: str | None = None  # the KV-cache policy that reproduces this core token by token (None: none)

    def __init__(self, dims: AttentionDims):
        super().__init__()
        self.dims = dims

    @classmethod
    def decodable(cls) -> bool:
        """Whether the KV-cache policies (nats.cache) can decode a model with this core."""
        return cls.decode_policy is not None

    def forward(self, q, k, v, x) -> AttentionOutput:  # pragma: no cover - interface
        raise NotImplementedError


ATTENTIONS = Registry(
    "attention",
    "nats.attention",
    skip={"registry"},
    hint="model.attention.name=..., or add a file to nats/attention/ with @register_attention",
)
ATTENTION_CORES = ATTENTIONS.entries  # name -> core class
register_attention = ATTENTIONS.register
available_attention = ATTENTIONS.names


def decodable_attention() -> list[str]:
    """The registered cores that KV-cache decoding supports (``decode_policy`` set on the class)."""
    return [name for name in available_attention() if ATTENTIONS.get(name).decodable()]


def build_attention(cfg: Mapping[str, Any], dims: AttentionDims) -> AttentionCore:
    """Build the core named by `cfg["name"]` with the remaining keys of `cfg` as keyword arguments."""
    cfg = dict(cfg)
    cls = ATTENTIONS.get(cfg.pop("name", None))
    name = cls.name
    if dims.n_kv_head != dims.n_head and not cls.supports_gqa:
        raise ValueError(
            f"attention {name!r} does not support grouped-query attention (n_kv_head={dims.n_kv_head} "
            f"< n_head={dims.n_head}): set model.n_kv_head=null"
        )
    try:
        return cls(dims, **cfg)
    except TypeError as err:
        raise TypeError(f"attention {name!r} does not accept the config {cfg}: {err}") from err
