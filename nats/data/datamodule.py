"""From text to batches: the token cache (``.bin`` files) and :class:`TokenDataModule`.

Token cache
    Each source is tokenised once into ``<cache_dir>/<name>-<key sha>-<tokenizer>/{split}.bin`` (plus
    ``meta.json``); ``<name>`` is the source's name unless ``cache_name`` is set. The key is configuration only
    (:meth:`~nats.data.sources.TextSource.cache_key`), so the folder is found where the raw data is absent and
    such a cache trains alone; ``meta.json`` stores the content fingerprint, checked where the data is present.
    A ``.bin`` file is a 64-byte header (:data:`MAGIC`, format version, dtype, token count, vocabulary size,
    tokenizer name) followed by the tokens as little-endian uint16; documents are separated by
    ``<|endoftext|>`` (50256), which also follows the last one. Files are written under a temporary name, fsynced
    and renamed, so an interrupted prepare never leaves a partial file under the final name.

    Every window read is checked against the vocabulary size in the header (a max over its tokens, ~7 us per
    1025-token window), so a corrupt token raises :class:`TokenCacheError` naming the file, not an ``IndexError``
    in the model's embedding; :meth:`TokenDataModule.setup` checks the model's vocabulary against the header's.

Batches
    ``(x, y)``: two int64 tensors of shape ``[B, block_size]``, ``y`` is ``x`` shifted left by one token.

    * train: windows of ``block_size + 1`` tokens at random offsets. Sample number ``s`` (a global counter over
      the whole run) has offset ``default_rng([seed, s]).integers(0, n - block_size)``, so the stream is a pure
      function of ``(seed, s)``: rank ``r`` of ``W`` reads ``s = start + r, start + r + W, ...`` with
      ``start = global_step * accumulate_grad_batches * micro_batch_size * W`` (the samples already consumed),
      which makes resumption from a checkpoint exact and independent of the number of dataloader workers.
    * validation / test: the consecutive windows ``tokens[k*N : k*N + N + 1]``, ``N = block_size``, in order;
      window ``k`` predicts tokens ``k*N + 1 ... k*N + N``, so every token after the first is predicted exactly
      once. Rank ``r`` takes windows ``r, r + W, ...`` (the count is cut to a multiple of ``W`` so that all ranks
      run the same number of batches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from nats.data.sources import SPLITS, Document, TextSource, get_source
from nats.data.tokenizer import EOT, VOCAB_SIZE, get_tokenizer
from nats.utils import atomic_path, atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "BinHeader",
    "TokenCacheError",
    "write_token_bin",
    "read_bin_header",
    "open_token_bin",
    "cache_folder",
    "is_complete_cache",
    "find_token_caches",
    "check_token_cache",
    "prepare_token_cache",
    "TrainWindows",
    "ResumableSampler",
    "EvalWindows",
    "StridedSampler",
    "ResumableDataLoader",
    "ResumableDataModule",
    "TokenDataModule",
]

# --------------------------------------------------------------------------------------------------------------
# .bin format
# --------------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------------
# tokenising a source into the cache
# --------------------------------------------------------------------------------------------------------------


_CACHE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def cache_folder(cache_dir: str | Path, source: TextSource, tokenizer: str = "gpt2", name: str | None = None) -> Path:
    """``<cache_dir>/<name>-<sha1 of the source's cache key, 10 hex>-<tokenizer>``; ``name`` defaults to the
    source's name. The key (:meth:`TextSource.cache_key`) never needs the raw data, so this works without it."""
    if name is not None and not _CACHE_NAME.fullmatch(name):
        raise ValueError(f"cache_name {name!r} must be letters, digits, '.', '_' or '-' (a folder name prefix)")
    key = json.dumps({"format": FORMAT_VERSION, **source.cache_key()}, sort_keys=True)
    return Path(cache_dir) / f"{name or source.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}-{tokenizer}"


def _content(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    """A fingerprint without the data's location (``path``: caches made before the location left the fingerprint
    carry it), i.e. what determines the tokens."""
    return None if fingerprint is None else {k: v for k, v in fingerprint.items() if k != "path"}


def _bins(folder: Path) -> dict[str, Path]:
    return {split: folder / f"{split}.bin" for split in SPLITS}


def is_complete_cache(folder: str | Path) -> bool:
    """Whether ``folder`` holds the three ``.bin`` files and ``meta.json`` (a finished prepare)."""
    folder = Path(folder)
    return (folder / "meta.json").is_file() and all(p.is_file() for p in _bins(folder).values())


def find_token_caches(cache_dir: str | Path, source: str | None = None, tokenizer: str | None = None) -> list[Path]:
    """The complete caches in ``cache_dir`` (optionally of one source and tokenizer), by folder name."""
    out = []
    for meta_path in sorted(Path(cache_dir).glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if source not in (None, meta.get("source")) or tokenizer not in (None, meta.get("tokenizer")):
            continue
        if is_complete_cache(meta_path.parent):
            out.append(meta_path.parent)
    return out


def _describe(folder: Path) -> str:
    meta = json.loads((folder / "meta.json").read_text())
    origin = meta.get("options") or {k: v for k, v in (meta.get("fingerprint") or {}).items() if k == "path"}
    return f"{folder} (source {meta.get('source')!r}" + (f", made from {origin}" if origin else "") + ")"


def check_token_cache(folder: str | Path, source: TextSource, tokenizer: str = "gpt2") -> dict[str, Any]:
    """Validate a complete cache for ``source`` and return its ``meta.json``.

    Checks the three headers (size, format, tokenizer), the source name in ``meta.json`` and, where the raw data
    is present (:meth:`TextSource.available`), that the stored content fingerprint equals the data's. Raises
    :class:`TokenCacheError` naming the folder and the fix.
    """
    folder = Path(folder)
    for path in _bins(folder).values():
        read_bin_header(path, tokenizer)  # corrupt files raise here, with the fix in the message
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("source", source.name) != source.name:
        raise TokenCacheError(
            f"{folder} is a token cache of source {meta['source']!r}, but this data config reads source "
            f"{source.name!r}; use data={meta['source']} (with data.cache_path={folder}) or another cache"
        )
    if source.available():
        now = source.fingerprint()
        if _content(meta.get("fingerprint")) != _content(now):
            raise TokenCacheError(
                f"{folder} was tokenised from other data than the source reads now (fingerprint "
                f"{_content(meta.get('fingerprint'))} in its meta.json, {_content(now)} now: books were added, "
                f"removed or changed, or data.path points elsewhere). Delete {folder} and rerun `nats-prepare` with "
                "this data config to tokenise the current data (or restore the data the cache was made from)"
            )
        log.info("token cache %s (matches the raw data)", folder)
    else:
        log.info(
            "raw data of source %r not present here; using the token cache %s as it is (made from %s)",
            source.name, folder, meta.get("options") or meta.get("fingerprint"),
        )  # fmt: skip
    return meta


def _tokenize(docs: Iterable[Document], tokenizer: str, names: list[str], bar: tqdm) -> Iterator[np.ndarray]:
    """Encode documents in batches (tiktoken threads) and yield each as uint16 tokens followed by EOT."""
    enc = get_tokenizer(tokenizer)
    batch: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for ids in enc.encode_ordinary_batch(batch, num_threads=max(1, min(8, os.cpu_count() or 1))):
            ids.append(EOT)
            bar.update(1)
            yield np.asarray(ids, dtype=np.uint16)
        batch.clear()

    chars = 0
    for doc in docs:
        names.append(doc.name)
        batch.append(doc.text)
        chars += len(doc.text)
        if len(batch) >= 64 or chars >= 32_000_000:
            yield from flush()
            chars = 0
    if batch:
        yield from flush()


def prepare_token_cache(
    source: TextSource,
    cache_dir: str | Path,
    tokenizer: str = "gpt2",
    *,
    name: str | None = None,
    folder: str | Path | None = None,
    options: dict[str, Any] | None = None,
) -> Path:
    """Tokenise ``source`` into its cache folder unless a complete cache is there; return the folder.

    Args:
        source, cache_dir, tokenizer: what to tokenise, where the caches live, with which tokenizer.
        name: prefix of the cache folder's name (default: the source's name); see :func:`cache_folder`.
        folder: an explicit cache folder (``data.cache_path``): it must be complete; nothing is tokenised.
        options: the source's options, recorded in ``meta.json`` (where the cache was made from).

    A complete cache is checked (:func:`check_token_cache`: against the raw data where that is present) and
    used; with the raw data absent it is used as it is, so a cache prepared on one machine and copied to
    another trains there alone. Splits whose ``.bin`` already exists (and is valid) are kept, so an interrupted
    prepare resumes with the missing splits (unless the data changed in between: ``.partial.json`` holds the
    fingerprint of the prepare in progress). ``meta.json`` (fingerprint, token and document counts, document
    names) is written last.
    """
    explicit = folder is not None
    folder = Path(folder).expanduser() if explicit else cache_folder(cache_dir, source, tokenizer, name)
    if is_complete_cache(folder):
        check_token_cache(folder, source, tokenizer)
        return folder
    if explicit:
        missing = [p.name for p in [*_bins(folder).values(), folder / "meta.json"] if not p.is_file()]
        raise FileNotFoundError(
            f"data.cache_path={folder} is not a complete token cache (missing {missing}); point it at a folder "
            "written by `nats-prepare` (<data_dir>/<name>-<hash>-<tokenizer>/ with train.bin validation.bin "
            "test.bin meta.json), or unset it to prepare the cache from the raw data"
        )
    if not source.available():
        found = [_describe(f) for f in find_token_caches(cache_dir, source.name, tokenizer)]
        hint = (
            f"\nNo complete token cache {folder} either. To train from a cache prepared elsewhere, copy that "
            f"folder to {folder.parent}/ (its name must stay {folder.name}), or set data.cache_path=/path/to/it."
            + (f" Caches of source {source.name!r} in {folder.parent}: " + "; ".join(found) if found else "")
        )
        try:
            source.prepare()
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{err}{hint}") from err
        except ValueError as err:
            raise ValueError(f"{err}{hint}") from err

    source.prepare()
    fingerprint = source.fingerprint()
    bins = _bins(folder)
    meta_path, partial = folder / "meta.json", folder / ".partial.json"
    folder.mkdir(parents=True, exist_ok=True)
    old_meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    kept = [split for split, path in bins.items() if path.is_file()]
    if kept:  # from an interrupted prepare: keep them only if made from this data
        before = json.loads(partial.read_text()) if partial.is_file() else old_meta.get("fingerprint")
        if before is not None and _content(before) != _content(fingerprint):
            log.warning("%s: discarding %s of an interrupted prepare of other data", folder, kept)
            for split in kept:
                bins[split].unlink()
    _write_json(partial, fingerprint)
    meta: dict[str, Any] = {
        "source": source.name,
        "fingerprint": fingerprint,
        "options": {k: v for k, v in (options or {}).items() if v is not None},
        "tokenizer": tokenizer,
        "format": FORMAT_VERSION,
        "num_tokens": {},
        "documents": {},
    }
    for split, path in bins.items():
        if path.is_file():  # kept from an interrupted prepare; its document names are known only from old meta
            meta["num_tokens"][split] = read_bin_header(path, tokenizer).num_tokens
            meta["documents"][split] = old_meta.get("documents", {}).get(split)
            continue
        names: list[str] = []
        desc, total = f"tokenise {source.name}/{split}", source.num_documents(split)
        with tqdm(total=total, desc=desc, unit="doc", leave=False) as bar:  # gone when done: one line per split
            n = write_token_bin(path, _tokenize(source.documents(split), tokenizer, names, bar), tokenizer)
        if not names:
            path.unlink()
            raise ValueError(f"{source.name}: split {split!r} has no documents; check the source")
        meta["num_tokens"][split] = n
        meta["documents"][split] = names
        log.info("tokenised %s/%s: %d documents, %s tokens", source.name, split, len(names), f"{n:,}")
    _write_json(meta_path, meta)
    partial.unlink(missing_ok=True)
    log.info("token cache %s prepared", folder)
    return folder


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temporary file + rename)."""
    atomic_write(path, json.dumps(obj, indent=1))


# --------------------------------------------------------------------------------------------------------------
# datasets and samplers
# --------------------------------------------------------------------------------------------------------------


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


def _check_not_empty(file: _TokenFile, split: str) -> None:
    """Raise ``ValueError`` when the documents of a split were all empty (the file holds only the end-of-text
    separators that follow each document), naming the split and the fix. Checked on files of < 1M tokens only
    (an empty split is small; a large one is not read for this)."""
    if file.num_tokens >= 1 << 20 or not file.num_tokens:
        return
    tokens = np.asarray(file.tokens)
    if (tokens == EOT).all():
        raise ValueError(
            f"the {split} split is empty: its {file.num_tokens} document(s) hold no text ({file.path} has only their "
            f"end-of-text separators). Put text into the source's {split} files (or point the data config at "
            f"another corpus), then delete the token cache {file.path.parent} so that it is tokenised again"
        )


def _too_short(file: _TokenFile, block_size: int) -> ValueError:
    return ValueError(
        f"{file.path} holds {file.num_tokens} tokens, fewer than block_size + 1 = {block_size + 1} (one window; "
        "block_size is the model's context, model.block_size): use a model with a shorter context, or more data"
    )


def _xy(window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(window.astype(np.int64))  # [N + 1]
    return t[:-1], t[1:]  # x, y: [N] each


class TrainWindows(Dataset):
    """Random training windows: item ``s`` is the window of ``block_size + 1`` tokens at a pseudo-random offset
    that depends on ``(seed, s)`` only. ``len`` is nominal: any non-negative ``s`` is valid."""

    def __init__(self, file: _TokenFile, block_size: int, seed: int, length: int) -> None:
        if file.num_tokens < block_size + 1:
            raise _too_short(file, block_size)
        self.file, self.block_size, self.seed, self.length = file, block_size, seed, length

    def offset(self, s: int) -> int:
        """Start of window ``s``: uniform over the ``n - block_size`` offsets where a full window fits."""
        return int(np.random.default_rng([self.seed, s]).integers(0, self.file.num_tokens - self.block_size))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _xy(self.file.window(self.offset(s), self.block_size + 1))


class ResumableSampler(Sampler[int]):
    """Yields the global sample numbers of one rank: ``start + rank, start + rank + world_size, ...``.

    ``start`` may be a callable, evaluated at each ``iter()`` (each epoch, each resumption), so that the stream
    continues where the consumed-sample counter stands. ``len`` (``num_samples`` per rank) is fixed.
    """

    def __init__(
        self, num_samples: int, rank: int = 0, world_size: int = 1, start: int | Callable[[], int] = 0
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.num_samples, self.rank, self.world_size, self.start = num_samples, rank, world_size, start

    def __iter__(self) -> Iterator[int]:
        start = self.start() if callable(self.start) else self.start
        first = start + self.rank
        return iter(range(first, first + self.num_samples * self.world_size, self.world_size))

    def __len__(self) -> int:
        return self.num_samples


EVAL_WINDOWS = ("spread", "first")  # which windows a cap of max_windows takes (EvalWindows)


def check_eval_windows(value: str, key: str = "eval_windows") -> str:
    if value not in EVAL_WINDOWS:
        raise ValueError(
            f"{key}={value!r} is not a window choice: use spread (max_windows windows spread evenly over the split) "
            "or first (the split's first max_windows windows)"
        )
    return value


class EvalWindows(Dataset):
    """Validation/test windows: ``tokens[k*N : k*N + N + 1]`` with ``N = block_size``, for every ``k`` of the split
    in order, or, capped at ``max_windows`` below the split's count ``n``, ``m = max_windows`` of them:

    * ``windows="spread"`` (default): spread evenly over the whole split (``k_i = floor(i * n / m)``,
      deterministic): a quick evaluation then samples every part of the split (all its books, in proportion to
      their length), not its first few books;
    * ``windows="first"``: ``k = 0 .. m - 1``, the split's first books (the protocol of results computed before
      the evenly spread choice existed; the studies keep it so that their tables stay comparable)."""

    def __init__(self, file: _TokenFile, block_size: int, max_windows: int | None = None, windows: str = "spread"):
        if file.num_tokens < block_size + 1:
            raise _too_short(file, block_size)
        self.file, self.block_size = file, block_size
        n = (file.num_tokens - 1) // block_size
        self.num_windows = n if max_windows is None else min(n, max_windows)
        self.starts: np.ndarray | None = None  # window numbers k when capped and spread; None = k = 0, 1, ...
        if self.num_windows < n and check_eval_windows(windows, "windows") == "spread":
            self.starts = (np.arange(self.num_windows, dtype=np.int64) * n) // self.num_windows

    def window_index(self, i: int) -> int:
        """The window number ``k`` of item ``i`` (``tokens[k*N : k*N + N + 1]``)."""
        return i if self.starts is None else int(self.starts[i])

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        return _xy(self.file.window(self.window_index(i) * self.block_size, self.block_size + 1))

    def targets(self, num_windows: int | None = None) -> np.ndarray:
        """The predicted tokens of the first ``num_windows`` items (all by default), in order."""
        n = self.num_windows if num_windows is None else num_windows
        if self.starts is None:
            return self.file.window(1, n * self.block_size)
        offsets = (self.starts[:n, None] * self.block_size + np.arange(1, self.block_size + 1)).ravel()
        return self.file.check(self.file.tokens[offsets], 0)


class StridedSampler(Sampler[int]):
    """Indices ``rank, rank + world_size, ...`` below ``length`` cut to a multiple of ``world_size``: every rank
    gets the same number of windows, none twice (at most ``world_size - 1`` trailing windows are dropped)."""

    def __init__(self, length: int, rank: int = 0, world_size: int = 1) -> None:
        self.used = length - length % world_size
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.used, self.world_size))

    def __len__(self) -> int:
        return self.used // self.world_size


def worker_context(num_workers: int):
    """The multiprocessing start method for a DataLoader's worker processes: None (the process' default) unless
    that default is not one of the platform's own methods, as inside a job of Hydra's joblib launcher, whose
    loky workers make loky's start method the default and cannot start a DataLoader's workers with it; then the
    platform's default method."""
    if num_workers == 0:
        return None
    import multiprocessing as mp  # noqa: PLC0415

    own = mp.get_all_start_methods()
    method = mp.get_start_method(allow_none=True)
    return None if method is None or method in own else own[0]


def worker_options(num_workers: int) -> dict[str, Any]:
    """A DataLoader's worker settings, the same for every loader of the project: ``num_workers`` processes, kept
    across epochs, started by `worker_context`'s method."""
    return {
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
        "multiprocessing_context": worker_context(num_workers),
    }


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as resumable (``state_dict``/``load_state_dict``): its position is derived
    from ``trainer.global_step`` by :class:`ResumableSampler`, so there is no state to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class ResumableDataModule(L.LightningDataModule):
    """The training stream of a datamodule that resumes exactly: global sample ``s`` goes to rank ``s % world``,
    and the stream starts at the samples already consumed (`consumed_samples`, from ``trainer.global_step``), so
    a run resumed from a checkpoint reads what the uninterrupted one would have, with no loader state to save
    (`ResumableSampler`, `ResumableDataLoader`). Evaluation reads every item once (`StridedSampler`).

    Subclasses set ``micro_batch_size`` and give `_one_pass_batches`; `TokenDataModule`,
    `nats.data.tasks.TaskDataModule` and `nats.finetune.datamodule.LongContextDataModule` are written on it.
    """

    micro_batch_size: int

    def _rank_world(self) -> tuple[int, int]:
        t = getattr(self, "trainer", None)
        return (int(t.global_rank), int(t.world_size)) if t is not None else (0, 1)

    def _accumulation(self) -> int:
        t = getattr(self, "trainer", None)
        return int(getattr(t, "accumulate_grad_batches", 1)) if t is not None else 1

    def consumed_samples(self) -> int:
        """Training samples already consumed by all ranks: ``global_step * accumulate * micro_batch * world``
        when attached to a trainer, else 0."""
        t = getattr(self, "trainer", None)
        if t is None:
            return 0
        return int(t.global_step) * self._accumulation() * self.micro_batch_size * int(t.world_size)

    def _one_pass_batches(self, world: int) -> int:  # pragma: no cover - each subclass gives its own
        """Micro-batches per rank of about one pass over the training data (before whole optimizer steps)."""
        raise NotImplementedError

    def _train_samples_per_rank(self) -> int:
        """Nominal samples per rank per epoch: all of ``trainer.max_steps`` when set, else about one pass over the
        training data (`_one_pass_batches`); a whole number of optimizer steps either way."""
        t = getattr(self, "trainer", None)
        _, world = self._rank_world()
        accum = self._accumulation()
        max_steps = getattr(t, "max_steps", None) if t is not None else None
        if max_steps is not None and max_steps > 0:
            batches = int(max_steps) * accum
        else:
            batches = max(1, self._one_pass_batches(world))
            batches = math.ceil(batches / accum) * accum
        return batches * self.micro_batch_size

    def resumable_sampler(self) -> ResumableSampler:
        """This rank's sampler of the training stream (`_train_samples_per_rank` samples from the consumed ones)."""
        rank, world = self._rank_world()
        return ResumableSampler(self._train_samples_per_rank(), rank, world, start=self.consumed_samples)

    def strided_sampler(self, length: int) -> StridedSampler:
        """This rank's share of ``length`` evaluation items."""
        rank, world = self._rank_world()
        return StridedSampler(length, rank, world)


# --------------------------------------------------------------------------------------------------------------
# the datamodule
# --------------------------------------------------------------------------------------------------------------


class TokenDataModule(ResumableDataModule):
    """Language-modelling batches from a tokenised text source.

    Args:
        source: registered source name (``gutenberg``, ``pg19``, ``text_dir``).
        cache_dir: folder of the token caches and raw downloads.
        block_size: tokens per training/eval sequence ``N``; windows hold ``N + 1`` tokens.
        micro_batch_size: sequences per training batch (per process).
        eval_batch_size: sequences per validation/test batch (default: ``micro_batch_size``).
        num_workers: DataLoader workers.
        seed: seed of the training-window stream.
        tokenizer: tokenizer name (see :func:`nats.data.tokenizer.get_tokenizer`).
        max_eval_windows: cap on the number of validation/test windows (quick runs); ``None`` = all.
        eval_windows: which windows the cap takes: ``"spread"`` evenly over the split, or its ``"first"`` ones
            (`EvalWindows`).
        cache_name: prefix of the token cache folder's name (default: the source name), e.g. ``pg19-subset``.
        cache_path: an explicit token cache folder (written by ``nats-prepare``, perhaps on another machine) to
            train from; it must be complete, nothing is tokenised. Default: ``<cache_dir>/<name>-<hash>-<tok>``,
            found from the configuration alone, so copying that folder is enough too.
        **source_options: passed to the source, e.g. ``path``, ``hf_name``, ``text_field``, ``sdist_path``.

    Without the raw data (e.g. on a GPU node that received only the cache folder), a complete cache is used as it
    is; with it, the cache is checked against it (a mismatch is an error that says to delete and re-prepare).
    """

    def __init__(
        self,
        source: str,
        cache_dir: str,
        block_size: int = 1024,
        micro_batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
        tokenizer: str = "gpt2",
        max_eval_windows: int | None = None,
        eval_windows: str = "spread",
        cache_name: str | None = None,
        cache_path: str | None = None,
        **source_options: Any,
    ) -> None:
        super().__init__()
        for name, value in [("block_size", block_size), ("micro_batch_size", micro_batch_size)]:
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1 or None, got {eval_batch_size}")
        if max_eval_windows is not None and max_eval_windows < 1:
            raise ValueError(f"max_eval_windows must be >= 1 or None, got {max_eval_windows}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        get_tokenizer(tokenizer)  # unknown names fail here
        self.save_hyperparameters()
        self.source_name = source
        self.cache_dir = Path(cache_dir)
        self.block_size = int(block_size)
        self.micro_batch_size = int(micro_batch_size)
        self.eval_batch_size = int(eval_batch_size or micro_batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.max_eval_windows = max_eval_windows
        self.eval_windows = check_eval_windows(eval_windows)
        self.text_source = get_source(source, cache_dir=self.cache_dir, **source_options)
        self.source_options = {k: v for k, v in source_options.items() if v is not None}
        if getattr(self.text_source, "path", None) is not None:  # recorded in meta.json: where the data was
            self.source_options["path"] = str(self.text_source.path)
        if cache_name is not None and not _CACHE_NAME.fullmatch(cache_name):
            raise ValueError(f"cache_name {cache_name!r} must be letters, digits, '.', '_' or '-' (a folder name)")
        self.cache_name = cache_name
        self._explicit_cache = Path(cache_path).expanduser() if cache_path is not None else None
        self._folder: Path | None = self._explicit_cache
        self._files: dict[str, _TokenFile] = {}
        self._unigram_logp: np.ndarray | None = None
        self._prepared = False

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary (50257 for GPT-2)."""
        return get_tokenizer(self.tokenizer).n_vocab

    @property
    def eot(self) -> int:
        """Id of the end-of-text token that separates documents (50256 for GPT-2)."""
        return get_tokenizer(self.tokenizer).eot_token

    @property
    def cache_path(self) -> Path:
        """The cache folder of this source and tokenizer."""
        if self._folder is None:
            self._folder = cache_folder(self.cache_dir, self.text_source, self.tokenizer, self.cache_name)
        return self._folder

    @property
    def token_counts(self) -> dict[str, int]:
        """Tokens per split (after :meth:`setup`)."""
        return {split: f.num_tokens for split, f in self._files.items()}

    # -- Lightning hooks -------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download and tokenise (once; Lightning calls this on one process per node, at every fit and validate:
        the cache is found and checked once per process)."""
        if self._prepared:
            return
        self._folder = prepare_token_cache(
            self.text_source, self.cache_dir, self.tokenizer, name=self.cache_name, folder=self._explicit_cache,
            options=self.source_options,
        )  # fmt: skip
        self._prepared = True

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the three splits (validates their headers); attached to a trainer, check that the model's
        vocabulary holds the data's (:meth:`check_vocab`)."""
        for split in SPLITS:
            path = self.cache_path / f"{split}.bin"
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} does not exist: run `nats-prepare data={self.source_name}` (or call prepare_data()) first"
                )
            if split not in self._files:
                self._files[split] = _TokenFile(path, self.tokenizer)
                _check_not_empty(self._files[split], split)
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        model_vocab = getattr(getattr(module, "config", None), "vocab_size", None)  # LitGPT.config: GPTConfig
        if isinstance(model_vocab, int):
            self.check_vocab(model_vocab)

    def check_vocab(self, model_vocab_size: int, fix: str | None = None) -> None:
        """Raise ``ValueError`` (naming the cache and the fix) if a model with ``model_vocab_size`` embeddings
        cannot read every token id of the cache (ids < the vocabulary size in its headers). ``fix`` replaces the
        default advice (set model.vocab_size), e.g. for a trained checkpoint."""
        for split in SPLITS:
            data_vocab = self._file(split).vocab_size
            if model_vocab_size < data_vocab:
                padded = math.ceil(data_vocab / 64) * 64
                raise ValueError(
                    f"model.vocab_size={model_vocab_size} is smaller than the vocabulary of the token cache "
                    f"{self.cache_path} ({data_vocab} ids, tokenizer {self.tokenizer!r}): the model has no "
                    f"embedding for ids >= {model_vocab_size}. "
                    + (
                        fix
                        or f"Set model.vocab_size={padded} (>= {data_vocab}, padded to a multiple of 64), or "
                        "train on data of a smaller vocabulary"
                    )
                )

    def _file(self, split: str) -> _TokenFile:
        if split not in self._files:
            self.setup()
        return self._files[split]

    def _one_pass_batches(self, world: int) -> int:
        return self._file("train").num_tokens // (self.block_size * self.micro_batch_size * world)

    def _loader(self, dataset: Dataset, sampler: Sampler[int], batch_size: int, cls: type = DataLoader) -> DataLoader:
        return cls(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=False,
            pin_memory=torch.cuda.is_available(),
            **worker_options(self.num_workers),
        )

    def train_dataloader(self) -> DataLoader:
        sampler = self.resumable_sampler()
        length = len(sampler) * sampler.world_size
        dataset = TrainWindows(self._file("train"), self.block_size, self.seed, length=length)
        return self._loader(dataset, sampler, self.micro_batch_size, cls=ResumableDataLoader)

    def eval_dataset(self, split: str = "validation") -> EvalWindows:
        """The windows of a held-out split (capped by ``max_eval_windows``)."""
        if split not in ("validation", "test"):
            raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
        return EvalWindows(self._file(split), self.block_size, self.max_eval_windows, self.eval_windows)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.eval_dataset(split)
        return self._loader(dataset, self.strided_sampler(len(dataset)), self.eval_batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    # -- baseline --------------------------------------------------------------------------------------------
    def unigram_perplexity(self, split: str = "validation") -> float:
        """Perplexity of ``split`` under a unigram model fitted on train (add-one smoothing over the vocabulary),
        over the tokens the validation/test loaders predict (same windows, same cap, all ranks together)."""
        if self._unigram_logp is None:
            counts = np.ones(self.vocab_size, dtype=np.float64)  # add-one
            train = self._file("train").tokens
            for i in range(0, len(train), 1 << 24):  # chunks of 16M tokens: bounded memory for PG-19
                chunk = self._file("train").check(train[i : i + (1 << 24)], i)
                counts += np.bincount(chunk, minlength=self.vocab_size)
            self._unigram_logp = np.log(counts / counts.sum())
        dataset = self.eval_dataset(split)
        _, world = self._rank_world()
        targets = dataset.targets(len(dataset) - len(dataset) % world)
        return float(np.exp(-self._unigram_logp[targets].mean()))
