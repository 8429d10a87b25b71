"""The full KV cache a strong engineer would write for a Llama-family transformers model, gpt-fast style: the best
full-cache baseline of `benchmarks/bench_hf_decode.py` (its rows ``sdpa_static`` and ``flex_static``).

A hand-written greedy decode loop over the transformers model's own modules (embedding, q/k/v/o projections, MLPs,
RMS norms, its rotary tables, LM head; q/k/v as one product where `nats.hf.fused` fused them, as gpt-fast's
``wqkv``), not ``model.generate``: keys and values go into preallocated buffers
``[B, Hkv, max_len, D]``, one pair per layer (a write into a view of one buffer of all layers would make the
compiled step copy that buffer whole at every layer), each KV head is read once for its group of query heads
(``enable_gqa=True``: no repeated KV heads), and no mask is built for a decode step:

* ``attention="sdpa"``: `F.scaled_dot_product_attention` over exactly the positions written so far (the buffer
  sliced to ``pos + 1``, no mask: FlashAttention's decode path on a GPU); the step is compiled with the length
  dynamic (one graph after a recompile), without CUDA graphs (the slice's length changes every step);
* ``attention="flex"``: FlexAttention over the whole buffer with a block mask of the keys up to the position (the
  blocks past it are skipped, not read), so every step has the same shapes: compiled with static shapes and CUDA
  graphs (``mode="reduce-overhead"``), as gpt-fast decodes. Each step begins a new CUDA-graph replay
  (``torch.compiler.cudagraph_mark_step_begin``): once anything in the process has called it (`nats.hf.loop`
  does), CUDA-graph trees no longer start one by themselves, and a step whose previous output is still referenced
  records a new graph; in `benchmarks/bench_hf_decode.py` the flex rows that followed a row of the project's loop
  recorded a graph at nearly every step (124 of 127; 0.07-0.15x the full cache) until the decoder marked its steps.

The prefill (the prompt, eager) is causal SDPA over the prompt's own keys. Greedy tokens equal ``model.generate``'s
with transformers' ``StaticCache`` (`tests/test_hf_cache.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nats.hf.fused import fused_sizes


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as transformers' Llama applies it (``cos``, ``sin``: ``[T, D]``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class GptFastDecoder:
    """Greedy decoding of ``model`` (a transformers Llama-family causal LM) for ``batch`` sequences of at most
    ``max_len`` tokens; reusable: each `generate` overwrites the buffers from position 0."""

    def __init__(self, model, batch: int, max_len: int, attention: str = "sdpa", compile: bool = True):
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', not {attention!r}")
        cfg, p = model.config, next(model.parameters())
        self.model, self.body, self.attention, self.max_len = model, model.model, attention, max_len
        self.n_head, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head
        shape = (batch, self.n_kv, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        positions = torch.arange(max_len, device=p.device)[None]
        cos, sin = self.body.rotary_emb(self.k[0][0], positions)  # the model's own tables, in its dtype
        self.cos, self.sin = cos[0], sin[0]
        for t in (*self.k, *self.v, self.cos, self.sin):  # buffers at fixed addresses: CUDA graphs read them in place
            torch._dynamo.mark_static_address(t)
        if attention == "flex":
            self.block = 128  # FlexAttention's KV block
            self.blocks = torch.arange(-(-max_len // self.block), device=p.device, dtype=torch.int32)
        step = self._decode_sdpa if attention == "sdpa" else self._decode_flex
        self.cudagraphs = compile and attention == "flex" and p.is_cuda  # each step a CUDA-graph replay
        if compile:
            # flex: static shapes, one graph per decoder shape, as gpt-fast compiles; sdpa: the length is dynamic
            # by design
            mode = "reduce-overhead" if self.cudagraphs else None
            step = torch.compile(step, mode=mode, fullgraph=True, dynamic=False if attention == "flex" else None)
        self.step = step

    def kv_nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.k)

    def _layers(self, ids: Tensor, pos: Tensor, attend) -> Tensor:
        """The logits of the last position of ``ids`` ``[B, T]`` at positions ``pos`` ``[T]``."""
        B, T = ids.shape
        x = self.body.embed_tokens(ids)
        cos, sin = self.cos[pos], self.sin[pos]
        for i, layer in enumerate(self.body.layers):
            a, h = layer.self_attn, layer.input_layernorm(x)
            if hasattr(a, "qkv_weight"):  # fused (nats.hf.fused): one product, as gpt-fast's wqkv
                q, k, v = F.linear(h, a.qkv_weight, a.qkv_bias).split(fused_sizes(a), dim=-1)
            else:
                q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            q = rotate(q.view(B, T, self.n_head, self.head_dim).transpose(1, 2), cos, sin)
            k = rotate(k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            y = attend(i, q, k, v)
            x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.body.norm(x[:, -1]))

    def _prefill(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self._layers(
            ids, pos, lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ).argmax(-1)

    def _decode_sdpa(self, token: Tensor, pos: Tensor, n: int) -> Tensor:
        """One step: ``token`` ``[B]`` at position ``pos`` ``[1]``; ``n = pos + 1`` keys (a Python int, dynamic)."""

        def attend(i, q, k, v):
            return F.scaled_dot_product_attention(q, self.k[i][:, :, :n], self.v[i][:, :, :n], enable_gqa=True)

        return self._layers(token[:, None], pos, attend).argmax(-1)

    def _decode_flex(self, token: Tensor, pos: Tensor) -> Tensor:
        """One step over the whole buffer: the block mask lists the KV blocks up to ``pos`` (fixed shapes)."""
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= pos[0]

        count = (pos // self.block + 1).to(torch.int32).view(1, 1, 1)
        mask = BlockMask.from_kv_blocks(
            count, self.blocks.view(1, 1, 1, -1), BLOCK_SIZE=self.block, mask_mod=visible, seq_lengths=(1, self.max_len)
        )

        def attend(i, q, k, v):
            return flex_attention(q, self.k[i], self.v[i], block_mask=mask, enable_gqa=True)

        return self._layers(token[:, None], pos, attend).argmax(-1)

    @torch.no_grad()
    def generate(self, prompt: Tensor, n: int, on_prefill=None) -> Tensor:
        """``prompt`` ``[B, P]`` and ``n`` greedy tokens after it, ``[B, P + n]`` (as ``model.generate`` returns);
        ``on_prefill``: called once after the prompt's forward, before the decode steps."""
        B, P = prompt.shape
        if P + n > self.max_len or B != self.k[0].shape[0]:
            raise ValueError(f"GptFastDecoder: batch {B}, {P} + {n} tokens do not fit {tuple(self.k[0].shape)}")
        out = [prompt, self._prefill(prompt)[:, None]]
        if on_prefill is not None:
            on_prefill()
        pos = torch.full((1,), P, dtype=torch.long, device=prompt.device)
        for t in range(P, P + n - 1):
            if self.cudagraphs:  # each step a new replay (its output is cloned below; module docstring)
                torch.compiler.cudagraph_mark_step_begin()
            token = self.step(out[-1][:, 0], pos, *((t + 1,) if self.attention == "sdpa" else ()))
            out.append(token[:, None].clone())  # CUDA graphs reuse their output buffer
            pos += 1
        return torch.cat(out, 1)
