"""``nats-generate chat=true``: a conversation through one cache, driven through the console script's standard input:
free text (commas, quotes, a message over two lines), the commands, each turn's numbers; later turns prefill only
their new tokens, whose ids continue what the cache holds as the chat template renders the conversation."""

from __future__ import annotations

import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_generate_cli import hf_args, nats_generate, one_line  # noqa: E402

from nats.hf.chat import Conversation, read_messages  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return save_tiny_random_llama(tmp_path_factory.mktemp("tiny_chat"), chat=True)


def test_messages_are_lines_and_a_backslash_goes_on():
    text = 'Hello, "world" [1]\nfirst\\\nsecond\n/stats\nlast without a new line'
    assert list(read_messages(io.StringIO(text))) == [
        'Hello, "world" [1]',
        "first\nsecond",
        "/stats",
        "last without a new line",
    ]


def test_the_next_turn_continues_the_conversation_as_the_template_renders_it(tiny_chat):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat)
    conv = Conversation(tok, torch.device("cpu"))
    first = conv.next_ids("What is the filler?")
    assert tok.decode(first[0]) == tok.apply_chat_template(
        [{"role": "user", "content": "What is the filler?"}], tokenize=False, add_generation_prompt=True
    )
    answer = tok("The grass is green", add_special_tokens=False, return_tensors="pt").input_ids
    end = torch.tensor([[tok.convert_tokens_to_ids("<|im_end|>")]])
    for tail in (answer, torch.cat([answer, end], 1)):  # the answer stopped by the length, or by its end token
        conv = Conversation(tok, torch.device("cpu"))
        ids = conv.next_ids("What is the filler?")
        out = torch.cat([ids, tail], 1)
        conv.add("What is the filler?", out, ids.shape[1])
        nxt = conv.next_ids("And the sky?")
        assert torch.equal(nxt[:, : out.shape[1]], out)  # it continues what the cache holds
        turn = [*conv.messages, {"role": "user", "content": "And the sky?"}]
        assert tok.decode(nxt[0]) == tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)


def test_chat_through_the_console_script(tiny_chat, tmp_path):
    stdin = 'Hello, "world" [1], how are you?\nA message\\\nover two lines\n/stats\n/reset\nAgain, from the start\n'
    out = tmp_path / "run"
    proc = nats_generate(hf_args(tiny_chat, "chat=true", "max_new_tokens=5", "policy=streaming_llm", "budget=24",
                                 f"hydra.run.dir={out}"), stdin=stdin)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    text = proc.stdout
    for expected in ("[turn 1: prefilled", "[turn 2: prefilled", "kept KV entries", "[a new conversation]",
                     "[turn 3: prefilled"):  # fmt: skip
        assert expected in text, text[-3000:]
    turns = json.loads((out / "generation.json").read_text())["turns"]
    assert [t["message"] for t in turns] == ['Hello, "world" [1], how are you?', "A message\nover two lines",
                                              "Again, from the start"]  # fmt: skip
    first, second, third = turns
    assert first["prefilled_tokens"] == first["conversation_tokens"]
    assert second["prefilled_tokens"] < second["conversation_tokens"] - first["conversation_tokens"] + 2
    assert second["conversation_tokens"] > first["conversation_tokens"] + first["new_tokens"]
    assert third["prefilled_tokens"] == third["conversation_tokens"]  # /reset: a new cache
    assert all(0 < t["kept_share"] <= 1 and t["prefill_ms"] > 0 for t in turns)
    assert second["kept_share"] < 1  # StreamingLLM's budget of 24 tokens evicted


def test_chat_misuse_is_one_line(tiny_chat, tmp_path):
    plain = save_tiny_random_llama(tmp_path / "plain")
    line = one_line(nats_generate(hf_args(plain, "chat=true", f"hydra.run.dir={tmp_path / 'a'}"), stdin="hi\n"))
    assert "has no chat template" in line
    line = one_line(nats_generate(["chat=true", "model_dir=nowhere", f"hydra.run.dir={tmp_path / 'b'}"], stdin="hi\n"))
    assert "chat=true needs a transformers chat model" in line


def test_help_documents_chat_and_streaming():
    text = nats_generate(["--help"]).stdout
    assert "chat=true" in text and "stream=true" in text and "/reset" in text
