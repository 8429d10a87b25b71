"""`full`: dense causal attention; every key is kept (spec section 7)."""

from __future__ import annotations

from nats.cache.registry import register_cache
from nats.cache.rule import AppendRule


@register_cache("full")
class FullRule(AppendRule):
    """Keep the whole prompt, append every new token: query i sees keys 0..i."""

    name = "full"
