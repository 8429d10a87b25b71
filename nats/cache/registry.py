"""One registry for KV-cache policies: adding a policy is adding one file to nats/cache/policies/ with
`@register_cache` (and its conf/cache/<name>.yaml).

A *policy* is a subclass of :class:`nats.cache.rule.FixedRule`: what the cache of one attention layer keeps of a
prompt and how a decode step changes it, per sequence and KV head, with the policy's flags (``budgeted``,
``decodable``, ``requires_core``, ...). The engine runs it on every path (`nats.cache.engine_cache.EngineCache`;
`nats.cache.decode.make_caches` for the GPT model, `nats.hf.StaticPolicyCache` for transformers). Unknown names
fail with the list of registered ones.
"""

from __future__ import annotations

from nats.registry import Registry

# every module of nats.cache.policies holds one policy
CACHES = Registry(
    "cache policy",
    "nats.cache.policies",
    skip=set(),
    hint="or add a file to nats/cache/policies/ with @register_cache",
)
CACHE_POLICIES = CACHES.entries  # name -> FixedRule subclass
register_cache = CACHES.register
available_caches = CACHES.names
get_cache_class = CACHES.get
