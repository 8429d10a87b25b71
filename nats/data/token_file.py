"""The ``.bin`` token file: its header, writing, reading, and the checked reads of the datasets.

A ``.bin`` file is a 64-byte header (:data:`MAGIC`, format version, dtype, token count, vocabulary size,
tokenizer name) followed by the tokens as little-endian uint16; documents are separated by ``<|endoftext|>``
(50256), which also follows the last one. Files are written under a temporary name, fsynced and renamed, so an
interrupted prepare never leaves a partial file under the final name.

Every window read is checked against the vocabulary size in the header (a max over its tokens, ~7 us per
1025-token window), so a corrupt token raises :class:`TokenCacheError` naming the file, not an ``IndexError`` in
the model's embedding; :meth:`nats.data.datamodule.TokenDataModule.setup` checks the model's vocabulary against
the header's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nats.data.tokenizer import VOCAB_SIZE
from nats.utils import atomic_path

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "BinHeader",
    "TokenCacheError",
    "write_token_bin",
    "read_bin_header",
    "open_token_bin",
]

MAGIC = b"NATSTOK\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 64
# magic, format version, dtype code, token count, vocabulary size, tokenizer name (NUL-padded); zero-padded to 64
_HEADER = struct.Struct("<8sIIQI16s")
_DTYPES = {1: np.dtype("<u2")}  # dtype code -> numpy dtype; code 1 = uint16 (vocabularies up to 65536)
_DTYPE_CODE = 1
_REBUILD = "delete it and rerun `nats-prepare` (or the training run) to rebuild the token cache"


class TokenCacheError(RuntimeError):
    """A ``.bin`` token file is truncated, foreign, of another format version or of another tokenizer."""


@dataclass(frozen=True)
class BinHeader:
    """The fields of a ``.bin`` header."""

    version: int
    dtype: np.dtype
    num_tokens: int
    vocab_size: int
    tokenizer: str


def _pack_header(num_tokens: int, tokenizer: str, vocab_size: int) -> bytes:
    name = tokenizer.encode("ascii")
    if len(name) > 16:
        raise ValueError(f"tokenizer name {tokenizer!r} longer than 16 bytes")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, _DTYPE_CODE, num_tokens, vocab_size, name)
    return head.ljust(HEADER_SIZE, b"\x00")


def write_token_bin(
    path: str | Path, chunks: Iterable[np.ndarray], tokenizer: str = "gpt2", vocab_size: int = VOCAB_SIZE
) -> int:
    """Write the concatenated ``chunks`` (1-D integer arrays) to ``path`` atomically; return the token count.

    The tokens stream into ``.<name>.<random>.tmp`` in the same folder, the header is written last, the file is
    fsynced and renamed over ``path``. On any exception (or interrupt) the temporary file is removed and
    ``path`` is left as it was.
    """
    path = Path(path)
    dtype = _DTYPES[_DTYPE_CODE]
    with atomic_path(path, fsync=True) as tmp, open(tmp, "wb") as f:
        f.write(b"\x00" * HEADER_SIZE)  # placeholder: a file without magic is never taken for a cache
        n = 0
        for chunk in chunks:
            arr = np.asarray(chunk)
            if arr.size and (arr.min() < 0 or arr.max() >= min(vocab_size, np.iinfo(dtype).max + 1)):
                raise ValueError(f"token ids outside [0, {vocab_size}) while writing {path}")
            f.write(arr.astype(dtype, copy=False).tobytes())
            n += arr.size
        f.seek(0)
        f.write(_pack_header(n, tokenizer, vocab_size))
    return n


def read_bin_header(path: str | Path, tokenizer: str | None = None) -> BinHeader:
    """Read and validate the header of ``path``: magic, version, dtype, file size, and tokenizer if given.

    Raises :class:`TokenCacheError` naming the file and the fix on any mismatch.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:  # an interrupted copy, a full disk: not a foreign file, so no talk of magic bytes
        raise TokenCacheError(
            f"{path} is truncated: it has {size} bytes, less than the {HEADER_SIZE}-byte header of a nats token "
            f"file (an interrupted copy or a full disk?); {_REBUILD}"
        )
    if raw[:8] != MAGIC:
        raise TokenCacheError(f"{path} is not a nats token file (bad magic bytes {raw[:8]!r}); {_REBUILD}")
    magic, version, code, num_tokens, vocab_size, name = _HEADER.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise TokenCacheError(f"{path} has format version {version}, this code reads {FORMAT_VERSION}; {_REBUILD}")
    if code not in _DTYPES:
        raise TokenCacheError(f"{path} has unknown dtype code {code}; {_REBUILD}")
    dtype = _DTYPES[code]
    expected = HEADER_SIZE + num_tokens * dtype.itemsize
    if size != expected:
        raise TokenCacheError(
            f"{path} is truncated or corrupt: its header says {num_tokens} tokens ({expected} bytes) but the file "
            f"has {size} bytes; {_REBUILD}"
        )
    header = BinHeader(version, dtype, num_tokens, vocab_size, name.rstrip(b"\x00").decode("ascii"))
    if tokenizer is not None and header.tokenizer != tokenizer:
        raise TokenCacheError(f"{path} was tokenised with {header.tokenizer!r}, expected {tokenizer!r}; {_REBUILD}")
    return header


def open_token_bin(path: str | Path, tokenizer: str | None = None) -> np.ndarray:
    """The tokens of ``path`` as a read-only ``np.memmap`` (1-D, uint16), after :func:`read_bin_header`."""
    header = read_bin_header(path, tokenizer)
    if header.num_tokens == 0:  # mmap cannot map zero bytes
        return np.empty(0, dtype=header.dtype)
    return np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_SIZE, shape=(header.num_tokens,))


class _TokenFile:
    """A ``.bin`` file memory-mapped lazily in each process (pickling sends the path, never the tokens)."""

    def __init__(self, path: Path, tokenizer: str) -> None:
        self.path, self.tokenizer = path, tokenizer
        header = read_bin_header(path, tokenizer)
        self.num_tokens, self.vocab_size = header.num_tokens, header.vocab_size
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = open_token_bin(self.path, self.tokenizer)
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def check(self, tokens: np.ndarray, start: int) -> np.ndarray:
        """``tokens`` (read from position ``start``) after checking that every id is inside the vocabulary in the
        header; a corrupt file raises :class:`TokenCacheError` naming it, not an ``IndexError`` in the model."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            i = int(np.argmax(tokens >= self.vocab_size))
            raise TokenCacheError(
                f"{self.path} is corrupt: token {start + i} has id {int(tokens[i])}, outside the vocabulary of "
                f"{self.vocab_size} ids in its header; {_REBUILD}"
            )
        return tokens

    def window(self, start: int, length: int) -> np.ndarray:
        """``tokens[start : start + length]``, checked (:meth:`check`; ~7 us for 1025 tokens)."""
        return self.check(self.tokens[start : start + length], start)
