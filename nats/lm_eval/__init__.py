"""The lm-evaluation-harness model ``nats`` (`nats.lm_eval.model.NAtSLM`, registered on import) and its command line,
``python -m nats.lm_eval`` (docs/lm_eval.md)."""

from nats.lm_eval.model import NAtSLM

__all__ = ["NAtSLM"]
