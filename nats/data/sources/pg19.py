"""``pg19``: the real PG-19 (Rae et al., 2020), from a local copy in its official layout (``path``; split folders or
split archives such as the PG-19 subset's ``train.tar.xz``, read as :mod:`text_dir` reads them) or a Hugging Face
hub dataset streamed with ``datasets`` (``hf_name``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nats.data.sources.base import Document, _check_split, register_source
from nats.data.sources.text_dir import TextDirSource

__all__ = ["PG19Source"]

_PG19_ONE_OF = (
    "pg19 needs exactly one of data.path=/path/to/pg19 (a local copy with train/ validation/ test/ folders of .txt "
    "books, or train.tar.xz validation.tar.xz test.tar.xz) or data.hf_name=<hub dataset, e.g. emozilla/pg19>"
)


@register_source("pg19")
class PG19Source(TextDirSource):
    """PG-19, from a local copy in its official layout or from the Hugging Face hub.

    Exactly one of:
        path: local copy, ``<path>/{train,validation,test}/*.txt`` (as in the ``deepmind-gutenberg`` bucket), or
            archives ``<path>/{train,validation,test}.tar.xz`` of ``<split>/<name>.txt`` books (read without
            extracting; see :class:`TextDirSource` for the rules, e.g. a folder wins over an archive).
        hf_name: a hub dataset with splits ``train``/``validation``/``test``, streamed with
            ``datasets.load_dataset(hf_name, hf_config, split=..., streaming=True)``; e.g. ``emozilla/pg19``
            (a parquet copy; the original ``deepmind/pg19`` is a loading script, which recent ``datasets`` no
            longer runs). The ``datasets`` cache lives in ``<cache_dir>/hf``.
    Giving both is an error at once; giving neither is an error when the data is needed (not when training
    from an explicit ``data.cache_path``).

    Args:
        text_field: the column holding the book text (hub datasets only).
        hf_config: the hub dataset's configuration name, if it has several.
    """

    def __init__(
        self,
        cache_dir: str | Path,
        path: str | Path | None = None,
        hf_name: str | None = None,
        text_field: str = "text",
        hf_config: str | None = None,
    ) -> None:
        super().__init__(cache_dir, path)
        if path is not None and hf_name is not None:
            raise ValueError(f"{_PG19_ONE_OF}; got path={path!r}, hf_name={hf_name!r}")
        self.hf_name, self.hf_config, self.text_field = hf_name, hf_config, text_field

    def _require_path(self) -> Path:
        if self.path is None:
            raise ValueError(f"{_PG19_ONE_OF}; got neither")
        return self.path

    def available(self) -> bool:
        return True if self.hf_name is not None else super().available()

    def cache_key(self) -> dict[str, Any]:
        return self.fingerprint() if self.hf_name is not None else super().cache_key()

    def fingerprint(self) -> dict[str, Any]:
        if self.hf_name is None:
            return super().fingerprint()
        return {"hf_name": self.hf_name, "hf_config": self.hf_config, "text_field": self.text_field}

    def prepare(self) -> None:
        if self.hf_name is None:
            super().prepare()

    def documents(self, split: str) -> Iterator[Document]:
        if self.hf_name is None:
            yield from super().documents(split)
            return
        _check_split(split)
        try:
            import datasets  # imported lazily: ~1 s, and only the hub path needs it (an optional extra)
        except ImportError as err:
            raise ImportError(
                f"data.hf_name={self.hf_name!r} streams the corpus with the `datasets` package, which is not "
                "installed: pip install 'nats-attention[datasets]' (or pip install datasets), or point data.path "
                "at a local copy instead"
            ) from err

        ds = datasets.load_dataset(
            self.hf_name, self.hf_config, split=split, streaming=True, cache_dir=str(self.cache_dir / "hf")
        )
        for i, row in enumerate(ds):
            if self.text_field not in row:
                raise KeyError(
                    f"pg19: hub dataset {self.hf_name!r} has no field {self.text_field!r} (fields: {sorted(row)}); "
                    "set data.text_field"
                )
            title = row.get("short_book_title") or row.get("title")
            yield Document(f"{i:06d} {title}" if title else f"{i:06d}", row[self.text_field])

    def num_documents(self, split: str) -> int | None:
        return super().num_documents(split) if self.hf_name is None else None
