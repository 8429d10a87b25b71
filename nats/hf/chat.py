"""``nats-generate hf_model=... chat=true``: a conversation with a transformers model through one evicting cache.

    nats-generate hf_model=smollm2_135m chat=true
    nats-generate hf_model=smollm2_135m scorers=<run>/scorers.pt policy=nats chat=true max_new_tokens=256

Each line read is the user's next message (free text: commas, quotes, brackets as they are; a line that ends with
``\\`` goes on with the next one, the new line kept). The model's chat template renders the conversation; the cache
(`nats.hf.StaticPolicyCache`, the policy of ``policy=``) holds it across the turns, so a turn prefills only its new
tokens (the template's end of the last answer, the message and the assistant's header) onto what the cache kept
(`nats.hf.loop.generate`), not the whole history. The answer is printed as it arrives; after it, the turn's prefilled
tokens and time, the decode speed and what the cache keeps. Commands: ``/stats`` (the cache's measurements),
``/reset`` (a new conversation, a new cache), ``/quit`` (or the end of the input). A turn that would pass the
model's context is refused with one line and the conversation goes on. The transcript and every turn's numbers are
the report (``generation.json`` in the run folder).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

import torch
from omegaconf import DictConfig

__all__ = ["Conversation", "chat", "read_messages"]

_MARK = "\x00nats-answer\x00"  # stands for the answer's text where the template is rendered around it


def read_messages(stream: IO[str]):
    """The user's messages from ``stream``, one a line; a line ending with a backslash goes on with the next."""
    parts: list[str] = []
    for line in stream:
        line = line.rstrip("\n")
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        parts.append(line)
        yield "\n".join(parts)
        parts = []
    if parts:
        yield "\n".join(parts)


class Conversation:
    """A conversation's token ids through one cache: ``ids`` ``[1, T]`` (the rendered conversation and the answers'
    tokens, as the cache saw them), the messages, and the next turn's ids (`next_ids`) as the chat template renders
    it after the last answer."""

    def __init__(self, tokenizer: Any, device: torch.device):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "nats-generate chat=true: the model's tokenizer has no chat template (an instruction-tuned model has "
                "one, e.g. hf_model=smollm2_135m); drop chat=true to continue a prompt instead"
            )
        self.tok, self.device = tokenizer, device
        self.messages: list[dict[str, str]] = []
        self.ids: torch.Tensor | None = None  # the conversation's tokens so far, the last answer's included
        self.answer_ids: list[int] = []

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def next_ids(self, message: str) -> torch.Tensor:
        """The conversation's ids with the user's ``message`` and the assistant's header after it: the first turn as
        the template renders it; later ones the tokens so far (the answer as generated) followed by the template's
        text after the last answer, so that they continue what the cache holds token for token."""
        turn = [*self.messages, {"role": "user", "content": message}]
        if self.ids is None:
            text = self._render(turn, True)
            new = self.tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)
            return new
        # the template around a stand-in answer: what it puts after the answer's text, up to the next header
        marked = [*self.messages[:-1], {"role": "assistant", "content": _MARK}, turn[-1]]
        text = self._render(marked, True)
        after = self._encode(text[text.index(_MARK) + len(_MARK) :])
        last = int(self.ids[0, -1])
        if after and after[0] == last:  # the answer ended with the template's end-of-turn token already
            after = after[1:]
        return torch.cat([self.ids, torch.tensor([after], device=self.device)], dim=1)

    def add(self, message: str, out: torch.Tensor, prompt_len: int) -> str:
        """Record the turn: the user's message and the answer (the tokens after ``prompt_len`` of ``out``)."""
        self.ids = out
        self.answer_ids = out[0, prompt_len:].tolist()
        answer = self.tok.decode(self.answer_ids, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": message}, {"role": "assistant", "content": answer}]
        return answer


def chat(cfg: DictConfig, device: torch.device, dtype: torch.dtype, stdin: IO[str] | None = None,
         stdout: IO[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The REPL (module docstring) over ``stdin``; prints to ``stdout``; returns the report."""
    from transformers import TextStreamer

    from nats.generation_report import summary
    from nats.hf.generate import cache_stats, load_for_generation, make_cache
    from nats.hf.limits import check_context, context_length
    from nats.hf.loop import generate as loop
    from nats.sampling import sampling_options

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if int(cfg.get("num_samples", 1)) != 1:
        raise ValueError("nats-generate chat=true: one conversation at a time (num_samples=1)")
    from nats.hf.pretrained import load_tokenizer, pretrained_kwargs

    Conversation(load_tokenizer(**pretrained_kwargs(cfg.hf_model)), device)  # a chat template, before the model loads
    model, tok, window = load_for_generation(cfg, device, dtype)
    new = int(cfg.max_new_tokens)
    context = context_length(model.config)
    eos = _end_tokens(model, tok)
    sampling = sampling_options(cfg, device)
    every = int(cfg.get("stream_every", 8))
    conv = Conversation(tok, device)
    cache, budget = make_cache(cfg, model, context or 4096, new)
    turns: list[dict[str, Any]] = []

    def say(text: str) -> None:
        print(text, file=stdout, flush=True)

    say(f"chat with {cfg.hf_model.name_or_path} (policy {cfg.policy}); /stats, /reset, /quit; end a line with \\ to "
        "go on with the next")  # fmt: skip
    for message in read_messages(stdin):
        command = message.strip()
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            conv = Conversation(tok, device)
            cache, budget = make_cache(cfg, model, context or 4096, new)
            say("[a new conversation]")
            continue
        if command == "/stats":
            if conv.ids is None:
                say("[no conversation yet]")
                continue
            held = conv.ids.shape[1] - 1
            report = {"policy": str(cfg.policy), "budget": budget, "prompt_tokens": held, "new_tokens": 0,
                      "seconds": 0.0, "tokens_per_s": None, "device": str(device),
                      "precision": str(dtype).split(".")[-1], "decode": "chat",
                      "stats": cache_stats(cache, model, dtype, 1, held)}  # fmt: skip
            say(summary(report).split("\n", 1)[1])  # the cache's lines (the first is about a single call)
            continue
        if not command:
            continue
        ids = conv.next_ids(message)
        try:
            check_context(context, ids.shape[1], new, "nats-generate chat")
        except ValueError as err:
            say(f"[{err}]")
            continue
        held = 0 if conv.ids is None else conv.ids.shape[1] - 1
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        timing: dict[str, float] = {}

        def first_token(timing=timing) -> None:  # the prefill and the first token's choice, queued: wait for them
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timing["prefill"] = time.perf_counter() - timing["start"]

        timing["start"] = time.perf_counter()
        out = loop(model, ids, cache, new, eos_token_id=eos, **sampling, streamer=streamer, check_every=every,
                   on_prefill=first_token)  # fmt: skip
        seconds = time.perf_counter() - timing["start"]
        answer = conv.add(message, out, ids.shape[1])
        n_new = len(conv.answer_ids)
        kept = cache.kept().double()
        seen = out.shape[1] - 1
        decode_s = max(seconds - timing["prefill"], 1e-9)
        turn = {
            "message": message,
            "answer": answer,
            "prefilled_tokens": ids.shape[1] - held,
            "conversation_tokens": int(ids.shape[1]),
            "prefill_ms": round(1000 * timing["prefill"], 1),
            "new_tokens": n_new,
            "tokens_per_s": round((n_new - 1) / decode_s, 1) if n_new > 1 else None,
            "kept": float(kept.mean()),
            "kept_share": float(kept.mean()) / seen,
        }
        turns.append(turn)
        say(f"[turn {len(turns)}: prefilled {turn['prefilled_tokens']} of {turn['conversation_tokens']} tokens in "
            f"{turn['prefill_ms']} ms; {n_new} new tokens at {turn['tokens_per_s']} tokens/s; KV kept "
            f"{turn['kept']:.0f} of {seen} tokens a layer and KV head ({100 * turn['kept_share']:.0f}%)]")  # fmt: skip
    return {
        "model": str(cfg.hf_model.name_or_path),
        "policy": str(cfg.policy),
        "budget": budget,
        "window": window,
        "device": str(device),
        "precision": str(dtype).split(".")[-1],
        "chat": True,
        "turns": turns,
    }


def _end_tokens(model, tok) -> list[int]:
    """The tokens that end an answer: the generation config's and the tokenizer's end tokens."""
    ids = model.generation_config.eos_token_id
    ends = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tok.eos_token_id is not None and tok.eos_token_id not in ends:
        ends.append(tok.eos_token_id)
    return ends
