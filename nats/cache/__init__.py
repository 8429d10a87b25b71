"""KV-cache policies (NATS_SPEC.md sections 5-7) and decoding through them.

Policies (one file each in nats/cache/policies/, registered with `@register_cache`): ``full``,
``streaming_llm`` (budget B, 4 sinks),
``h2o`` (budget B, B/2 recent, the exact sequential rule), ``nats`` (the learned types: ring of W sliding slots,
per-head segments of globals + live locals, planned for the decoded tokens), and the labelled evaluation-only
approximation ``h2o_dense``. See docs/kv_cache.md.
"""

from nats.cache.decode import (
    GraphDecoder,
    check_model,
    decode_step,
    generate,
    make_caches,
    policy_logits,
    prefill,
)
from nats.cache.engine_cache import EngineCache
from nats.cache.registry import available_caches, get_cache_class, register_cache
from nats.cache.rule import FixedRule

__all__ = [
    "FixedRule",
    "EngineCache",
    "register_cache",
    "available_caches",
    "get_cache_class",
    "make_caches",
    "prefill",
    "decode_step",
    "policy_logits",
    "generate",
    "check_model",
    "GraphDecoder",
]
