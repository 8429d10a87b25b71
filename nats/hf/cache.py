"""What every project cache layer shares with transformers: `FixedRowsLayer` (rows that keep their own policy state,
so beam search and batch reordering are refused) and `use_policy_caches`, which routes a model without NAtS scorers
through the project's attention function so that `nats.hf.StaticPolicyCache` can run any policy on it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin


class FixedRowsLayer(CacheLayerMixin):
    """A cache layer whose rows (sequence x KV head) keep their own policy state, which cannot be reordered,
    copied or selected: beam search, ``num_return_sequences > 1`` and contrastive search are refused, naming the
    owner's class (``self.owner``). ``update`` keeps the new keys/values in ``pending`` for the attention call that
    follows (the owner's ``attend``)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner, layer_idx: int):
        super().__init__()
        # the owner by a weak reference: owner -> layers -> owner would be a reference cycle, and a cache (at 8B,
        # batch 8 x 32k, 34 GB of buffers) would be freed only by Python's cyclic collector, requests after it
        # allocating theirs meanwhile (out of memory after three requests)
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def owner(self):
        """The cache this layer belongs to."""
        return self._owner()

    def _refuse(self, what: str):
        raise NotImplementedError(f"{type(self.owner).__name__} does not support {what}")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search (num_beams=1 only)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("contrastive search or batch selection")


def use_policy_caches(model: nn.Module) -> nn.Module:
    """Route a supported model's attention through nats so that `nats.hf.StaticPolicyCache` can run any policy on it
    (without NAtS scorers; `attach_nats` does this too). Without such a cache the model then computes ordinary causal
    attention (the ``full`` policy's prefill). Undo with `nats.hf.detach_nats`."""
    from nats.hf.hooks import attach_hooks  # noqa: PLC0415

    return attach_hooks(model)
