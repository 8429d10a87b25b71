"""The token cache: a text source tokenised once into ``.bin`` files (:mod:`nats.data.token_file`).

Each source is tokenised once into ``<cache_dir>/<name>-<key sha>-<tokenizer>/{split}.bin`` (plus ``meta.json``);
``<name>`` is the source's name unless ``cache_name`` is set. The key is configuration only
(:meth:`~nats.data.sources.TextSource.cache_key`), so the folder is found where the raw data is absent and such a
cache trains alone; ``meta.json`` stores the content fingerprint, checked where the data is present.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from nats.data.sources import SPLITS, Document, TextSource
from nats.data.token_file import FORMAT_VERSION, TokenCacheError, read_bin_header, write_token_bin
from nats.data.tokenizer import EOT, get_tokenizer
from nats.utils import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "cache_folder",
    "is_complete_cache",
    "find_token_caches",
    "check_token_cache",
    "prepare_token_cache",
]

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
