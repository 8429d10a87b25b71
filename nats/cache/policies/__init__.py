"""The KV-cache policies, one file each, registered with ``@register_cache("name")`` (nats.cache.registry).

``full``, ``streaming_llm``, ``h2o``, ``snapkv``, ``pyramidkv``, ``adakv``, ``nats`` and ``h2o_dense`` (a labelled
parallel approximation of H2O, evaluation only). Adding a policy: a file here with a
:class:`nats.cache.rule.FixedRule` subclass (what the prompt keeps, what a step admits and evicts) and a
``conf/cache/<name>.yaml``; tests/test_contract_cache.py and tests/test_contract_paths.py then check it on every path
with every other policy.
"""
