"""One registry for KV-cache policies: adding a policy is adding one file to nats/cache/policies/ with
`@register_cache` (and its conf/cache/<name>.yaml).

A *policy* is a subclass of :class:`nats.cache.base.LayerCache`: the KV cache of one attention layer for a
batch of sequences, per KV head. `build_cache(name, ...)` builds one; `nats.cache.decode.make_caches` builds one
per layer of a model. Unknown names fail with the list of registered ones.
"""

from __future__ import annotations

from typing import Any

from nats.registry import Registry

# every module of nats.cache.policies holds one policy
CACHES = Registry(
    "cache policy",
    "nats.cache.policies",
    skip=set(),
    hint="or add a file to nats/cache/policies/ with @register_cache",
)
CACHE_POLICIES = CACHES.entries  # name -> LayerCache subclass
register_cache = CACHES.register
available_caches = CACHES.names
get_cache_class = CACHES.get


def build_cache(name: str, **kwargs: Any):
    """Build the policy `name` with keyword arguments (see `LayerCache.__init__` and the policy's own)."""
    cls = get_cache_class(name)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"cache policy {name!r} does not accept the arguments {sorted(kwargs)}: {err}") from err
