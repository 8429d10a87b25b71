"""The KV-cache policies, one file each, registered with ``@register_cache("name")`` (nats.cache.registry).

``full``, ``streaming_llm``, ``h2o``, ``h2o_dense`` (a labelled parallel approximation of H2O, evaluation only)
and ``nats``. Adding a policy: a file here with a :class:`nats.cache.base.LayerCache` subclass and a
``conf/cache/<name>.yaml``; tests/test_contract_cache.py then checks it with every other policy.
"""
