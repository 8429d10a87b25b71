"""NAtS for Hugging Face transformers Llama-family models (docs/hf.md).

Needs the ``hf`` extra (``pip install nats-attention[hf]``: transformers)::

    from transformers import AutoModelForCausalLM
    from nats.hf import attach_nats, nats_density

    model = attach_nats(AutoModelForCausalLM.from_pretrained(path), window=256)  # scorers only are trainable
    out = model(input_ids)                                   # NAtS attention (Triton on CUDA)
    loss = distillation_loss + lam * nats_density(model)     # the density is differentiable in the scorers
"""

from nats.hf import attention as _attention
from nats.hf.attention import ATTN_IMPLEMENTATION, nats_attention_forward
from nats.hf.buffers import CacheBuffers
from nats.hf.cache import use_policy_caches
from nats.hf.dms import attach_dms
from nats.hf.fused import fuse_projections, unfuse_projections
from nats.hf.hooks import SUPPORTED_MODEL_TYPES
from nats.hf.scorers import (
    HFNAtSScorer,
    attach_nats,
    detach_nats,
    is_attached,
    load_nats_state_dict,
    nats_density,
    nats_state_dict,
    nats_stats,
    scorers,
    set_force_type,
)
from nats.hf.static_cache import StaticPolicyCache

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheBuffers",
    "SUPPORTED_MODEL_TYPES",
    "HFNAtSScorer",
    "StaticPolicyCache",
    "attach_dms",
    "attach_nats",
    "detach_nats",
    "fuse_projections",
    "is_attached",
    "load_nats_state_dict",
    "nats_attention_forward",
    "nats_density",
    "nats_state_dict",
    "nats_stats",
    "scorers",
    "set_force_type",
    "unfuse_projections",
    "use_policy_caches",
]

# "nats" in transformers' attention registry, before any model is routed to it (nats.hf.hooks.attach_hooks: the
# hooks live apart from the attention function, which imports the cache, which uses them)
_attention.register()
