"""``text_dir``: any folder laid out as ``<path>/{train,validation,test}/**/*.txt``, one document per file, or
holding ``<path>/{train,validation,test}.tar.xz`` (``.tar.gz``, ``.tar``) archives of such files, read unextracted.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from nats.data.sources.base import (
    SPLITS,
    Document,
    SourceUnavailableError,
    TextSource,
    _check_split,
    _decode,
    register_source,
)

__all__ = ["TextDirSource", "ARCHIVE_SUFFIXES", "ARCHIVE_BUFFER_BYTES"]

#: the archive names a split may come as (``<path>/<split><suffix>``), in the order they are looked for
ARCHIVE_SUFFIXES: tuple[str, ...] = (".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar.bz2", ".tar")
#: bytes of book text an archive read holds in memory at most to yield the books in sorted order when the
#: archive stores them in another order (see :meth:`TextDirSource.documents`); beyond that it reads the archive
#: again. The PG-19 subset's train archive (150 MB of text, stored in ebook-number order) fits in one pass.
ARCHIVE_BUFFER_BYTES = 1 << 30


class _Entry(NamedTuple):
    """One book of a split: its name inside the split (POSIX path, e.g. ``sub/t.txt``) and its size in bytes."""

    name: str
    size: int


def _member_name(member: str, split: str, archive: Path) -> str | None:
    """The document name of an archive member, ``None`` for a member that is not a ``.txt`` book.

    ``<split>/<name>.txt`` gives ``<name>.txt``; a member without the split prefix keeps its whole name; a
    member under another split's folder is an error (the wrong archive, or one holding several splits).
    """
    parts = [p for p in PurePosixPath(member).parts if p not in ("/", "..")]
    if not parts or not parts[-1].endswith(".txt"):
        return None
    if len(parts) > 1 and parts[0] == split:
        parts = parts[1:]
    elif len(parts) > 1 and parts[0] in SPLITS:
        raise ValueError(
            f"{archive} holds {member!r}, a book of split {parts[0]!r}: the archive of split {split!r} must hold "
            f"{split}/<name>.txt (or <name>.txt) members only; use one archive per split"
        )
    return "/".join(parts)


def _archive_books(archive: Path, split: str) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo, str]]:
    """Stream an archive once, in stored order: ``(tar, member, document name)`` for each ``.txt`` book (the
    member's data can be read with ``tar.extractfile(member)`` before the next item is taken)."""
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                if member.isfile():
                    name = _member_name(member.name, split, archive)
                    if name is not None:
                        yield tar, member, name
    except (tarfile.TarError, EOFError, OSError) as err:  # lzma/zlib errors of a truncated file are OSError/EOFError
        raise SourceUnavailableError(
            f"could not read the archive {archive} ({type(err).__name__}: {err}); it may be truncated or not a "
            "tar archive: copy it again (or extract it into a folder of the same name without the suffix)"
        ) from err


@register_source("text_dir")
class TextDirSource(TextSource):
    """A folder ``<path>`` holding, for each split (``train``, ``validation``, ``test``), either

    * a folder ``<split>/`` of ``.txt`` files (searched recursively), or
    * an archive ``<split>.tar.xz`` (or ``.txz``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar``) whose ``.txt``
      members are ``<split>/<name>.txt`` (members without the ``<split>/`` prefix are taken too). The books are
      read straight from the archive with :mod:`tarfile`, streamed, never extracted to disk.

    If both exist for a split, the **folder wins** (an extracted copy is read without decompressing). Splits may
    mix the two. One document per file, named by its path inside the split, in sorted path order (the same for
    a folder and its archive, whatever order the archive stores its members in); read as UTF-8 (Latin-1
    fallback) with newlines normalised, no other cleaning.

    The content fingerprint is a digest of the listing (split, name and size of every book): the same for a
    folder and the archive it was made from, independent of where the data lies, cheap (an archive's listing
    comes from its tar headers, read in one decompressing pass). The token cache's *folder* is keyed by the
    configuration instead (source name and the basename of ``path``), so a cache copied to a machine without the
    raw data is still found; where the raw data is present, the fingerprint stored in the cache is checked.

    Args:
        cache_dir: data cache folder (unused by this source).
        path: the folder.
    """

    def __init__(self, cache_dir: str | Path, path: str | Path | None = None) -> None:
        super().__init__(cache_dir)
        self.path = Path(path).expanduser().resolve() if path is not None else None
        self._entries: dict[str, tuple[Path, list[_Entry]]] = {}

    def _require_path(self) -> Path:
        if self.path is None:
            raise ValueError(
                f"data source {self.name!r} needs a folder: set data.path=/path/to/folder with train/ "
                "validation/ test/ subfolders of .txt files (or train.tar.xz, validation.tar.xz, test.tar.xz)"
            )
        return self.path

    def available(self) -> bool:
        return self.path is not None and self.path.is_dir()

    def cache_key(self) -> dict[str, Any]:
        return {"source": self.name, "path_name": self._require_path().name}

    def locate(self, split: str) -> Path:
        """Where ``split`` is read from: the folder ``<path>/<split>/`` if it exists, else its archive."""
        _check_split(split)
        root = self._require_path()
        if not root.is_dir():
            raise FileNotFoundError(
                f"{self.name}: data folder {root} does not exist; set data.path to a folder with train/ "
                "validation/ test/ subfolders of .txt files (or archives train.tar.xz, validation.tar.xz, "
                "test.tar.xz)"
            )
        folder = root / split
        if folder.is_dir():
            return folder
        archives = [root / f"{split}{suffix}" for suffix in ARCHIVE_SUFFIXES if (root / f"{split}{suffix}").is_file()]
        if len(archives) > 1:
            raise ValueError(
                f"{self.name}: split {split!r} has several archives {[a.name for a in archives]} in {root}; keep one"
            )
        if archives:
            return archives[0]
        looked = ", ".join(f"{split}{suffix}" for suffix in ARCHIVE_SUFFIXES)
        raise FileNotFoundError(
            f"{self.name}: split folder {folder} does not exist, and neither does an archive of that split in "
            f"{root} (looked for {looked}); {root} must contain, for each of train, validation and test, a folder "
            f"<split>/ of .txt files or an archive <split>.tar.xz of <split>/<name>.txt members (create {folder} "
            "and put at least one .txt file in it, or copy the split's archive there)"
        )

    def entries(self, split: str) -> list[_Entry]:
        """The books of ``split`` (name within the split, size), sorted by path; read once, then remembered. An
        archive's listing takes one pass over it (its tar headers; the data is decompressed but not kept)."""
        if split not in self._entries:
            where = self.locate(split)
            if where.is_dir():
                files = sorted(p for p in where.rglob("*.txt") if p.is_file())
                entries = [_Entry(f.relative_to(where).as_posix(), f.stat().st_size) for f in files]
                if not entries:
                    raise ValueError(f"{self.name}: split folder {where} contains no .txt files; add at least one")
            else:
                sizes: dict[str, int] = {}
                for _, member, name in _archive_books(where, split):
                    if name in sizes:
                        raise ValueError(f"{self.name}: {where} holds the book {name!r} twice; rebuild the archive")
                    sizes[name] = member.size
                if not sizes:
                    raise ValueError(
                        f"{self.name}: archive {where} holds no .txt members ({split}/<name>.txt); check the file"
                    )
                # sorted as the folder layout sorts its paths (by path components), so both give the same order
                entries = [_Entry(n, sizes[n]) for n in sorted(sizes, key=PurePosixPath)]
            self._entries[split] = (where, entries)
        return self._entries[split][1]

    def fingerprint(self) -> dict[str, Any]:
        # The listing (split, name and size of every book) is the content key: adding, removing or editing a book
        # changes it. The same for a folder and the archive it was extracted from; the location is not in it.
        listing = hashlib.sha256()
        for split in SPLITS:
            for entry in self.entries(split):
                listing.update(f"{split}/{entry.name}\t{entry.size}\n".encode())
        return {"listing": listing.hexdigest()[:16]}

    def prepare(self) -> None:
        for split in SPLITS:  # fail on a missing split before spending time tokenising the others
            self.entries(split)

    def documents(self, split: str) -> Iterator[Document]:
        entries = self.entries(split)
        where = self._entries[split][0]
        if where.is_dir():
            for entry in entries:
                yield Document(entry.name, _decode((where / entry.name).read_bytes()))
        else:
            yield from self._archive_documents(where, split, entries)

    def _archive_documents(self, archive: Path, split: str, entries: list[_Entry]) -> Iterator[Document]:
        """The books of an archive in sorted order, streamed.

        Books come in the archive's stored order; the next one due is yielded at once (with any held ones that
        follow it), a book due later is held in memory (as bytes) while at most :data:`ARCHIVE_BUFFER_BYTES` are
        held, the latest-due ones giving way to earlier-due ones. Books not held are read in a further pass. An
        archive stored in sorted order thus takes one pass holding nothing; any order takes one pass when the
        split's text fits in the buffer.
        """
        rank = {entry.name: i for i, entry in enumerate(entries)}
        done = 0  # books yielded so far: entries[:done]
        while done < len(entries):
            start, held, used = done, {}, 0
            for tar, member, name in _archive_books(archive, split):
                i = rank.get(name, -1)
                if i < done or i in held:
                    continue
                if member.size != entries[i].size:
                    raise SourceUnavailableError(
                        f"{self.name}: {archive} changed while it was read ({name}: {entries[i].size} bytes listed, "
                        f"{member.size} now); rerun"
                    )
                if i > done:  # due later: hold it if it fits, pushing out books due after it
                    while used + member.size > ARCHIVE_BUFFER_BYTES and held and max(held) > i:
                        used -= len(held.pop(max(held)))
                    if used + member.size <= ARCHIVE_BUFFER_BYTES:
                        held[i] = tar.extractfile(member).read()  # type: ignore[union-attr]
                        used += member.size
                    continue
                yield Document(name, _decode(tar.extractfile(member).read()))  # type: ignore[union-attr]
                done += 1
                while done in held:
                    raw = held.pop(done)
                    used -= len(raw)
                    yield Document(entries[done].name, _decode(raw))
                    done += 1
                if done == len(entries):
                    break
            if done == start:
                raise SourceUnavailableError(
                    f"{self.name}: {archive} changed while it was read (book {entries[done].name!r} is gone); rerun"
                )

    def num_documents(self, split: str) -> int | None:
        return len(self.entries(split))
