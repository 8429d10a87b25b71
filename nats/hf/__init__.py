"""NAtS for Hugging Face transformers Llama-family models (docs/hf.md).

Needs the ``hf`` extra (``pip install nats-attention[hf]``: transformers)::

    from transformers import AutoModelForCausalLM
    from nats.hf import attach_nats, nats_density

    model = attach_nats(AutoModelForCausalLM.from_pretrained(path), window=256)  # scorers only are trainable
    out = model(input_ids)                                   # NAtS attention (Triton on CUDA)
    loss = distillation_loss + lam * nats_density(model)     # the density is differentiable in the scorers
"""

from nats.hf.attention import ATTN_IMPLEMENTATION, nats_attention_forward
from nats.hf.cache import PolicyCache, use_policy_caches
from nats.hf.scorers import (
    SUPPORTED_MODEL_TYPES,
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

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "HFNAtSScorer",
    "PolicyCache",
    "attach_nats",
    "detach_nats",
    "is_attached",
    "load_nats_state_dict",
    "nats_attention_forward",
    "nats_density",
    "nats_state_dict",
    "nats_stats",
    "scorers",
    "set_force_type",
    "use_policy_caches",
]
