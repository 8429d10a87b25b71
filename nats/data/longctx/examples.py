"""What the long-context task builders share: the example, the tokenizer interface they use, sentence splitting.

`LongContextExample` is the unit of every builder (`nats.data.longctx.tasks`, `nats.data.longctx.ruler`,
`nats.data.longctx.longbench`). The builders take any tokenizer with ``encode(text, add_special_tokens=False)``,
``decode``, ``name_or_path`` and ``len`` (a Hugging Face tokenizer, or a tiktoken encoding in a
:class:`TiktokenAdapter`); none of them imports transformers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LongContextExample", "TiktokenAdapter", "encode_fn", "tokenizer_fingerprint", "split_sentences"]


@dataclass
class LongContextExample:
    """One example: ``prompt_ids`` then ``answer_ids`` (the span the loss is taken on), and the task's name.

    ``meta``: what the generator chose (e.g. the passkey and its depth; the book and offset), JSON-able."""

    task: str
    prompt_ids: list[int]
    answer_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def input_ids(self) -> list[int]:
        """Prompt and answer, the model's input (the answer span is its last ``len(answer_ids)`` tokens)."""
        return self.prompt_ids + self.answer_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.answer_ids)


class TiktokenAdapter:
    """A :class:`tiktoken.Encoding` (e.g. ``nats.data.tokenizer.get_tokenizer("gpt2")``) with the small part of the
    Hugging Face tokenizer interface that this module uses (``encode(text, add_special_tokens=False)``, ``decode``,
    ``name_or_path``, ``len``)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.name_or_path = f"tiktoken:{encoding.name}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return self.encoding.decode(list(ids))

    def __len__(self) -> int:
        return self.encoding.n_vocab


def encode_fn(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> token ids`` without special tokens (BOS/EOS), for a Hugging Face tokenizer or an adapter."""
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


_PROBE = "Probe: The pass key is 40521. VAR QXZTA = 12345\n\n“Quoted”, naïve café — 3.14!"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash that tells tokenizers apart (its name, vocabulary size and the ids of a probe text), for the
    cache key."""
    probe = encode_fn(tokenizer)(_PROBE)
    name = str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__))
    blob = json.dumps([Path(name).name, len(tokenizer), probe])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences at ``.``/``!``/``?`` followed by white space and a capital or digit (the offline
    replacement of NLTK's ``sent_tokenize`` that RULER uses); white space inside a sentence is collapsed."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()] if text else []
