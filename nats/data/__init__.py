"""Data layer: tokenizer, text sources, token cache and the Lightning datamodule.

See docs/data.md. The public entry point is :class:`TokenDataModule`; ``nats-prepare`` tokenises a source
ahead of training.
"""

from nats.data.datamodule import TokenDataModule
from nats.data.sources import SOURCES, SPLITS, Document, TextSource, get_source, register_source
from nats.data.token_file import TokenCacheError, open_token_bin, read_bin_header, write_token_bin
from nats.data.tokenizer import EOT, VOCAB_SIZE, get_tokenizer

__all__ = [
    "EOT",
    "VOCAB_SIZE",
    "get_tokenizer",
    "SPLITS",
    "SOURCES",
    "Document",
    "TextSource",
    "get_source",
    "register_source",
    "TokenDataModule",
    "TokenCacheError",
    "write_token_bin",
    "read_bin_header",
    "open_token_bin",
]
