"""`dms`: the KV cache of Dynamic Memory Sparsification (nats/attention/dms.py, docs/dms.md), on the engine's NAtS
storage with two of its types: a kept token is a global one (its row's segment, for good), a token marked for
eviction a sliding one (the ring of W = the model's eviction delay, visible to W queries, itself included, then
overwritten). The decisions are the model's own: the sign of the logit its query neuron gives for the block's input
(`nats.attention.dms.DMSAttention.decision_logits`), in the prompt, in each step and in a continuation, so that
decoding equals the eval forward.

The prompt is NAtS' (`NAtSRule.prompt` with the core's `hard_types`), not its fused prefill from a scorer's logits.
The step is NAtS' admission without locals in PyTorch operations (the attention is the engine's pool kernel, Triton
on CUDA; device tensors only, CUDA-graph safe), written to the packed buffers (NAtS' `step_torch` writes through
views, which a compiled transformers step would copy whole at every layer): the ring slot of the position written,
the kept tokens appended (a full segment keeps the token as an evicted one, as NAtS does), then the ring slot whose
window the query closed marked invalid.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nats.cache.engine import attend, write_kv
from nats.cache.policies.nats import GLOBAL, SLIDING, NAtSRule
from nats.cache.registry import register_cache


@register_cache("dms")
class DMSRule(NAtSRule):
    """DMS in the engine (module docstring): NAtS' planning, storage, continuation and measurements, with the types
    from the model's DMS decisions (kept = global, evicted = sliding) and its own step."""

    name = "dms"
    requires_core = "dms"

    def scored(self, ctx, q, k, backend: str) -> bool:
        # NAtS' fused prefill reads its scorer's logits: the prompt takes the core's hard_types (DMS' decisions)
        return False

    @staticmethod
    def chunk_types(core, q: Tensor, hidden: Tensor) -> Tensor:
        # hidden [B, n, C] -> [B, Hkv, n] -> rows [R, n]
        return core.hard_types(hidden).reshape(q.shape[0], -1)

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        size = self.kept(layer) + 1 if ctx.track else None  # the keys query pos reads: its row's and itself
        t = self.chunk_types(core, qr[:, :, None], hidden[:, None])[:, 0]  # [R] (hidden [B, C]: one token)
        if layer.type_table is not None:
            given = layer.type_table.at(pos)
            t = torch.where(given >= 0, given, t)
        t = torch.where((t != SLIDING) & (layer.length >= layer.cap), torch.full_like(t, SLIDING), t)  # full row
        layer.last_type.copy_(t)
        W = layer.ring_kv.shape[2]
        slot = pos % W
        kv = torch.stack((kr, vr)).reshape(2, -1, 1, kr.shape[-1])  # [2, R, 1, D]: ring slot of this position
        layer.ring_kv.index_copy_(2, slot, kv)
        layer.ring_valid.index_copy_(1, slot, (t == SLIDING)[:, None])
        keep = t == GLOBAL
        dest = torch.where(keep, layer.start + layer.length, torch.full_like(layer.start, layer.kv_pool.shape[1] - 1))
        write_kv(layer.kv_pool, dest, kr, vr)
        layer.length.add_(keep.to(layer.length.dtype))
        layer.n_global.add_(keep.to(layer.n_global.dtype))
        y = attend(layer, qr, ring=True, backend=ctx.backend)
        layer.ring_valid.index_fill_(1, (pos + 1) % W, False)  # the query closed the window of token pos - W + 1
        if ctx.track:
            layer.type_counts.scatter_add_(1, t[:, None], torch.ones_like(t)[:, None])
        return y, size
