"""The report of a generation, both kinds of model (`nats.generate`'s GPT models, `nats.hf.generate`'s transformers
models, `nats.hf.chat`'s turns): its summary as a few lines of text."""

from __future__ import annotations

from typing import Any

__all__ = ["summary"]


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def summary(report: dict[str, Any]) -> str:
    """The statistics as a few lines of text (the report of either kind of model)."""
    s = report["stats"]
    budget = "" if report["budget"] is None else f", budget {report['budget']}"
    lines = [
        f"policy {report['policy']}{budget}: {report['prompt_tokens']} prompt + {report['new_tokens']} new tokens "
        f"x {s['sequences']} sample(s), {report['seconds']:.2f} s ({report['tokens_per_s']} tokens/s) on "
        f"{report['device']} in {report['precision']} ({report['decode'].replace('_', ' ')} decoding)",
        f"kept KV entries per layer and KV head: {s['kept']:.1f} of {s['processed']} tokens processed (max "
        f"{s['kept_max']}), KV fraction {s['kv_fraction']:.3f}; area fraction {_fraction(s['area'])}, peak "
        f"fraction {_fraction(s['peak'])} ({s['layers']} layers x {s['kv_heads']} KV heads)",
        f"KV bytes kept {s['kept_bytes']:,} of {s['full_bytes']:,} without eviction (allocated "
        f"{s['allocated_bytes']:,})",
    ]
    if "type_fractions" in s:
        lines.append("token types: " + ", ".join(f"{k} {v:.3f}" for k, v in s["type_fractions"].items()))
    return "\n".join(lines)
