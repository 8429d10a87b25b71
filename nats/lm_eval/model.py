"""The lm-evaluation-harness model ``nats``: the harness' tasks through the project's cache engine, with a KV-cache
policy and budget (docs/lm_eval.md).

    python -m nats.lm_eval --model nats --model_args pretrained=smollm2,policy=nats,scorers=<run>/scorers.pt \\
        --tasks <task> --device cpu --batch_size 8

``NAtSLM`` subclasses the harness' `HFLM` (its tokenisation, batching, chat templates, stop sequences and metrics
stay the harness' own) and swaps only where the model meets its cache:

* **The model**: loaded by `nats.hf.pretrained.load_pretrained` from ``pretrained`` (a ``conf/hf_model`` name,
  ``smollm2``, a local folder, a ``.gguf`` file; offline), prepared by `nats.hf.pretrained.prepare_model` as
  ``nats-eval-hf`` prepares it (NAtS' scorers with ``scorers=``, DMS' retrofit with ``dms=``, else
  `nats.hf.use_policy_caches`). The policy is an entry of ``nats-eval-hf``'s ``policies`` (``conf/cache/*.yaml``:
  its options and their defaults), checked by `nats.finetune.evaluate.plan_methods`.
* **loglikelihood** (and multiple choice): per request, the context is the prompt the policy prefills and
  compresses (``budget``: a fraction of each context's tokens, or a number of tokens), then the continuation is
  teacher-forced through the same cache (the rule's continuation: what its decode steps make of those tokens), as
  ``nats-eval-hf`` scores its PG-19 continuation. Left-padded contexts and right-padded continuations make a batch;
  requests with the same input (context and continuation but its last token) are computed once.
* **loglikelihood_rolling** (perplexity): the harness' windows the same way: a window's context is its prompt (one
  token; a document's last window: the tokens before it that it does not score), its tokens are teacher-forced
  through the cache; a fractional budget is a fraction of the tokens a window feeds (``nats-eval``'s perplexity
  protocol), so the policies that evict while decoding (``nats``, ``streaming_llm``, ``h2o``) act on it and those
  that compress a prompt once (``snapkv``, ``pyramidkv``, ``adakv``) keep (nearly) every token.
* **generate_until**: the harness' own ``model.generate`` call with a fresh `nats.hf.StaticPolicyCache` per batch
  (left-padded prompts; the budget a fraction of each prompt).

The caches' kept share (tokens held at the end / tokens fed, per layer and KV head, averaged over the rows of every
batch; KV area; NAtS' global / local / sliding shares) is logged after each request type and returned in the
results' ``config["nats"]`` (`NAtSLM.get_model_info`).

lm-eval 0.4.13 finds a model only among its own (``lm_eval.models``) or classes registered by a module that is
imported: it has no plugin entry point for models. ``python -m nats.lm_eval`` (`nats/lm_eval/__main__.py`) is therefore
the harness' own command line with ``nats`` registered, offline by default (``HF_DATASETS_OFFLINE=1``,
``HF_HUB_OFFLINE=1`` unless set), a task whose data is not on this machine refused in one line; from Python,
``import nats.lm_eval`` and then ``lm_eval.simple_evaluate(model="nats", ...)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "HF_DATASETS_OFFLINE" not in os.environ and "HF_HUB_OFFLINE" not in os.environ:
    # python -m nats.lm_eval: offline before the hub's libraries read their settings (`offline`)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")

import lm_eval.models  # noqa: F401,E402 - the harness' models first: get_model imports them into an empty registry only
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

log = logging.getLogger("nats.lm_eval")  # the package's name, what users filter on

PROGRAM = "nats.lm_eval"  # python -m nats.lm_eval (not a console script: those are Hydra apps, tests/test_cli.py)
#: HFLM's arguments that apply to a model nats loads (the others load or place a model: refused, with this list)
HFLM_ARGS = (
    "batch_size",
    "max_batch_size",
    "max_length",
    "truncation",
    "add_bos_token",
    "prefix_token_id",
    "softmax_dtype",
    "mixed_precision_dtype",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
)
#: the model arguments of nats (`NAtSLM`); a policy's own options (snapkv's window, streaming_llm's sinks, ...) too
NATS_ARGS = (
    "pretrained",
    "policy",
    "budget",
    "scorers",
    "window",
    "type_bias",
    "dms",
    "dtype",
    "gguf_file",
    "local_files_only",
    "device",
    "backend",
    "prefill_kernel",
)
#: ``pretrained=smollm2``: the default model of conf/hf_model
ALIASES = {"smollm2": "smollm2_135m"}


class NAtSLM(HFLM):
    """The harness' `HFLM` over a model of `nats.hf.pretrained` whose every forward runs through a fresh
    `nats.hf.StaticPolicyCache` of ``policy`` (module docstring).

    Args:
        pretrained: a ``conf/hf_model`` name (``smollm2_135m``, ``llama31_8b_instruct``, ...; ``smollm2``), or what
            ``hf_model.name_or_path`` takes (a local folder in the transformers layout, a ``.gguf`` file,
            ``smollm2-135m``, a hub name in the local cache).
        policy: an entry of ``nats-eval-hf``'s ``policies``: full, nats, streaming_llm, h2o, snapkv, pyramidkv, adakv,
            dms.
        budget: budgeted policies: a fraction in (0, 1) of each request's context (loglikelihood), prompt
            (generate_until) or window (loglikelihood_rolling), or a whole number of tokens per layer and KV head.
        scorers: NAtS' fine-tuned scorers (``<run>/scorers.pt``, its ``.ckpt`` or an adapter folder); needed by
            ``policy=nats``, ignored by the others. ``window``: NAtS' W (default: the scorers' run), or the
            observation window of snapkv / pyramidkv / adakv (their option); ``type_bias``: NAtS' inference offsets,
            ``g:l:s``. ``dms``: DMS' retrofit (``<run>/dms_q_proj.pt``) for ``policy=dms``.
        dtype, gguf_file, local_files_only: the model's (``hf_model``'s) settings; dtype default: the config's
            (float32 for a folder).
        device: ``auto`` (CUDA if available); a CUDA device on a machine without one runs on the CPU, with a warning,
            as the harness' ``hf`` model does (its command line passes ``cuda:0`` unless told).
        backend, prefill_kernel: the policies' kernels (``auto``, ``torch``, ``triton``), `nats.hf.StaticPolicyCache`.
        batch_size: rows per forward (``auto`` is refused: the harness' probe does not see the cache's memory).
        **kwargs: the policy's options (e.g. ``sinks=4``, ``window=32``) and the `HFLM` arguments of `HFLM_ARGS`.
    """

    def __init__(
        self,
        pretrained: str = "smollm2_135m",
        policy: str = "full",
        budget: int | float | None = None,
        scorers: str | None = None,
        window: int | None = None,
        type_bias: Any = None,
        dms: str | None = None,
        dtype: str | None = None,
        gguf_file: str | None = None,
        local_files_only: bool = True,
        device: str | None = "auto",
        backend: str = "auto",
        prefill_kernel: str = "auto",
        batch_size: int | str = 1,
        **kwargs: Any,
    ) -> None:
        from nats.cache.budget import check_budget_value
        from nats.cache.registry import get_cache_class
        from nats.checks import check_hf_model
        from nats.hf.pretrained import (
            check_dms,
            check_scorers_path,
            load_pretrained,
            prepare_model,
            pretrained_kwargs,
            type_bias_of,
        )

        if not isinstance(pretrained, str):
            raise TypeError(f"nats: pretrained must be a model name or path, got {type(pretrained).__name__}")
        if str(batch_size).startswith("auto"):
            raise ValueError(
                f"nats: batch_size={batch_size} is not supported (the harness' probe does not see the cache's "
                "memory): pass --batch_size N"
            )
        cfg = _config(pretrained, policy, budget, scorers, window, type_bias, dms, dtype, gguf_file, local_files_only)
        self.method = policy
        pcfg = cfg.policies[policy]
        options = dict(pcfg.get("options") or {})
        self.policy_cls = get_cache_class(pcfg.name)
        theirs = {k: kwargs.pop(k) for k in list(kwargs) if k not in HFLM_ARGS}
        if window is not None and "window" in options:  # snapkv & co.: their observation window, not NAtS' W
            theirs["window"], cfg.window = window, None
        unknown = sorted(set(theirs) - set(options))
        if unknown:
            raise ValueError(
                f"nats: unknown model_args {unknown}: nats takes {', '.join(NATS_ARGS)}, the policy {policy!r}'s "
                f"options ({', '.join(options) or 'none'}) and the harness' {', '.join(HFLM_ARGS)}"
            )
        self.options = {**options, **theirs}
        try:
            self.policy_cls.check_use(budget)  # it decodes; a budget if and only if it is budgeted
            check_budget_value(budget, "each request's context (or prompt, or rolling window)")
        except ValueError as err:
            raise ValueError(f"nats: {err}") from None
        self.rule = self.policy_cls.rule(**self.options)  # the options checked
        self.budget = budget
        if scorers:
            check_scorers_path(scorers)
        check_dms(cfg)
        try:  # a model not on this machine: one line with the fix, before transformers' retries
            check_hf_model(cfg)
        except (FileNotFoundError, ImportError) as err:
            raise type(err)(f"nats: pretrained={pretrained}: {err}") from None
        dev = _device(device)
        model, tokenizer = load_pretrained(**pretrained_kwargs(cfg.hf_model), device=dev)
        self.window = prepare_model(cfg, model)
        self.cache_backend, self.prefill_kernel = backend, prefill_kernel  # (HFLM has its own self.backend)
        self.settings = {
            "policy": policy,
            "budget": budget,
            "options": self.options,
            "pretrained": pretrained,
            "scorers": str(os.path.abspath(scorers)) if scorers else None,
            "dms": str(os.path.abspath(dms)) if dms else None,
            "window": self.window,
            "type_bias": type_bias_of(cfg) if self.window else None,
        }
        self.kv: dict[str, dict[str, Any]] = {}  # request type -> the caches' measurements, summed over rows
        with _quiet_preloaded():
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)

    # ------------------------------------------------------------------ the harness' request types
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._log("loglikelihood")
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        self._log("loglikelihood_rolling")
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = super().generate_until(requests, disable_tqdm=disable_tqdm)
        self._log("generate_until")
        return out

    def _model_call(self, inps, attn_mask=None, labels=None):
        raise NotImplementedError(
            "nats: every forward goes through the policy's cache (_loglikelihood_tokens, _model_generate); "
            "HFLM._model_call would bypass it"
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``(log p(continuation | context), greedy)`` per request ``(strings or None, context ids, continuation
        ids)``: each context prefilled through a fresh cache of the policy, the continuation teacher-forced through
        it (`_score`). Rolling windows (strings None) take a fractional budget of their own tokens."""
        from tqdm import tqdm

        rolling = bool(requests) and requests[0][0] is None
        kind = "loglikelihood_rolling" if rolling else "loglikelihood"
        groups: dict[tuple, list[int]] = {}  # one input (context, continuation but its last token) -> requests
        for i, (_, context, continuation) in enumerate(requests):
            prompt, cont = self._truncated(context, continuation)
            groups.setdefault((tuple(prompt), tuple(cont[:-1])), []).append(i)
        # longest first, as the harness orders them (a batch that does not fit shows at once)
        keys = sorted(groups, key=lambda k: (-len(k[0]) - len(k[1]), k))
        limit = self._context_limit()
        size = override_bs or self.batch_size
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # a rolling window batch comes from HFLM.loglikelihood_rolling, whose bar counts the documents
        bar = tqdm(total=len(requests), disable=disable_tqdm or rolling or self.rank != 0, desc=f"nats {kind}")
        for batch, budget in _batches(keys, size, limit, lambda k: self._budget_of(k, rolling)):
            self._check_budget(budget, [len(k[0]) for k in batch], "context" if not rolling else "window's prompt")
            for key, logp in zip(batch, self._score(batch, budget, kind)):
                for i in groups[key]:
                    strings, _, continuation = requests[i]
                    cont = torch.tensor(continuation, device=logp.device)
                    ll = float(logp.gather(-1, cont[:, None]).sum())
                    answer = (ll, bool((logp.argmax(-1) == cont).all()))
                    results[i] = answer
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, answer)
                    bar.update(1)
        bar.close()
        return results

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """The harness' ``model.generate`` call (stop sequences, sampling settings) through a fresh cache of the
        policy for the batch ``context`` (left-padded: ``attention_mask``); a policy whose rows share a batch's budget
        (`_row_budget`) in one call per budget."""
        mask = generation_kwargs.get("attention_mask")
        lengths = mask.sum(-1).tolist() if mask is not None else [context.shape[1]] * context.shape[0]
        self._check_budget(self.budget, lengths, "prompt")
        groups: dict[Any, list[int]] = {}
        for row, n in enumerate(lengths):
            groups.setdefault(self._row_budget(n), []).append(row)
        if len(groups) == 1:
            return self._generate(context, max_length, stop, next(iter(groups)), generation_kwargs)
        outs = []
        for budget, rows in groups.items():
            kw = {**generation_kwargs, **({} if mask is None else {"attention_mask": mask[rows]})}
            outs.append((rows, self._generate(context[rows], max_length, stop, budget, kw)))
        out = context.new_full((context.shape[0], max(o.shape[1] for _, o in outs)), self.tokenizer.pad_token_id or 0)
        for rows, o in outs:
            out[rows, : o.shape[1]] = o
        return out

    def _generate(self, context, max_length, stop, budget, generation_kwargs):
        cache = self._cache(int(max_length), budget)
        out = super()._model_generate(context, max_length, stop, **generation_kwargs, **self._cache_kw(cache))
        self._record("generate_until", cache)
        return out

    # ------------------------------------------------------------------ the cache
    def _cache(self, max_len: int, budget: int | float | None):
        from nats.hf import StaticPolicyCache

        extra = {} if budget is None else {"budget": budget}
        # the number of new tokens is not known (generation stops at a stop sequence): eager steps with growth, as
        # nats-eval-hf decodes
        return StaticPolicyCache(self.model, self.policy_cls.name, max_len=max_len, backend=self.cache_backend,
                                 prefill_kernel=self.prefill_kernel, **extra, **self.options)  # fmt: skip

    def _cache_kw(self, cache) -> dict[str, Any]:
        from nats.hf.compat import cache_kwargs

        return cache_kwargs(self.model, cache)

    def _score(self, batch: list[tuple], budget, kind: str) -> list[torch.Tensor]:
        """Log-probabilities ``[len(continuation), V]`` of each input ``(context ids, continuation ids but the
        last)`` of ``batch``: the contexts, left-padded, prefilled through one cache (its policy compresses them),
        then the continuations, right-padded, fed through it as one continuation of every row."""
        from nats.hf.compat import takes_cache_position

        model, device = self.model, self.device
        B = len(batch)
        P = [len(p) for p, _ in batch]
        N = [len(c) for _, c in batch]
        Pm, Nm = max(P), max(N)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((B, Pm), pad, dtype=torch.long)
        mask = torch.zeros(B, Pm, dtype=torch.long)
        cont = torch.full((B, max(Nm, 1)), pad, dtype=torch.long)
        for b, (p, c) in enumerate(batch):
            ids[b, Pm - P[b] :] = torch.tensor(p)
            mask[b, Pm - P[b] :] = 1
            cont[b, : N[b]] = torch.tensor(c, dtype=torch.long)
        ids, mask, cont = ids.to(device), mask.to(device), cont.to(device)
        cache = self._cache(Pm + Nm, budget)
        kw = self._cache_kw(cache)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        with_position = takes_cache_position(model)
        with torch.no_grad(), self._autocast():
            padded = {} if bool(mask.all()) else {"attention_mask": mask}
            at = {"cache_position": torch.arange(Pm, device=device)} if with_position else {}
            logits = model(input_ids=ids, position_ids=position, use_cache=True, logits_to_keep=1, **padded, **at,
                           **kw).logits[:, -1:]  # fmt: skip
            if Nm:  # every row's continuation, at its own positions after its real context tokens
                pos = torch.tensor(P, device=device)[:, None] + torch.arange(Nm, device=device)
                at = {"cache_position": torch.arange(Pm, Pm + Nm, device=device)} if with_position else {}
                rest = model(input_ids=cont[:, :Nm], position_ids=pos, use_cache=True, **at, **kw).logits
                logits = torch.cat([logits, rest], dim=1)
        logp = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        self._record(kind, cache)
        return [logp[b, : N[b] + 1] for b in range(B)]

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)  # fmt: skip

    def _truncated(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The context and continuation the harness' ``hf`` model scores: their tokens cut from the left to
        ``max_length + 1`` (the last one is never fed)."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        if len(continuation) > self.max_length:
            raise ValueError(f"nats: a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
        return whole[: len(whole) - len(continuation)], continuation

    def _context_limit(self) -> int:
        """The most tokens a padded row may take: the model's context (`nats.hf.limits`; a cache counts padding)."""
        from nats.hf.limits import context_length

        return context_length(self.model.config) or self.max_length

    def _budget_of(self, key: tuple, rolling: bool):
        """A batch's budget: a fraction of each context (the cache resolves it per row), or of the tokens a rolling
        window feeds (resolved here: its prompt is one token, or a few), or a number of tokens."""
        from nats.cache.budget import resolve_budget

        if rolling and isinstance(self.budget, float):
            return resolve_budget(self.budget, len(key[0]) + len(key[1]))
        return self._row_budget(len(key[0]))

    def _row_budget(self, n: int):
        """The budget of a row whose prompt has ``n`` tokens, as a batch passes it to the cache: the setting (a
        fraction is resolved by the cache, per row), or, where the policy's rows of one batch share its largest budget
        (`nats.cache.rule.FixedRule.shared_budget`: H2O), the fraction resolved here, so that the rows of one budget
        run together and a request's score does not depend on the requests batched with it."""
        from nats.cache.budget import resolve_budget

        if isinstance(self.budget, float) and self.policy_cls.shared_budget:
            return resolve_budget(self.budget, n)
        return self.budget

    def _check_budget(self, budget, lengths: list[int], what: str) -> None:
        """The policy's options against the budget of each prompt length (``window`` below it, ...), in one line
        naming the prompt, where the engine checks them: a prompt within its budget is kept whole, and the policies
        that compress a prompt once (``prefill_time``: snapkv & co.) check their options only when they compress."""
        from nats.cache.budget import resolve_budget

        if not self.policy_cls.budgeted:
            return
        for n in sorted(set(lengths)):
            b = resolve_budget(budget, n)
            if self.policy_cls.prefill_time and b >= n:
                continue
            try:
                self.rule.check_budget(b, max(n, b + 1))
            except ValueError as err:
                raise ValueError(
                    f"nats: {self.method} at budget={budget} of a {n}-token {what} ({b} tokens): {err}"
                ) from None

    # ------------------------------------------------------------------ what the caches kept
    def _record(self, kind: str, cache) -> None:
        """Add a batch's measurements per row: tokens held / tokens fed and the KV area (means over layers and KV
        heads), NAtS' type shares."""
        kept = torch.stack([layer.kept().double() / layer.seen().double().clamp(min=1) for layer in cache.layers])
        B = cache.layers[0].batch_size
        per_row = {"kv_fraction": kept.view(len(cache.layers), B, -1).mean((0, 2))}
        if cache.track:
            per_row["area"] = cache.fractions()["area"].mean((0, 2))
        if cache.counts_types():
            per_row["type_fractions"] = cache.type_fractions().mean((0, 2))  # [B, 3]
        entry = self.kv.setdefault(kind, {"rows": 0})
        entry["rows"] += B
        for name, value in per_row.items():
            total = value.sum(0).cpu()
            entry[name] = entry[name] + total if name in entry else total

    def kv_report(self) -> dict[str, dict[str, Any]]:
        """Per request type: the rows (sequences in the caches) and the means over them of ``kv_fraction`` (tokens
        held at the end / tokens fed, over layers and KV heads), ``area`` (the KV area fraction) and, for NAtS,
        ``type_fractions`` (global, local, sliding)."""
        out = {}
        for kind, entry in self.kv.items():
            n = entry["rows"]
            row: dict[str, Any] = {"rows": n}
            for name in ("kv_fraction", "area", "type_fractions"):
                if name in entry:
                    mean = entry[name] / n
                    row[name] = [round(float(x), 6) for x in mean] if mean.dim() else round(float(mean), 6)
            out[kind] = row
        return out

    def _log(self, kind: str) -> None:
        row = self.kv_report().get(kind)
        if row is None:
            return
        budget = "" if self.budget is None else f" at budget {self.budget}"
        types = row.get("type_fractions")
        shares = "" if types is None else ", global / local / sliding " + " / ".join(f"{x:.3f}" for x in types)
        area = f", KV area {row['area']:.3f}" if "area" in row else ""
        log.info(f"nats: {self.method}{budget}, {kind}: the caches of {row['rows']} rows kept {row['kv_fraction']:.3f} "
                 f"of the tokens they were fed{area}{shares}")  # fmt: skip

    def get_model_info(self) -> dict:
        """The model's size and dtype, and ``nats``: the policy's settings and what its caches kept (`kv_report`);
        no hub request (the harness' ``hf`` model asks the hub for the model's revision)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "nats": {**self.settings, "kv": self.kv_report()},
        }


if __name__ != "__main__":  # run as a script, the module registers itself once, as nats.lm_eval (below)
    register_model("nats")(NAtSLM)


def _config(pretrained, policy, budget, scorers, window, type_bias, dms, dtype, gguf_file, local_files_only):
    """``nats-eval-hf``'s config (conf/eval_hf.yaml: ``hf_model``, ``policies``) for these model arguments, with the
    policy checked by `nats.finetune.evaluate.plan_methods` (a configured one; nats with scorers, dms with dms=; a
    kvpress press is refused: it is not a cache of the engine)."""
    from omegaconf import open_dict

    from nats.cache.registry import get_cache_class
    from nats.cli import compose
    from nats.finetune.evaluate import plan_methods
    from nats.utils import CONF_DIR

    models = sorted(p.stem for p in (Path(CONF_DIR) / "hf_model").glob("*.yaml"))
    group = ALIASES.get(pretrained, pretrained)
    cfg = compose([f"hf_model={group}"] if group in models else [], "eval_hf")
    with open_dict(cfg):
        if group not in models:  # a folder, a .gguf file, smollm2-135m, a hub name
            cfg.hf_model.name_or_path, cfg.hf_model.max_context = pretrained, None
        if gguf_file is not None:
            cfg.hf_model.gguf_file = gguf_file
        if dtype is not None:
            cfg.hf_model.dtype = dtype
        cfg.hf_model.local_files_only = bool(local_files_only)
        if isinstance(type_bias, str):  # g:l:s (commas separate the harness' model_args)
            type_bias = type_bias.replace(":", " ").split()
        cfg.scorers, cfg.dms, cfg.window, cfg.type_bias = scorers, dms, window, type_bias
        if not isinstance(policy, str) or policy not in cfg.policies:
            raise ValueError(f"nats: unknown policy={policy!r}; available: {', '.join(cfg.policies)}")
        if cfg.policies[policy].get("kvpress"):
            raise ValueError(
                f"nats: policy={policy} is a kvpress press, not a cache of the project's engine: kvpress' presses run "
                "through nats-eval-hf only (docs/kvpress.md)"
            )
        need = get_cache_class(cfg.policies[policy].name).requires_core
        if need == "nats" and not scorers:
            raise ValueError(
                f"nats: policy={policy} needs NAtS' fine-tuned scorers: pass scorers=<fine-tuning run>/scorers.pt (or "
                "its .ckpt, or an adapter folder), or choose another policy"
            )
        if need == "dms" and not dms:
            raise ValueError(
                f"nats: policy={policy} needs DMS' retrofit: pass dms=<retrofit run>/dms_q_proj.pt (nats-train "
                "experiment=finetune_smollm2_dms), or choose another policy"
            )
        cfg.methods = [policy]
        # plan_methods checks fractions (nats-eval-hf's budgets); a number of tokens is checked by the cache
        cfg.budgets = [budget if isinstance(budget, float) and 0 < budget < 1 else 0.5]
    try:
        plan_methods(cfg, has_scorers=bool(scorers))
    except ValueError as err:
        raise ValueError(f"nats: {err}") from None
    return cfg


def _batches(keys: list[tuple], size: int, limit: int, budget_of) -> Iterator[tuple[list[tuple], Any]]:
    """Consecutive inputs in batches of at most ``size`` that share a budget and whose padded rows (longest
    context + longest continuation) fit ``limit`` tokens."""
    batch: list[tuple] = []
    budget = None
    for key in keys:
        b = budget_of(key)
        if batch:
            P = max(len(key[0]), *(len(k[0]) for k in batch))
            N = max(len(key[1]), *(len(k[1]) for k in batch))
            if len(batch) == size or b != budget or P + N > limit:
                yield batch, budget
                batch = []
        batch.append(key)
        budget = b
    if batch:
        yield batch, budget


def _device(device: str | None) -> torch.device:
    """``auto`` (or None): CUDA if available; a CUDA device where there is none: the CPU, with a warning (the
    harness' command line asks for cuda:0 unless told otherwise, and its ``hf`` model falls back the same way)."""
    from nats.utils import resolve_device

    if device in (None, "auto"):
        return resolve_device("auto")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log.warning(f"nats: device={device} but CUDA is not available: running on the CPU (pass --device cpu)")
        return torch.device("cpu")
    return dev


class _DropPreloaded(logging.Filter):
    """HFLM's warnings about a model passed as an object (nats loads it; every argument that applies is honoured)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("`pretrained` model kwarg") or msg.startswith("Passed an already-initialized"))


@contextlib.contextmanager
def _quiet_preloaded():
    logger = logging.getLogger("lm_eval.models.huggingface")
    drop = _DropPreloaded()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
