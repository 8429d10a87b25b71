"""The base of the text sources: :class:`TextSource`, :class:`Document`, the splits, and the registry.

A source yields :class:`Document` s for the splits ``train``, ``validation`` and ``test``; the datamodule
tokenises them once into a cache (see :mod:`nats.data.token_cache`). Sources are registered on the shared
:class:`nats.registry.Registry` with ``@register_source("name")``, one file each in ``nats/data/sources/``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from nats.registry import Registry

__all__ = [
    "SPLITS",
    "Document",
    "TextSource",
    "SOURCES",
    "TEXT_SOURCES",
    "register_source",
    "available_sources",
    "get_source_class",
    "get_source",
    "SourceUnavailableError",
]

SPLITS: tuple[str, ...] = ("train", "validation", "test")


class Document(NamedTuple):
    """One document (a book, a play): a stable name within its source, and its text."""

    name: str
    text: str


class SourceUnavailableError(RuntimeError):
    """The raw data of a source could not be obtained (download failed, file missing or corrupted)."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")


class TextSource(ABC):
    """Base class of the text sources.

    Args:
        cache_dir: the data cache folder; a source keeps its raw downloads under ``<cache_dir>/raw`` and the
            ``datasets`` cache under ``<cache_dir>/hf``.
    """

    #: registry name (``source:`` in the data configs), set by ``@register_source("name")``
    name: str = "?"

    def __init__(self, cache_dir: str | Path) -> None:
        self.cache_dir = Path(cache_dir)

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """JSON-able description of the content, stored in the token cache's ``meta.json`` and compared with the
        data whenever it is present (and, by default, also the cache folder's key: :meth:`cache_key`); anything
        that changes the documents must appear here (and nothing that does not, e.g. where a file lies)."""

    def cache_key(self) -> dict[str, Any]:
        """JSON-able key of the token cache's folder name. It must not need the raw data, so that a cache copied
        to a machine without it is still found: by default the fingerprint (which for ``gutenberg`` and hub
        datasets is configuration only); sources whose fingerprint reads the data (local folders) return their
        configuration instead, and the fingerprint stored in the cache is checked where the data is present."""
        return self.fingerprint()

    def available(self) -> bool:
        """Whether the raw data can be read here (cheap; e.g. the folder exists). ``False`` lets training use a
        complete token cache alone; the default ``True`` suits sources that download what they need."""
        return True

    def prepare(self) -> None:  # noqa: B027 - optional: a source whose data needs no preparation keeps this
        """Download / validate the raw data; called once before :meth:`documents`. Fails early and clearly."""

    @abstractmethod
    def documents(self, split: str) -> Iterator[Document]:
        """The documents of ``split`` in a deterministic order."""

    def num_documents(self, split: str) -> int | None:
        """Number of documents in ``split`` if known cheaply (for the progress bar), else ``None``."""
        return None


# every module of nats.data.sources but this one holds one source
TEXT_SOURCES = Registry(
    "data source",
    "nats.data.sources",
    skip={"base"},
    hint="data.source=..., or add a file to nats/data/sources/ with @register_source",
)
SOURCES = TEXT_SOURCES.entries  # name -> TextSource subclass (filled as the source modules are imported)
register_source = TEXT_SOURCES.register  # class decorator: @register_source("name")
available_sources = TEXT_SOURCES.names
get_source_class = TEXT_SOURCES.get


def get_source(name: str, cache_dir: str | Path, **options: Any) -> TextSource:
    """Instantiate the source called ``name`` with its ``options``.

    Options the source does not take are ignored when ``None`` (so one config can be switched to another
    source with ``data.source=...``) and rejected otherwise.
    """
    cls = get_source_class(name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "cache_dir"}
    unknown = sorted(k for k, v in options.items() if k not in accepted and v is not None)
    if unknown:
        raise ValueError(f"data source {name!r} does not take option(s) {unknown}; it takes {sorted(accepted)}")
    return cls(cache_dir=cache_dir, **{k: v for k, v in options.items() if k in accepted})


def _decode(raw: bytes) -> str:
    """Bytes of a text file -> str: UTF-8 (BOM dropped), else Latin-1; newlines normalised to ``\\n``."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")
