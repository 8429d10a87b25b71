"""One registry for attention cores: adding a method is adding one file with `@register_attention`.

An *attention core* receives the already projected (and position-encoded) queries, keys and values and
the block's normalised input, and returns the per-head attention output. Everything around it (the
projections, RoPE, the optional output gate, the output projection) lives in `nats.models.gpt`.

    core(q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D], x [B, N, C]) -> AttentionOutput

A core may return an auxiliary loss (added to the training loss, e.g. NAtS' sparsity term) and scalar
statistics (logged per layer, e.g. KV density).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn


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


ATTENTION_CORES: dict[str, type[AttentionCore]] = {}


def register_attention(name: str) -> Callable[[type[AttentionCore]], type[AttentionCore]]:
    def deco(cls: type[AttentionCore]) -> type[AttentionCore]:
        if name in ATTENTION_CORES and ATTENTION_CORES[name] is not cls:
            raise ValueError(f"attention core {name!r} is registered twice ({ATTENTION_CORES[name]} and {cls})")
        cls.name = name
        ATTENTION_CORES[name] = cls
        return cls

    return deco


def _import_all_cores() -> None:
    """Import every module of `nats.attention` so that their `@register_attention` run."""
    import nats.attention as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "registry":
            importlib.import_module(f"nats.attention.{mod.name}")


def available_attention() -> list[str]:
    _import_all_cores()
    return sorted(ATTENTION_CORES)


def build_attention(cfg: Mapping[str, Any], dims: AttentionDims) -> AttentionCore:
    """Build the core named by `cfg["name"]` with the remaining keys of `cfg` as keyword arguments."""
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    _import_all_cores()
    if name not in ATTENTION_CORES:
        raise ValueError(
            f"unknown attention {name!r}: choose one of {sorted(ATTENTION_CORES)} "
            f"(model.attention.name=..., or add a file to nats/attention/ with @register_attention)"
        )
    cls = ATTENTION_CORES[name]
    try:
        return cls(dims, **cfg)
    except TypeError as err:
        raise TypeError(f"attention {name!r} does not accept the config {cfg}: {err}") from err
