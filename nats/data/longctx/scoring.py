"""Scoring the answers of long-context examples, and naming a result row: what `nats-eval-hf` and the kvpress
methods share (no transformers). RULER's string match, token accuracy for the continuation task, LongBench's own
metrics; how many tokens to generate; a budget fraction in tokens, of the part of the prompt a protocol compresses."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from nats.data.longctx import LongContextExample
from nats.data.longctx.longbench import score_longbench
from nats.data.longctx.tasks import question_start


def references(example: LongContextExample) -> list[str]:
    """The strings a correct answer contains: the pass key, the needle's value, the chain's variable names, the
    answers a RULER task (`nats.data.longctx.ruler`) lists in ``meta["answers"]``."""
    meta = example.meta
    if "answers" in meta:
        return [str(a) for a in meta["answers"]]
    if example.task == "passkey":
        return [str(meta["passkey"])]
    if example.task == "niah":
        return [str(meta["value"])]
    if example.task == "variable_tracking":
        return [str(v) for v in meta["variables"]]
    raise ValueError(f"task {example.task!r} is scored by its tokens, not by strings")


def match_score(prediction: str, refs: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of `refs` in `prediction` (case-insensitive), each as a whole
    word (``40521`` is not found in ``140521``)."""
    found = [re.search(rf"(?<![0-9A-Za-z]){re.escape(r)}(?![0-9A-Za-z])", prediction, re.IGNORECASE) for r in refs]
    return sum(f is not None for f in found) / len(refs)


def token_accuracy(generated: Sequence[int], reference: Sequence[int]) -> float:
    """The fraction of `reference`'s positions where `generated` has the same token (missing ones are wrong)."""
    return sum(g == r for g, r in zip(generated, reference)) / len(reference)


def score(example: LongContextExample, generated: Sequence[int], text: str, k: int) -> tuple[float, Any]:
    """``(score in [0, 1], what was expected)`` of one answer: generated token ids and their decoded text."""
    if example.task == "pg19_continuation":
        ref = example.answer_ids[:k]
        return token_accuracy(generated[: len(ref)], ref), ref
    if example.task.startswith("longbench/"):
        return score_longbench(example, text), example.meta["answers"]
    refs = references(example)
    if example.meta.get("match") == "any":  # RULER's string_match_part (QA: any annotator's answer)
        return max(match_score(text, [r]) for r in refs), refs
    return match_score(text, refs), refs


def new_tokens(example: LongContextExample, margin: int, k: int) -> int:
    """How many tokens to generate: the answer's length + margin (the continuation: its first k tokens; LongBench:
    the dataset's generation length ``meta["max_new"]``)."""
    if "max_new" in example.meta:
        return int(example.meta["max_new"])
    if example.task == "pg19_continuation":
        return min(k, len(example.answer_ids))
    return len(example.answer_ids) + margin


def budget_tokens(fraction: float | None, prompt_len: int) -> int | None:
    return None if fraction is None else max(1, round(fraction * prompt_len))


def compressed_length(example: LongContextExample, tokenizer: Any, protocol: str) -> int:
    """The prompt tokens of ``example`` that a method compresses under ``protocol``: all of them (``project``), or
    the context before the question (``kvpress``: `nats.data.longctx.tasks.question_start`), the question then fed
    uncompressed."""
    return question_start(example, tokenizer) if protocol == "kvpress" else len(example.prompt_ids)


def _round(t: torch.Tensor) -> list:
    return torch.round(t.double(), decimals=6).tolist()


def key_of(run: dict[str, Any], example: LongContextExample) -> dict[str, Any]:
    return {"method": run["method"], "budget": run["budget"], "task": example.task, "index": example.meta["index"]}


def result_row(
    run: dict[str, Any],
    example: LongContextExample,
    *,
    budget_tokens: int | None,
    generated: Sequence[int],
    text: str,
    k: int,
    nll: float | None,
    kv: dict[str, float],
    kept: float,
    seen: int,
    seconds: float,
    per_head: dict[str, Any],
) -> dict[str, Any]:
    """One line of results.jsonl: the example's key, its score (`score` with the continuation length k), and the
    cache's KV accounting (``kv``: the means of area, peak and kv_fraction over layers and KV heads; kept, seen)
    with its per-head detail; the same fields for every method, the project's caches and kvpress' presses alike."""
    value, expected = score(example, generated, text, k)
    return {
        **key_of(run, example),
        "policy": run["policy"],
        "label": run["label"],
        "budget_tokens": budget_tokens,
        "prompt_tokens": len(example.prompt_ids),
        "new_tokens": len(generated),
        "score": value,
        "correct": value == 1.0,
        "expected": expected,
        "prediction": text,
        "generated": list(generated),
        "nll": nll,
        "area": float(kv["area"]),
        "peak": float(kv["peak"]),
        "kv_fraction": float(kv["kv_fraction"]),
        "kept": float(kept),
        "seen": seen,
        "seconds": round(seconds, 3),
        "per_head": per_head,
    }
