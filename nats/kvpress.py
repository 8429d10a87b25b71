"""NAtS as a kvpress press: `NAtSPress` runs a model's trained NAtS scorers inside NVIDIA's kvpress
(``KVPressTextGenerationPipeline``), over the prefill and the decoding, so that a kvpress user evaluates NAtS with
kvpress' own code (docs/kvpress.md, "NAtS as a kvpress press")::

    from kvpress import KVPressTextGenerationPipeline
    from nats.kvpress import NAtSPress

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)  # or pipeline("kv-press-text-generation")
    press = NAtSPress(scorers="<run>/scorers.pt")  # or an adapter folder: what nats-eval-hf scorers= takes
    pipe(context, question=question, press=press, max_new_tokens=32)["answer"]
    press.kept(), press.compression_ratio  # what each layer and KV head holds; the share NAtS evicted

What it computes is the project's NAtS cache (docs/NATS_SPEC.md sections 2 and 5; `nats.hf.StaticPolicyCache` with
policy ``nats``), from the project's code:

* **Prefill.** NAtS is a sparse attention in the prompt too: each prompt query reads only the keys its types leave
  visible (spec section 2). kvpress' presses all prefill with exact attention and prune afterwards; that would run
  another model than the one the scorers were trained with (and than the NAtS cache runs). So inside ``with
  press(model)`` the model's attention is this module's function (``model.config._attn_implementation`` =
  ``"nats_kvpress"``, restored on exit; kvpress' KVComposePress switches the implementation the same way), which
  prefills with the NAtS cache's own prompt step, `nats.cache.policies.nats.NAtSRule.prompt` (the scorer's types,
  token 0 global, attention under their mask).
* **Decoding.** Each new token's type is the scorer's (`NAtSRule.chunk_types`: the step's and the continuation's
  arithmetic); query i reads what a NAtS cache holds after i tokens (`held`: `kept_after_prompt`, its globals and the
  locals after its last global, and the ring of `nats_rows`, its sliding tokens of the last W - 1 positions) and
  itself, through the engine's masked attention (`nats.cache.engine.chunk_attention`). The pipeline feeds the
  question as one forward of several tokens; each of them gets its own row of the mask (a global among them ends the
  locals for the later ones), as NAtS' continuation does.
* **Eviction.** After each forward of a layer the press's kvpress hook (`forward_hook`) drops from kvpress' cache
  (a transformers ``DynamicCache``) every position that no row (sequence x KV head) holds any more, as kvpress'
  presses compress the cache layer.

**Per-head lengths.** NAtS keeps a different number of tokens per KV head; a ``DynamicCache`` holds one length per
layer. kvpress' answer for head-wise presses (AdaKV, DMS) is ``module.masked_key_indices``: the positions one head
dropped stay in the cache and its attention patch overwrites their keys with a key whose score underflows. That mask
is one set of keys for every query of a forward, while the question's queries each need their own NAtS row (above),
and its replaced key is an approximation (its score is large and negative, not -inf). So the press keeps kvpress'
physical eviction for the positions every head dropped and gives the rest of each head's keep to the attention as
an exact boolean mask over the held keys: the same keys, per head, as the NAtS cache reads. What each head holds is
`kept` (`NAtSPress.kept`); what kvpress' cache physically holds, the union over the heads, is `held_tokens`.

The model must be a supported transformers Llama / Mistral / Qwen2 (`nats.hf.SUPPORTED_MODEL_TYPES`) in eval mode.
Scorers: ``NAtSPress(scorers=...)`` attaches and loads them at the first use, exactly as ``nats-eval-hf
scorers=<file or folder>`` does (`nats.hf.pretrained.prepare_model`: a ``scorers.pt``, its run's checkpoint or an
adapter folder; ``window=`` as there); or ``NAtSPress()`` on a model that has them already
(`nats.hf.adapter.load_nats_adapter`). Scorers of another model are refused in one line.

Tested with kvpress 0.5.5 on transformers 5.24 (kvpress installed with ``--no-deps``: its pins say < 5.3; kvpress'
own presses read the attention's cache argument by its name before 5.24, ``past_key_values``, and fail there, while
this press reads it under either name, `nats.hf.compat.cache_from_kwargs`) and on transformers 5.2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nats.cache.engine import chunk_attention
from nats.cache.policies.nats import SLIDING, NAtSRule, kept_after_prompt
from nats.cache.rule import RuleContext
from nats.hf.attention import _check_mask, rescaled
from nats.hf.compat import cache_from_kwargs
from nats.hf.hooks import _decoder_layers, routed_cores
from nats.hf.scorers import detach_nats, is_attached, nats_state_dict

try:
    from kvpress import PrefillDecodingPress
    from kvpress.presses.base_press import BasePress
except ImportError as err:  # one line naming the install (kvpress is an optional extra)
    raise ImportError(
        f"nats.kvpress needs NVIDIA's kvpress ({err}): pip install --no-deps 'kvpress==0.5.5', then what its import "
        "needs: pip install datasets cachetools fire requests (docs/kvpress.md, 'NAtS as a kvpress press')"
    ) from err

__all__ = ["ATTENTION", "NAtSPress", "held"]

#: the name of the press's attention function in transformers' registry (selected inside ``with press(model)``)
ATTENTION = "nats_kvpress"
_PRESS = "_nats_kvpress"  # the attribute of an attention module that points to the press running it
_LOADED = "_nats_kvpress_scorers"  # the attribute of a model: the scorers (and window) a press loaded into it
_RULE = NAtSRule()


def held(types: Tensor, window: int) -> Tensor:
    """What a NAtS cache holds after the tokens of ``types`` ``[R, T]`` (integer types, rows r = b * Hkv + h):
    bool ``[R, T]``, its pool (`kept_after_prompt`: the globals and the locals after the row's last global) and its
    ring (`nats_rows`: the sliding tokens of the last W - 1 positions). Query T reads these and itself (spec
    section 5)."""
    pool, _ = kept_after_prompt(types)
    T = types.shape[-1]
    ring = (types == SLIDING) & (torch.arange(T, device=types.device) >= T - window + 1)
    return pool | ring


@dataclass
class _Layer:
    """One attention layer's state in the press: every position's type so far ``[R, T]`` (the rows' scorer types,
    token 0 global), the positions kvpress' cache holds ``[S]`` in its order, and whether a forward added tokens that
    the hook has not evicted from yet."""

    types: Tensor
    positions: Tensor
    window: int
    fresh: bool = True


@dataclass
class NAtSPress(PrefillDecodingPress):
    """NAtS' cache as a kvpress press (module docstring). A `PrefillDecodingPress`, so that kvpress' pipeline runs it
    over the prefill and the decoding (with one question per call, as for kvpress' decoding presses).

    Parameters
    ----------
    scorers : str or Path, optional
        The fine-tuned scorers to attach at the first use: a ``scorers.pt``, its run's Lightning checkpoint or an
        adapter folder (what ``nats-eval-hf scorers=`` takes). None: the model has NAtS attached already.
    window : int, optional
        NAtS' window W when loading ``scorers`` (default: the run's, as ``nats-eval-hf window=``).
    prefill_kernel : str
        How the NAtS prompt step runs (`nats.hf.StaticPolicyCache`'s option): ``"auto"`` (Triton on CUDA where the
        kernels import, else PyTorch), ``"torch"`` or ``"triton"``.
    """

    scorers: str | Path | None = None
    window: int | None = None
    prefill_kernel: str = "auto"
    _layers: dict[int, _Layer] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.prefilling_press is not None or self.decoding_press is not None:
            raise ValueError("NAtSPress: NAtS is its own prefilling and decoding press; pass neither")
        if self.prefill_kernel not in ("auto", "torch", "triton"):
            raise ValueError(
                f"NAtSPress: prefill_kernel must be 'auto', 'torch' or 'triton', got {self.prefill_kernel!r}"
            )
        if self.window is not None and self.scorers is None:
            raise ValueError("NAtSPress: window= applies to the scorers it loads: pass scorers= too")

    # ------------------------------------------------------------------ set-up
    def post_init_from_model(self, model: nn.Module) -> None:
        """Attach and load ``scorers`` (once per model), else check that the model has NAtS scorers (`__call__`
        calls it before it selects the press's attention; kvpress' own call, inside, finds it done)."""
        if model.config._attn_implementation == ATTENTION:
            return
        loaded = None if self.scorers is None else (str(self.scorers), self.window)
        if loaded is not None and not (is_attached(model) and getattr(model, _LOADED, None) == loaded):  # once
            if is_attached(model):
                raise ValueError(
                    f"NAtSPress: this model has other NAtS scorers attached already than scorers={self.scorers}; use "
                    "NAtSPress() without scorers= (or a model without them)"
                )
            self._load(model)
            setattr(model, _LOADED, loaded)
        if not is_attached(model):
            raise ValueError(
                "NAtSPress needs NAtS scorers: NAtSPress(scorers=<run>/scorers.pt or an adapter folder), or a model "
                "prepared by nats.hf.adapter.load_nats_adapter"
            )
        routed_cores(model, "NAtSPress")  # its attention goes through nats (the hooks stash the scorers' input)
        if model.training:
            raise ValueError("NAtSPress: the model is in training mode (its scorers would sample types): model.eval()")

    def _load(self, model: nn.Module) -> None:
        """The scorers attached and loaded as nats-eval-hf does (`nats.hf.pretrained.prepare_model`); one line if
        they were trained for another model."""
        from omegaconf import OmegaConf  # noqa: PLC0415

        from nats.hf.adapter import model_shape  # noqa: PLC0415
        from nats.hf.pretrained import prepare_model, read_scorers  # noqa: PLC0415

        path = Path(self.scorers)
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        cfg = OmegaConf.create({"scorers": str(path), "window": self.window, "hf_model": {"name_or_path": name}})
        try:
            prepare_model(cfg, model)
        except (RuntimeError, ValueError) as err:
            message = str(err).splitlines()[0]
            if isinstance(err, RuntimeError) and is_attached(model):  # load_state_dict's size mismatch, many lines
                own = {k: tuple(v.shape) for k, v in nats_state_dict(model).items()}
                theirs = {k: tuple(v.shape) for k, v in read_scorers(path)[0].items()}
                key = next((k for k in own if theirs.get(k) != own[k]), None)
                if key is not None:
                    message = (
                        f"scorers={path} do not fit this model ({model_shape(model.config)}): {key} is "
                        f"{list(theirs.get(key, ()))} there, {list(own[key])} here; use the scorers fine-tuned on it"
                    )
            if is_attached(model):
                detach_nats(model)
            raise ValueError(f"NAtSPress: {message}") from None

    @contextlib.contextmanager
    def __call__(self, model: nn.Module):
        """Inside: the model's attention is NAtS' with this press's cache rule, and kvpress' hooks evict after each
        attention layer (`forward_hook`). The pipeline enters it for the prefill and again for the decoding; the
        state lives from one prefill to the next."""
        self.post_init_from_model(model)
        attn = [layer.self_attn for layer in _decoder_layers(model)]
        before = model.config._attn_implementation
        self._n_layer = len(attn)
        for a in attn:
            setattr(a, _PRESS, self)
        model.config._attn_implementation = ATTENTION
        try:
            with BasePress.__call__(self, model):  # kvpress' hooks (PrefillDecodingPress only adds its sub-presses)
                yield
        finally:
            model.config._attn_implementation = before
            for a in attn:
                setattr(a, _PRESS, None)
                a._nats_hidden = a._nats_cache = None

    # ------------------------------------------------------------------ the attention (inside `with press(model)`)
    def attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """The attention output ``[B, N, Hq, D]`` of one layer's forward: the NAtS prompt step on an empty cache,
        else the new queries over the held keys and themselves, each with its NAtS row."""
        core, hidden = module.nats_scorer, module._nats_hidden
        module._nats_hidden = module._nats_cache = None
        if query.dtype != value.dtype or key.dtype != value.dtype:  # under autocast transformers' RoPE gives fp32
            query, key = query.to(value.dtype), key.to(value.dtype)
        B, Hq, n, D = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        R, G = B * Hkv, Hq // Hkv
        q = rescaled(query, scaling, getattr(module, "head_dim", None) or D)
        i = module.layer_idx
        if n == S:  # the prompt: the NAtS cache's own prompt step (the scorer's types, attention under their mask)
            ctx = RuleContext(i, self._n_layer, None, False, self.prefill_kernel)
            state = _RULE.prompt(ctx, core, q, key, value, hidden, None)
            types = state.types.reshape(R, n).long()
            self._layers[i] = _Layer(types, torch.arange(n, device=key.device), int(core.window))
            return state.y.transpose(1, 2).contiguous()
        layer = self._layers.get(i)
        if layer is None or layer.positions.numel() + n != S:
            raise RuntimeError(
                "NAtSPress: kvpress' cache does not hold what the press kept (a prompt prefilled outside "
                "`with press(model)`, or the cache changed); prefill the context under the press"
            )
        qr = q.reshape(R, G, n, D)
        first = layer.types.shape[1]
        layer.types = torch.cat((layer.types, _RULE.chunk_types(core, qr, hidden)), dim=1)
        new = first + torch.arange(n, device=key.device)
        cols = torch.cat((layer.positions, new))  # the positions of the keys the attention gets
        rows = []
        for c in range(n):  # query first + c reads what the cache holds after first + c tokens, and itself
            visible = torch.zeros(R, first + n, dtype=torch.bool, device=key.device)
            visible[:, : first + c] = held(layer.types[:, : first + c], layer.window)
            visible[:, first + c] = True
            rows.append(visible[:, cols])
        mask = torch.stack(rows, dim=1)  # [R, n, S]
        y = chunk_attention(qr, key.reshape(R, S, D), value.reshape(R, S, D), mask)
        layer.positions, layer.fresh = cols, True
        return y.reshape(B, Hq, n, D).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ eviction (kvpress' hook)
    def forward_hook(self, module: nn.Module, input: Any, kwargs: dict, output: Any):
        """After a layer's attention: the positions no row holds any more leave kvpress' cache."""
        layer = self._layers.get(module.layer_idx)
        if layer is None or not layer.fresh:
            return output
        from transformers import QuantizedCache  # noqa: PLC0415

        cache = cache_from_kwargs(kwargs)
        if cache is None or isinstance(cache, QuantizedCache) or not hasattr(cache.layers[module.layer_idx], "keys"):
            raise ValueError("NAtSPress: runs on a transformers DynamicCache (kvpress' default cache)")
        cache_layer = cache.layers[module.layer_idx]
        keep = held(layer.types, layer.window)[:, layer.positions]  # [R, S]: which held key each row keeps
        idx = keep.any(0).nonzero().squeeze(1)  # held by some row (sequence x KV head)
        cache_layer.keys = cache_layer.keys.index_select(2, idx)
        cache_layer.values = cache_layer.values.index_select(2, idx)
        layer.positions, layer.fresh = layer.positions[idx], False
        return output

    # ------------------------------------------------------------------ measurements
    @property
    def seen(self) -> int:
        """Tokens every row has seen so far (prompt and decoding)."""
        return int(self._layers[0].types.shape[1]) if self._layers else 0

    def kept(self) -> Tensor:
        """The tokens each layer's rows hold now ``[n_layer, B * Hkv]`` (per KV head: NAtS' own lengths)."""
        return torch.stack([held(layer.types, layer.window).sum(-1) for _, layer in sorted(self._layers.items())])

    def held_tokens(self) -> list[int]:
        """The positions kvpress' cache holds per layer (the union over the rows: what its tensors take)."""
        return [int(layer.positions.numel()) for _, layer in sorted(self._layers.items())]

    @property
    def compression_ratio(self) -> float:
        """The share of the tokens seen that NAtS evicted, over layers and KV heads (kvpress' DMSPress reports its
        ratio so); read-only: NAtS' scorers decide what they keep."""
        if not self._layers:
            raise ValueError("NAtSPress: run the pipeline (or a forward under the press) first")
        return 1.0 - float(self.kept().double().mean()) / self.seen

    @compression_ratio.setter
    def compression_ratio(self, value):
        raise AttributeError("NAtSPress: compression_ratio is read-only (NAtS' scorers decide what they keep)")


def press_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                            dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):  # fmt: skip
    """transformers attention function (``"nats_kvpress"``): the press running this module attends
    (`NAtSPress.attend`); returns ``(out [B, N, Hq, D], None)``. Its parameters in the order of transformers' own
    functions (``dropout`` before ``scaling``), which kvpress' attention patch assumes."""
    press = getattr(module, _PRESS, None)
    if press is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside `with NAtSPress()(model)` (kvpress' pipeline)")
    if dropout:
        raise NotImplementedError("NAtSPress: attention dropout is not supported (model.eval())")
    # the prompt: one unpadded sequence per row (kvpress' pipeline); later, transformers builds one mask for every layer
    # from layer 0's cache length while each layer holds its own number of keys: the press builds the rows itself
    if query.shape[2] == key.shape[2]:
        _check_mask(attention_mask, query.shape[2], key.shape[2])
    return press.attend(module, query, key, value, scaling), None


def _register() -> None:
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(ATTENTION, press_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # transformers builds a mask per implementation (unused)


_register()
