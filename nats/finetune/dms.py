"""Retrofit DMS to a pretrained Hugging Face model by distillation (docs/dms.md): `LitDMSDistill`.

The same training as `nats.finetune.lit.LitNAtSDistill` (the dense model is the teacher; the loss is the MSE of the
final hidden states on the answer span plus the method's KV term; the optimiser, schedule, clipping, resumable Gumbel
noise and checkpoints are that module's), with DMS attached instead of NAtS (`nats.hf.attach_dms`):

* **trained**: the query projections (``q_proj``), whose rows give DMS' decisions (the paper retrains the whole
  model; here, like NAtS' scorers, only what decides the eviction, and the queries with it); every other weight is
  the pretrained model's;
* **KV term**: each layer's compression hinge (`nats.attention.dms.DMSAttention`), its ratio annealed by
  `nats.callbacks.CompressionSchedule` (conf/experiment/finetune_smollm2_dms.yaml);
* **files**: ``<run>/dms_q_proj.pt`` (the trained ``q_proj`` weights by their keys in the model; load them with
  ``model.load_state_dict(..., strict=False)`` after `attach_dms`) and ``<run>/dms_stats.json`` (per-layer KV area,
  peak and evicted share at every validation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

from nats.attention.dms import DMSAttention
from nats.finetune.lit import LitNAtSDistill
from nats.hf.dms import attach_dms

__all__ = ["LitDMSDistill"]

# the settings of every retrofit (`LitNAtSDistill._setup`); the other settings are DMS' (`nats.hf.attach_dms`)
TRAINING_KEYS = ("teacher_attn_implementation", "seed", "compile", "compile_mode", "compile_split_ddp")


class LitDMSDistill(LitNAtSDistill):
    """DMS' retrofit (module docstring). Args: ``model``, ``optim`` and the ``settings`` of `TRAINING_KEYS` as
    `LitNAtSDistill`'s; ``window`` (the eviction delay) and the other ``settings`` (``target_cr``, ``dms_lambda``,
    ``tau``, ``alpha_scale``, ``alpha_offset``, ``backend``): `nats.attention.dms.DMSAttention`'s."""

    adapter_file, stats_file = "dms_q_proj.pt", "dms_stats.json"

    def __init__(self, model: Mapping[str, Any], optim: Mapping[str, Any], window: int = 256, **settings: Any):
        L.LightningModule.__init__(self)  # not LitNAtSDistill's: it attaches NAtS
        self.save_hyperparameters()
        training = {k: settings.pop(k) for k in TRAINING_KEYS if k in settings}
        hf = self._setup("DMS retrofitting", model, optim, **training)
        for p in hf.parameters():
            p.requires_grad_(False)
        self.model = attach_dms(hf, window=int(window), **settings)
        for p in self.scorer_parameters():
            p.requires_grad_(True)
        self._attn_modules = [m for m in self.model.modules() if hasattr(m, "_nats_hidden")]
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_count: torch.Tensor | None = None

    def _cores(self) -> list[DMSAttention]:
        """The DMS cores, found once (they are read at every step)."""
        if not hasattr(self, "_dms_cores"):
            self._dms_cores = [m for m in self.model.modules() if isinstance(m, DMSAttention)]
        return self._dms_cores

    def scorer_parameters(self) -> list[nn.Parameter]:
        """The trained parameters: every layer's query projection (the source of DMS' decisions)."""
        return list(self.trained_state().values())

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.model.named_parameters() if ".q_proj." in f".{name}"}

    def sparsity(self) -> torch.Tensor:
        """Every layer's compression hinge of the last student forward (zero in eval mode, where there is none)."""
        terms = [c.last_aux for c in self._cores() if getattr(c, "last_aux", None) is not None]
        return sum(terms) if terms else torch.zeros((), device=self.device)

    def kv_density(self, argmax: bool = False) -> torch.Tensor:
        """The mean KV area fraction of the last forward's hard decisions (training and inference alike)."""
        return torch.stack([c.last_stats["density"] for c in self._cores()]).mean()

    def layer_stats(self) -> dict[str, torch.Tensor]:
        """``density``, ``peak`` and ``evicted`` per layer, ``[n_layer, 1]`` (means over the batch and KV heads)."""
        names = ("density", "peak", "evicted")
        return {n: torch.stack([c.last_stats[n] for c in self._cores()])[:, None] for n in names}
