"""GPT-2 with a pluggable attention core, in one file (after nanoGPT).

GPT-2-small: 12 layers, 12 heads, d=768, vocab padded to 50304, context 1024, no biases, tied embeddings,
pre-LayerNorm, GELU MLP of 4d, init N(0, 0.02) with the residual projections scaled by 1/sqrt(2L).
Positions by RoPE (default, as in the NAtS code) or learned absolute embeddings; `n_kv_head` < `n_head`
gives grouped-query attention. The attention core is chosen by name (`attention.name`) from
`nats.attention.registry`; `attention.output_gate` adds the gated-attention output gate (Qiu et al.).

Reading order: `GPTConfig` and `GPTOutput`; the pieces of a block (`RotaryEmbedding`, `OutputGate`, `Attention`,
`MLP`, `Block`); the model, `GPT`, whose `forward` computes the training loss one of two ways: plain PyTorch
cross-entropy over the logits, or (`fused_cross_entropy`, training only) lm head and cross-entropy as one fused
op that never returns the logits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nats.attention.registry import AttentionDims, build_attention
from nats.utils import settings_key
from nats_kernels.cross_entropy import linear_cross_entropy

OUTPUT_GATES = ("none", "headwise", "elementwise")
# Config keys of older versions, each with what replaced it: an error naming both (see `GPTConfig.from_dict`).
RETIRED_KEYS = {"lse_cross_entropy": "fused_cross_entropy"}


# ----------------------------------------------------------------------------------------------------- config
@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    block_size: int = 1024  # the longest sequence the model accepts
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None = n_head (multi-head); fewer = grouped-query attention
    n_embd: int = 768
    pos_emb: str = "rope"  # "rope" | "learned" | "none"
    rope_base: float = 10000.0
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = True
    causal: bool = True
    n_out: int | None = None  # output classes if not a language model (then tie_embeddings must be False)
    # the attention core's config: "name" (a registered core) and its options, plus "output_gate" (OUTPUT_GATES)
    attention: dict[str, Any] = field(default_factory=lambda: {"name": "dense"})
    # training with targets: lm head + cross-entropy as one fused op (nats_kernels.cross_entropy) that writes the
    # logits' gradient over the logits in the forward, so the [B*N, V] logits are read once; no logits are
    # returned then (validation and eval, without grad, keep the plain path). benchmarks/bench_train.py --fused-ce
    fused_cross_entropy: bool = False

    def __post_init__(self) -> None:
        self.attention = dict(self.attention)
        sizes = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size")
        small = [k for k in sizes if getattr(self, k) is not None and getattr(self, k) < 1]
        if small:  # before the divisibility checks below, which would divide by zero
            raise ValueError(
                "invalid model config: "
                + "; ".join(f"model.{k}={getattr(self, k)} must be >= 1" for k in small)
                + " (layers, heads, channels and positions are counts): set a positive integer"
            )
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        problems = []
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            problems.append(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.pos_emb not in ("rope", "learned", "none"):
            problems.append(f"pos_emb={self.pos_emb!r} is not one of rope, learned, none")
        if self.pos_emb == "rope" and not self.n_embd % self.n_head and (self.n_embd // self.n_head) % 2:
            hd = self.n_embd // self.n_head
            problems.append(
                f"RoPE needs an even head dimension, got n_embd/n_head = {self.n_embd}/{self.n_head} = {hd}: set "
                f"model.n_embd to a multiple of 2 * n_head (e.g. model.n_embd={(hd + 1) * self.n_head}), or "
                "model.pos_emb=learned"
            )
        if self.n_out is not None and self.tie_embeddings:
            problems.append("n_out is set (a classifier head), so tie_embeddings must be false")
        gate = self.attention.get("output_gate", "none")
        if gate not in OUTPUT_GATES:
            problems.append(f"attention.output_gate={gate!r} is not one of {OUTPUT_GATES}")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> GPTConfig:
        """The config of a dict (a Hydra `model` node, a checkpoint's hyper_parameters["model"]); unknown keys are
        an error, and so are `RETIRED_KEYS`, naming the key that replaced each."""
        retired = [k for k in cfg if k in RETIRED_KEYS]
        if retired:
            raise ValueError(
                "retired model config keys: "
                + ", ".join(f"model.{k} (now model.{RETIRED_KEYS[k]})" for k in retired)
                + "; delete them from the config (a checkpoint's hyper_parameters['model'], a saved config.json), "
                "setting the new key if wanted"
            )
        known = {f.name for f in fields(cls)}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**cfg)

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """A model small enough for a CPU in milliseconds, for tests, checks and demos: vocabulary 97, 48 positions,
        2 layers, 4 query / 2 KV heads, 32 channels, dense attention; `overrides` set any other field."""
        sizes = dict(vocab_size=97, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
        return cls(**{**sizes, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GPTOutput:
    # [B, N, vocab] (or [B, N, n_out]); detached when targets were given; None when the fused loss ran: training
    # with targets and fused_cross_entropy
    logits: torch.Tensor | None
    loss: torch.Tensor | None  # mean cross-entropy over targets != -100, if targets were given
    aux_loss: torch.Tensor | None  # sum of the attention cores' auxiliary losses (NAtS' sparsity term)
    stats: dict[str, torch.Tensor]  # "layer{l}/{name}" -> scalar, detached


# ----------------------------------------------------------------------------------------------------- blocks
class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half form): cos/sin tables for positions 0..block_size-1."""

    def __init__(self, head_dim: int, block_size: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(block_size, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [block_size, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, N, H, D] (heads after tokens, the layout the projection writes); positions: [N]
        cos = self.cos[positions].to(x.dtype)[:, None, :]  # [N, 1, D/2]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class OutputGate(nn.Linear):
    """Gated attention's output gate (Qiu et al.): the attention output y times sigmoid(W x), x the block's
    normalised input; one gate per head (`kind` "headwise", W [n_head, C]) or per output channel ("elementwise",
    W [C, C]).

    The module is the Linear W itself: `gate(x)` gives the gate's logits (nats.analysis reads them) and its
    weights keep the checkpoint keys `blocks.<l>.attn.gate.weight` / `.bias`; `gate.gated(y, x)` applies it."""

    def __init__(self, kind: str, n_embd: int, n_head: int, bias: bool):
        if kind not in ("headwise", "elementwise"):
            raise ValueError(f"output gate {kind!r} is not one of headwise, elementwise")
        super().__init__(n_embd, n_head if kind == "headwise" else n_embd, bias=bias)
        self.kind = kind

    def gated(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [B, H, N, D] (the attention core's output), x [B, N, C] -> y * gate, [B, H, N, D]."""
        B, H, N, D = y.shape
        g = torch.sigmoid(self(x))  # [B, N, H] or [B, N, C]
        if self.kind == "headwise":
            return y * g.transpose(1, 2).unsqueeze(-1)  # [B, H, N, 1]
        return y * g.view(B, N, H, D).transpose(1, 2)  # [B, H, N, D]


class Attention(nn.Module):
    """Projections + RoPE + pluggable core + optional output gate + output projection."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.qkv = nn.Linear(c.n_embd, (c.n_head + 2 * c.n_kv_head) * c.head_dim, bias=c.bias)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.proj.is_residual_projection = True
        attn_cfg = dict(c.attention)
        self.output_gate = attn_cfg.pop("output_gate", "none")  # "none" | "headwise" | "elementwise"
        self.gate = None if self.output_gate == "none" else OutputGate(self.output_gate, c.n_embd, c.n_head, c.bias)
        dims = AttentionDims(
            n_embd=c.n_embd,
            n_head=c.n_head,
            n_kv_head=c.n_kv_head,
            head_dim=c.head_dim,
            block_size=c.block_size,
            layer_idx=layer_idx,
            n_layer=c.n_layer,
            causal=c.causal,
        )
        self.core = build_attention(attn_cfg, dims)
        if hasattr(self.core, "bind_query"):  # a core that reads the layer's own query projection (DMS' decisions)
            self.core.bind_query(self.qkv)
        self.resid_dropout = nn.Dropout(c.dropout)

    def project(self, x: torch.Tensor, rope: RotaryEmbedding | None, positions: torch.Tensor):
        """x [B, N, C] -> q [B, Hq, N, D], k and v [B, Hkv, N, D], positions applied."""
        B, N, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        qk, v = self.qkv(x).split([(H + Hkv) * D, Hkv * D], dim=-1)
        qk = qk.view(B, N, H + Hkv, D)  # [B, N, Hq + Hkv, D]
        if rope is not None:
            qk = rope(qk, positions)  # one pass over q and k together
        q, k = qk.split([H, Hkv], dim=2)
        q = q.transpose(1, 2)  # [B, Hq, N, D]
        k = k.transpose(1, 2)  # [B, Hkv, N, D]
        v = v.view(B, N, Hkv, D).transpose(1, 2)  # [B, Hkv, N, D]
        return q, k, v

    def gate_and_project(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [B, Hq, N, D] (the core's or a KV cache's output), x [B, N, C] (normalised block input) -> [B, N, C]."""
        B, H, N, D = y.shape
        if self.gate is not None:
            y = self.gate.gated(y, x)
        y = y.transpose(1, 2).reshape(B, N, H * D)  # [B, N, C]
        return self.resid_dropout(self.proj(y))

    def forward(self, x, rope, positions, cache=None):
        """x [B, N, C] -> ([B, N, C], the core's AttentionOutput: y, aux_loss, stats).

        With a layer of a KV cache (`nats.cache.engine_cache.LayerPort`) the cache's ``prefill`` of a prompt (from an
        empty layer) replaces the core; the second value is then None. (A decode step, one token through the cache's
        ``step``, is `Block.forward`'s: `before_cache`, the cache, `after_cache`.)"""
        q, k, v = self.project(x, rope, positions)
        if cache is None:
            out = self.core(q, k, v, x)
            return self.gate_and_project(out.y, x), out
        with torch.no_grad():  # a cache's buffers hold keys and values, never their autograd history
            y = cache.prefill(q, k, v, x)
        return self.gate_and_project(y, x), None


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


def before_cache(block: Block, x, rope, positions):
    """A decode step's work in ``block`` before its layer's KV cache: (q, k, v with RoPE applied, the normalised
    input h that NAtS' scorer reads)."""
    h = block.ln_1(x)
    q, k, v = block.attn.project(h, rope, positions)
    return q, k, v, h


def after_cache(block: Block, x, y, h):
    """... and after it: ``y``, the cache's attention output, through the output gate and projection, then the
    MLP, with both residuals."""
    x = x + block.attn.gate_and_project(y, h)
    return x + block.mlp(block.ln_2(x))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.decode_parts = (before_cache, after_cache)  # compiled within GPT.compiled_decode

    def forward(self, x, rope, positions, cache=None, decode: bool = False):
        if cache is not None and decode:  # one token through the layer's KV cache
            before, after = self.decode_parts
            q, k, v, h = before(self, x, rope, positions)
            with torch.no_grad():  # a cache's buffers hold keys and values, never their autograd history
                y = cache.step(q, k, v, h, positions)
            return after(self, x, y, h), None
        a, out = self.attn(self.ln_1(x), rope, positions, cache)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, out


# ------------------------------------------------------------------------------------------------------ model
class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd) if c.pos_emb == "learned" else None
        self.rope = RotaryEmbedding(c.head_dim, c.block_size, c.rope_base) if c.pos_emb == "rope" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.n_out or c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):  # the output gate too (an nn.Linear)
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (6N + attention), as in the PaLM appendix / nanoGPT's MFU."""
        c = self.config
        n = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * n

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # [B, N, C]
        if self.wpe is not None:
            x = x + self.wpe(positions)
        return self.drop(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        caches: Sequence[Any] | None = None,
        pos: torch.Tensor | int | None = None,
    ) -> GPTOutput:
        """idx [B, N] int64 -> logits [B, N, V]; with targets [B, N] also loss = mean CE over targets != -100.

        Decoding through a KV cache (`nats.cache.decode.make_caches`: an `EngineCache`, item i being layer i's):
        with ``caches`` and no ``pos`` the prompt idx [B, N] is prefilled into empty caches; with ``pos`` (the
        token's position: an int, or a LongTensor [1] on the model's device for a step without host
        synchronisation) idx [B, 1] is one decode step. Each layer's cache then replaces its attention core
        (the rest of the block is this forward's); no aux_loss, no stats, no targets."""
        B, N = idx.shape
        if N > self.config.block_size:
            raise ValueError(
                f"sequence length {N} is longer than the model's block_size {self.config.block_size}: "
                f"use shorter windows (data.block_size) or a model with a larger model.block_size"
            )
        decode = pos is not None
        if caches is None:
            if decode:
                raise ValueError("pos= is the position of a decode step: pass the layers' caches too (caches=...)")
            positions = torch.arange(N, device=idx.device)
        else:
            self._check_caches(caches, N, decode, targets)
            if not decode:
                positions = torch.arange(N, device=idx.device)
            elif isinstance(pos, int):
                positions = torch.full((1,), pos, dtype=torch.long, device=idx.device)
            else:
                positions = pos
        x = self.embed(idx, positions)
        aux_loss, stats = None, {}
        for i, block in enumerate(self.blocks):
            x, out = block(x, self.rope, positions, None if caches is None else caches[i], decode)
            if out is None:  # a KV cache ran instead of the core
                continue
            if out.aux_loss is not None:
                aux_loss = out.aux_loss if aux_loss is None else aux_loss + out.aux_loss
            for name, value in out.stats.items():
                stats[f"layer{i}/{name}"] = value.detach()
        x = self.ln_f(x)

        if targets is None:  # inference: the logits only
            return GPTOutput(logits=self.lm_head(x), loss=None, aux_loss=aux_loss, stats=stats)
        if self.config.fused_cross_entropy and torch.is_grad_enabled():  # training: the fused loss, no logits
            return GPTOutput(logits=None, loss=self.fused_loss(x, targets), aux_loss=aux_loss, stats=stats)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)
        # With targets the loss is the differentiable output and the logits are for metrics only. Returned
        # attached, they would be a compiled graph's output that needs a gradient: autograd then feeds the
        # backward a zero [B, N, V] tangent (one fill and one extra read of the logits, ~3% of a GPT-2-small
        # step on an H100, benchmarks/bench_train.py). To differentiate the logits, call without targets.
        return GPTOutput(logits=logits.detach(), loss=loss, aux_loss=aux_loss, stats=stats)

    @contextlib.contextmanager
    def compiled_decode(
        self, backend: str | None = "inductor", inductor: Mapping[str, Any] | None = None
    ) -> Iterator[GPT]:
        """Within the block, decode steps run their dense work around each layer's KV cache (`before_cache`:
        LayerNorm, q/k/v product, RoPE; `after_cache`: output gate and projection, MLP, residuals) compiled by
        ``torch.compile`` with ``backend``, one compile for every layer (the blocks share the code: their weights
        are its inputs). Eager, a GPT-2-small step at batch 8 is ~25 kernels per layer of a few microseconds each:
        its time is the kernels' latency, not the bytes they read (``benchmarks/bench_decode.py``). The caches' own
        kernels stay as they are. Static shapes (one compile per batch size); inductor rounds to bf16 where eager
        does (``emulate_precision_casts``). ``inductor``: inductor settings over `DECODE_INDUCTOR`'s
        (`decode_settings`; backend "inductor" only, the other backends take none): the parts are compiled once per
        backend and settings. `nats.cache.decode.GraphDecoder` runs its warm-up and its captures in it;
        ``backend=None`` is the eager functions."""
        saved = [block.decode_parts for block in self.blocks]
        parts = (before_cache, after_cache) if backend is None else _compiled_decode_parts(backend, inductor)
        for block in self.blocks:
            block.decode_parts = parts
        try:
            yield self
        finally:
            for block, old in zip(self.blocks, saved, strict=True):
                block.decode_parts = old

    def _check_caches(self, caches: Sequence[Any], n: int, decode: bool, targets) -> None:
        if len(caches) != len(self.blocks):
            raise ValueError(f"need one cache per layer: {len(caches)} caches for {len(self.blocks)} layers")
        if decode and n != 1:
            raise ValueError(f"a decode step (pos=...) takes one token per sequence, got {n}")
        if targets is not None:
            raise ValueError("decoding through caches returns logits only: call without targets")

    def fused_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of lm_head(x) (x [B, N, C], after ln_f) against targets [B, N], by the fused op
        (nats_kernels.cross_entropy.linear_cross_entropy)."""
        w = self.lm_head.weight  # [V, C] (the untied head with n_out)
        if torch.is_autocast_enabled(x.device.type):  # custom ops get no autocast: cast as a matmul would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        return linear_cross_entropy(x.reshape(-1, x.size(-1)), w, targets.reshape(-1))  # [B*N, C], [B*N]


_COMPILED_DECODE: dict[tuple, tuple] = {}  # (backend, its settings' key) -> the compiled parts
#: inductor settings of the compiled decode parts by default: rounding to bf16 where eager does (the parts then equal
#: the eager ones). Read only: a caller's own settings go to `GPT.compiled_decode` (``inductor=``), e.g.
#: ``benchmarks/bench_decode.py --inductor KEY=VALUE``.
DECODE_INDUCTOR: Mapping[str, Any] = MappingProxyType({"emulate_precision_casts": True})


def decode_settings(inductor: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inductor settings of the compiled decode parts given ``inductor``: `DECODE_INDUCTOR` with its keys (and
    others) overridden by ``inductor``'s."""
    return {**DECODE_INDUCTOR, **(inductor or {})}


def _compiled_decode_parts(backend: str, inductor: Mapping[str, Any] | None = None) -> tuple:
    """`before_cache` and `after_cache` compiled with ``backend`` (inductor: with `decode_settings` of ``inductor``),
    made once per process and settings (dynamo's code cache is per function: one compile serves every block and
    model of the same shapes)."""
    options = decode_settings(inductor) if backend == "inductor" else None
    key = (backend, settings_key(options or {}))
    if key not in _COMPILED_DECODE:
        _COMPILED_DECODE[key] = tuple(
            torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)
            for fn in (before_cache, after_cache)
        )
    return _COMPILED_DECODE[key]
