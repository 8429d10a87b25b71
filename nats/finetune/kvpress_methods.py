"""NVIDIA's kvpress presses as methods of `nats-eval-hf` (docs/kvpress.md).

kvpress (PyPI ``kvpress``, Apache-2.0) is the community's library of KV-cache compression "presses". Here it judges
the project's own baselines: a method whose config names a press (``conf/kvpress/<name>.yaml``, composed into
``policies.kvpress_<name>`` by conf/eval_hf.yaml) answers the same examples, with the same prompts, scoring and
budgets as the project's `StaticPolicyCache` methods::

    nats-eval-hf 'methods=[full,snapkv,streaming_llm,kvpress_snapkv,kvpress_streaming_llm,kvpress_expected_attention]' \
        'budgets=[0.25]' data.num_examples=16 device=cpu

kvpress is an optional extra (``pip install 'nats-attention[kvpress]'``): 0.5.5 requires transformers >= 4.56, < 5.3,
so it lives in an environment of its own (docs/kvpress.md); nothing imports it until a kvpress method runs.

How a press runs (kvpress' own protocol, as its ``KVPressTextGenerationPipeline`` does it):

* the prompt is prefilled with exact attention through a transformers ``DynamicCache`` inside ``with press(model)``:
  the press's forward hooks prune every layer's cache once, after that layer's prefill;
* then greedy decoding one token at a time outside the press (no eviction while decoding), with the tokens'
  original positions (``position_ids`` = prompt length + step; the compressed cache is shorter than the positions).
  ``pg19_continuation``: the reference tokens are fed in one forward after the compressed prefill (teacher forcing).

Budgets: the project's budget fraction b keeps ``B = round(b x N)`` of an N-token prompt per layer and KV head,
the observation window (SnapKV) and the sinks (StreamingLLM) included. kvpress keeps
``int(N x (1 - compression_ratio))``; `compression_ratio` = (N - B - 1/2) / N makes that exactly B (1 - b would
keep B or B - 1 depending on rounding). Under ``protocol=project`` the whole prompt, question included, is
compressed, as the project's methods see it; under ``protocol=kvpress`` (kvpress' pipeline and leaderboard) the
context alone is, and the question is fed uncompressed after it (`nats.data.longctx.tasks.question_start`).

Measurements, as the project's SnapKV counts them (spec section 6): prompt query i reads i + 1 keys (exact
prefill), decode query s reads the B kept keys plus the s new ones; ``area``, ``peak`` and ``kv_fraction`` follow.
A model with NAtS scorers attached (``scorers=...``) runs the presses with transformers' SDPA attention (the
model's own attention; the scorers are not used).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any

import torch
import torch.nn.functional as F

#: press name (conf/kvpress/<name>.yaml's ``kvpress:``) -> kvpress class
PRESSES = {
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "expected_attention": "ExpectedAttentionPress",
    "knorm": "KnormPress",
    "none": None,  # no press: the full cache through the same path (the control: it must answer as `full`)
}
INSTALL = (
    "pip install 'nats-attention[kvpress]' in an environment of its own (kvpress 0.5.5 needs transformers < 5.3; "
    "docs/kvpress.md)"
)


def kvpress_module():
    """The imported ``kvpress`` package, or an ImportError that says how to install it."""
    try:
        module = importlib.import_module("kvpress")
    except ImportError as err:
        raise ImportError(f"the kvpress methods need kvpress ({err}): {INSTALL}") from err
    return module


def compression_ratio(budget: int, prompt_len: int) -> float:
    """kvpress' ``compression_ratio`` (fraction removed) that keeps exactly `budget` of `prompt_len` tokens:
    ``int(prompt_len * (1 - ratio)) == budget``."""
    if not 0 < budget <= prompt_len:
        raise ValueError(f"budget {budget} must be in 1 .. prompt length {prompt_len}")
    return max(0.0, (prompt_len - budget - 0.5) / prompt_len)


def make_press(press: str, budget: int, prompt_len: int, **options: Any):
    """A kvpress press that keeps `budget` of the `prompt_len` prompt tokens per layer and KV head."""
    if press not in PRESSES:
        raise ValueError(f"unknown kvpress press {press!r}; available: {', '.join(PRESSES)}")
    if PRESSES[press] is None:
        return None
    cls = getattr(kvpress_module(), PRESSES[press])
    return cls(compression_ratio=compression_ratio(budget, prompt_len), **options)


def check_budget(press: str, budget: int, prompt_len: int, **options: Any) -> None:
    """The press's own constraints on a budget of `budget` tokens of a `prompt_len`-token prompt."""
    if not 0 < budget <= prompt_len:
        raise ValueError(f"kvpress {press}: budget {budget} must be in 1 .. {prompt_len}")
    if press == "snapkv":
        w = int(options.get("window_size", 64))
        if not w < budget:
            raise ValueError(f"kvpress snapkv: window_size={w} must be below the budget B={budget}")
    if press in ("streaming_llm", "expected_attention"):
        sinks = int(options.get("n_sink", 4))
        if not sinks < budget:
            raise ValueError(f"kvpress {press}: n_sink={sinks} must be below the budget B={budget}")


@contextlib.contextmanager
def plain_attention(model):
    """The model's attention as transformers' SDPA while inside (a model routed through ``nats`` attention by
    `nats.hf.attach_nats` / `use_policy_caches` would otherwise run NAtS on an ordinary cache); restored after."""
    config = model.config
    before = config._attn_implementation
    if before == "nats":
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before
        for module in model.modules():  # what the nats pre-hooks stashed for an attention call that did not come
            if hasattr(module, "_nats_hidden"):
                module._nats_hidden = module._nats_cache = None


def _step_logits(model, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
    pos = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[0].float()


def run_press(model, prompt: list[int], press, *, n_new: int = 0, reference: list[int] | None = None):
    """Prefill `prompt` under `press` (None: no compression), then greedy decoding of up to `n_new` tokens (stops
    after EOS, as ``generate``) or, with `reference`, teacher forcing of its tokens. Returns ``(generated ids,
    NLL of the reference or None, cache, tokens fed after the prompt)``."""
    from transformers import DynamicCache

    device = model.device
    ids = torch.tensor([prompt], device=device)
    P = len(prompt)
    cache = DynamicCache()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with torch.no_grad(), plain_attention(model):
        ctx = press(model) if press is not None else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0].float()
        if reference is not None:
            if len(reference) > 1:
                rest = _step_logits(model, torch.tensor([reference[:-1]], device=device), cache, P)
                logits = torch.cat([logits, rest], dim=0)
            nll = float(F.cross_entropy(logits, torch.tensor(reference, device=logits.device)))
            return logits.argmax(-1).tolist(), nll, cache, len(reference) - 1
        generated = [int(logits[-1].argmax())]
        while len(generated) < n_new and generated[-1] not in eos:
            nxt = _step_logits(model, torch.tensor([[generated[-1]]], device=device), cache, P + len(generated) - 1)
            generated.append(int(nxt[-1].argmax()))
    return generated, None, cache, len(generated) - 1


class Prefill:
    """One exact prefill of a prompt through a ``DynamicCache``, with what every press reads at each attention
    layer (the forward hook's ``hidden_states`` and keyword arguments, the cache's keys and values) and the last
    position's logits. A press prunes each layer's cache from these inputs only, and the prefill's outputs do not
    depend on the pruning (it happens after the layer's attention), so presses applied here keep exactly what
    ``with press(model): model(prompt)`` keeps (tests/test_kvpress.py checks it), and methods on the same example
    share one prefill (``order=examples``)."""

    def __init__(self, model, prompt: list[int]):
        from transformers import DynamicCache

        self.model, self.prompt = model, list(prompt)
        attn = [layer.self_attn for layer in _language_model(model).layers]
        inputs: dict[int, dict[str, Any]] = {}

        def hook(module, args, kwargs, output):
            inputs[module.layer_idx] = {
                k: kwargs[k] for k in ("hidden_states", "position_embeddings", "cache_position")
            }
            return output

        handles = [a.register_forward_hook(hook, with_kwargs=True) for a in attn]
        cache = DynamicCache()
        ids = torch.tensor([self.prompt], device=model.device)
        try:
            with torch.no_grad(), plain_attention(model):
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        self.logits = out.logits[0].float()  # [1, vocab]: the first new token's
        self.modules = attn
        self.inputs = [inputs[i] for i in range(len(attn))]
        self.kv = [(layer.keys, layer.values) for layer in cache.layers]

    def compressed(self, press):
        """A ``DynamicCache`` holding what `press` keeps of every layer (None: everything)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if press is not None:
                stack.enter_context(press(self.model))  # its set-up (post_init_from_model, rotary_emb); no forward
            for i, (module, inp, (k, v)) in enumerate(zip(self.modules, self.inputs, self.kv)):
                if press is not None:
                    k, v = press.compress(module, inp["hidden_states"], k, v, None, inp)
                cache.update(k, v, i)
        return cache


def _language_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


_LAST: dict[str, Any] = {}


def shared_prefill(model, prompt: list[int]) -> Prefill:
    """The `Prefill` of `prompt`, reused while the same model answers the same prompt (the last one only)."""
    key = (id(model), tuple(prompt))
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(key=key, prefill=Prefill(model, prompt))
    return _LAST["prefill"]


def decode(model, prefill: Prefill, cache, *, n_new: int = 0, reference: list[int] | None = None,
           question: list[int] | None = None):  # fmt: skip
    """Greedy decoding (or teacher forcing of `reference`) after `prefill`, through `cache` (its compression):
    ``(generated ids, NLL of the reference or None, tokens fed after the prompt)``, as `run_press`. ``question``:
    tokens fed uncompressed first, after a prefill of the context alone (kvpress' protocol; counted as fed)."""
    device, P = model.device, len(prefill.prompt)
    logits = prefill.logits
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    asked = len(question or [])
    with torch.no_grad(), plain_attention(model):
        if asked:
            logits = _step_logits(model, torch.tensor([question], device=device), cache, P)[-1:]
            P += asked
        if reference is not None:
            if len(reference) > 1:
                rest = _step_logits(model, torch.tensor([reference[:-1]], device=device), cache, P)
                logits = torch.cat([logits, rest], dim=0)
            nll = float(F.cross_entropy(logits, torch.tensor(reference, device=logits.device)))
            return logits.argmax(-1).tolist(), nll, asked + len(reference) - 1
        generated = [int(logits[-1].argmax())]
        while len(generated) < n_new and generated[-1] not in eos:
            nxt = _step_logits(model, torch.tensor([[generated[-1]]], device=device), cache, P + len(generated) - 1)
            generated.append(int(nxt[-1].argmax()))
    return generated, None, asked + len(generated) - 1


def accounting(prompt_len: int, kept: int, fed: int) -> dict[str, float]:
    """Area, peak and kv_fraction of a prefill-time compression to `kept` tokens followed by `fed` decode tokens
    (the project's SnapKV accounting)."""
    n, t = prompt_len, prompt_len + fed
    area = n * (n + 1) / 2 + sum(kept + s for s in range(1, fed + 1))
    return {"area": area / (t * (t + 1) / 2), "peak": max(n, kept + fed) / t, "kv_fraction": (kept + fed) / t}


def evaluate_one(model, tokenizer, example, run: dict[str, Any], cfg) -> dict[str, Any]:
    """`nats.finetune.evaluate.evaluate_one` for a kvpress method: the same row (score and KV measurements)."""
    from nats.data.longctx import scoring as E

    prompt = example.prompt_ids
    k = int(cfg.continuation_tokens)
    n_new = E.new_tokens(example, int(cfg.answer_margin), k)
    # the compressed prefill: the whole prompt, or (kvpress' protocol) its context, the question fed after it
    n = E.compressed_length(example, tokenizer, cfg.get("protocol", "project"))
    B = E.budget_tokens(run["budget"], n)
    press = None if B is None or B >= n else make_press(run["press"], B, n, **run["options"])
    t0 = time.time()
    prefill = shared_prefill(model, prompt[:n])  # one exact prefill per example, shared by the presses
    cache = prefill.compressed(press)
    question = prompt[n:]
    if example.task == "pg19_continuation":
        generated, nll, fed = decode(model, prefill, cache, reference=example.answer_ids[:n_new], question=question)
    else:
        generated, nll, fed = decode(model, prefill, cache, n_new=n_new, question=question)
    seconds = time.time() - t0  # without the prefill when an earlier method of this example ran it
    text = tokenizer.decode(generated, skip_special_tokens=True)
    held = torch.tensor([[layer.keys.shape[-2]] * layer.keys.shape[1] for layer in cache.layers], dtype=torch.float64)
    kept = int(held[0, 0]) - fed  # after the prefill's compression (every layer and head the same)
    if not torch.all(held == kept + fed):
        raise RuntimeError(f"kvpress {run['press']}: layers or heads hold different lengths {held.unique().tolist()}")
    acc = accounting(n, kept, fed)
    shape = held.shape
    per_head = {key: E._round(torch.full(shape, value_, dtype=torch.float64)) for key, value_ in acc.items()}
    return E.result_row(run, example, budget_tokens=B, generated=generated, text=text, k=k, nll=nll, kv=acc,
                        kept=kept + fed, seen=n + fed, seconds=seconds, per_head=per_head)  # fmt: skip
