"""Fixed decode buffers for a process that serves request after request: one CUDA graph per shape, not per request.

A compiled decode step replays as a CUDA graph (`nats.hf.loop`), and a CUDA graph reads its inputs at the addresses
it was recorded with: torch's CUDA-graph trees record a new graph whenever a cache buffer (a static-address input)
lies somewhere else, and whenever a size differs. A `StaticPolicyCache` allocates its buffers at each prefill, so
every request of a changing workload recorded at least one graph (Llama-3.2-1B's shape, one H200: 50 requests of
batch 1-16 and prompts of 1k-32k decoded at 0.44x the speed of the same requests once their graphs existed).

`CacheBuffers` is the remedy a serving engine uses (gpt-fast's and vLLM's fixed buffers): one flat buffer per layer
and per cache tensor, grown to the largest request seen, of which each request's tensors are views at the start.
Every request then decodes from the same addresses, and with ``row_slots`` (each layer's pool at least rows x
``row_slots`` slots, so that the pool's size depends on the batch alone) the sizes repeat too: one graph per batch
size, recorded once (a warm-up over the batch sizes records them before the first request)::

    buffers = CacheBuffers()
    for ids in requests:                                   # batch 1-16, prompts up to 32k
        cache = StaticPolicyCache(model, "nats", max_new_tokens=64, row_slots=12_288, buffers=buffers)
        out = generate(model, ids, cache, 64)

Each layer's buffers are copied into the views as soon as the prefill has made them (one pass over the KV cache; one
layer's cache twice in memory for that moment); the buffers stay allocated between requests, as a serving engine's
do. One cache at a time decodes from them: a cache made while the previous one is still alive keeps its own buffers
(correct, but it records graphs of its own).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import Tensor

from nats.cache.engine import mark_static

__all__ = ["CacheBuffers"]


class CacheBuffers:
    """Flat buffers, one per (layer, cache tensor), that successive caches decode from (module docstring)."""

    def __init__(self):
        self._flat: dict[tuple[int, str], Tensor] = {}
        self._starts: set[int] = set()  # the buffers' addresses (a view's storage starts at its buffer's)
        self._owner: weakref.ref | None = None

    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def adopt(self, cache, layer=None) -> bool:
        """Move the decode buffers of ``cache``'s ``layer`` (default: every layer; each tensor its ``tensors()``
        lists) into views of these buffers, their contents copied; a tensor other layers of the cache refer to too
        (the position counter) is replaced there as well. Returns False (the cache keeping its own buffers) while
        another cache that adopted them is still alive."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not cache:
            del owner
            gc.collect()  # a finished cache that only a reference cycle keeps (e.g. a compiler's garbage)
            owner = self._owner()
            if owner is not None and owner is not cache:
                return False
        self._owner = weakref.ref(cache)
        refs: dict[int, list] = {}  # id of each tensor the cache's layers hold -> (layer, attribute) holding it
        for other in cache.layers:
            for n, v in vars(other).items():
                if isinstance(v, Tensor):
                    refs.setdefault(id(v), []).append((other, n))
        for one in cache.layers if layer is None else [layer]:
            for t in one.tensors():
                if id(t) not in refs or self._holds(t):
                    continue
                owner_layer, name = refs[id(t)][0]
                view = self._place((owner_layer.layer_idx, name), t)
                for other, n in refs.pop(id(t)):  # every reference to the tensor, so that it is freed now
                    setattr(other, n, view)
        return True

    def _holds(self, t: Tensor) -> bool:
        """``t`` is a view of one of these buffers (adopted already)."""
        return t.untyped_storage().data_ptr() in self._starts

    def _place(self, key: tuple[int, str], t: Tensor) -> Tensor:
        """A view of the buffer for ``key`` shaped as ``t``, holding ``t``'s values (the buffer grown first if it is
        too small, or of another dtype or device)."""
        flat = self._flat.get(key)
        if flat is None or flat.numel() < t.numel() or flat.dtype != t.dtype or flat.device != t.device:
            del flat
            self._flat.pop(key, None)  # the old buffer freed before the larger one is allocated
            flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
            self._flat[key] = flat
            self._starts = {f.data_ptr() for f in self._flat.values()}
        view = flat[: t.numel()].view(t.shape)
        view.copy_(t)
        mark_static(view)
        return view
