"""ANNA: approximate-nearest-neighbour attention by angular LSH (Liu, Yu, Sanford, Andoni, Hsu, NeurIPS 2025),
and `softmax_surrogate`, the dense attention with the same scores that a model is trained with.

Scores. Both cores score a query-key pair by the cosine of their angle at inverse temperature `beta`:

    s_ij = beta * <q_i / |q_i|, k_j / |k_j|>,

so the nearest key (smallest angle) gets the largest weight, and `beta` sets how sharply the softmax picks it.
`softmax_surrogate` takes the softmax of s_i. over all keys (j <= i when causal); it is differentiable and is
what a model is trained with. `anna` takes the softmax only over the keys that an LSH puts in the query's bucket.

Hash family: random hyperplanes (SimHash, Charikar 2002), the angular LSH. One hash function is
h_a(u) = 1[<a, u> > 0] with a ~ N(0, I_D); two vectors at angle theta agree on it with probability
1 - theta / pi. A *table* concatenates `z` such functions into a z-bit code (2^z buckets); there are `l`
independent tables. Query i and key j *collide* if their codes are equal in at least one table, which happens
with probability 1 - (1 - (1 - theta/pi)^z)^l: near pairs almost surely, far pairs rarely when z is large.
`z = 0` (no hash functions) puts everything in one bucket: ANNA is then exactly the surrogate.

Attention set of query i: the colliding keys (and j <= i when causal). A query with no colliding key would
have an empty softmax; `empty="self"` (default) lets it attend to its own position only (y_i = v_i, the
Reformer convention; always available, also under a causal mask), `empty="zero"` returns y_i = 0.

The planes are fixed buffers drawn from `seed` (mixed with the layer index; every head has its own planes),
not parameters and not saved in checkpoints (`persistent=False`): they follow from the config, and the state
dicts of a surrogate model and of an ANNA model are interchangeable. With grouped-query attention, keys are
hashed with the planes of the query head that reads them.

The implementation is vectorised but not sub-quadratic: it builds the N x N collision mask (one comparison
per table) and a masked dense softmax, which is exact and fast for the short sequences of the paper's tasks;
a sub-quadratic version would sort the codes per table and attend within buckets.

Swapping cores in a trained model: `use_anna(model, l, z)` (or `swap_attention(model, cfg)`) returns a copy
of a GPT whose attention cores are replaced, weights untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from nats.attention.registry import AttentionCore, AttentionDims, AttentionOutput, build_attention, register_attention

__all__ = ["SoftmaxSurrogateAttention", "AnnaAttention", "plane_seed", "swap_attention", "use_anna"]

EMPTY_POLICIES = ("self", "zero")


def _unit(u: torch.Tensor) -> torch.Tensor:
    return F.normalize(u, dim=-1, eps=1e-6)


def _expand_kv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, Hq, N, D] (query head h reads kv head h // (Hq / Hkv))."""
    if t.shape[1] == n_head:
        return t
    return t.repeat_interleave(n_head // t.shape[1], dim=1)


@register_attention("softmax_surrogate")
class SoftmaxSurrogateAttention(AttentionCore):
    """Dense softmax over beta * cos(q_i, k_j): the differentiable surrogate that ANNA approximates."""

    def __init__(self, dims: AttentionDims, beta: float = 1.0):
        super().__init__(dims)
        if beta <= 0:
            raise ValueError(f"beta (inverse temperature) must be > 0, got {beta}")
        self.beta = float(beta)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """beta * cosine similarities [B, Hq, N, N] (keys expanded to the query heads)."""
        return self.beta * _unit(q) @ _unit(_expand_kv(k, q.shape[1])).transpose(-1, -2)

    def forward(self, q, k, v, x) -> AttentionOutput:
        # q: [B, Hq, N, D], k/v: [B, Hkv, N, D] -> y: [B, Hq, N, D]
        gqa = q.shape[1] != k.shape[1]
        y = F.scaled_dot_product_attention(
            _unit(q), _unit(k), v, is_causal=self.dims.causal, scale=self.beta, enable_gqa=gqa
        )
        return AttentionOutput(y)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, causal={self.dims.causal}"


def plane_seed(seed: int, layer_idx: int) -> int:
    """The generator seed of one layer's hash planes (distinct layers get distinct planes)."""
    return (int(seed) * 1_000_003 + int(layer_idx)) % (2**63 - 1)


@register_attention("anna")
class AnnaAttention(SoftmaxSurrogateAttention):
    """Softmax over beta * cos(q_i, k_j) restricted to the keys sharing q_i's bucket in >= 1 of l LSH tables.

    l: number of hash tables; z: hash functions (bits) per table; beta: inverse temperature;
    seed: draws the planes; empty: "self" | "zero", what a query without any colliding key does.
    """

    def __init__(
        self, dims: AttentionDims, l: int = 8, z: int = 1, beta: float = 1.0, seed: int = 0, empty: str = "self"
    ):
        super().__init__(dims, beta=beta)
        if l < 1 or z < 0:
            raise ValueError(f"ANNA needs l >= 1 tables and z >= 0 hash functions per table, got l={l}, z={z}")
        if z > 62:
            raise ValueError(f"z={z} bits do not fit a 64-bit bucket id")
        if empty not in EMPTY_POLICIES:
            raise ValueError(f"empty={empty!r} is not one of {EMPTY_POLICIES}")
        self.l, self.z, self.seed, self.empty = int(l), int(z), int(seed), empty
        g = torch.Generator().manual_seed(plane_seed(seed, dims.layer_idx))
        planes = torch.randn(dims.n_head, self.l, self.z, dims.head_dim, generator=g)  # [Hq, l, z, D]
        self.register_buffer("planes", planes, persistent=False)
        self.register_buffer("bit_weights", 2 ** torch.arange(self.z, dtype=torch.int64), persistent=False)

    # ------------------------------------------------------------------ hashing
    def codes(self, u: torch.Tensor) -> torch.Tensor:
        """Bucket ids [B, Hq, N, l] (int64 in [0, 2^z)) of vectors u [B, Hq, N, D], one per table."""
        B, H, N, _ = u.shape
        if self.z == 0:
            return torch.zeros(B, H, N, self.l, dtype=torch.int64, device=u.device)
        proj = torch.einsum("bhnd,hlzd->bhnlz", u.float(), self.planes.float())  # [B, H, N, l, z]
        return ((proj > 0).long() * self.bit_weights).sum(-1)

    def collisions(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B, Hq, N, N] bool: query i and key j share a bucket in at least one table (no causal mask)."""
        cq, ck = self.codes(q), self.codes(_expand_kv(k, q.shape[1]))
        hit = cq[..., :, None, 0] == ck[..., None, :, 0]
        for t in range(1, self.l):  # one comparison per table; nothing loops over queries
            hit |= cq[..., :, None, t] == ck[..., None, :, t]
        return hit

    def attention_mask(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [B, Hq, N, N] of the keys each query attends to, empty [B, Hq, N]: queries without a
        colliding key, handled by the `empty` policy: with "self" their mask holds only the diagonal)."""
        mask = self.collisions(q, k)
        N = q.shape[-2]
        if self.dims.causal:
            mask &= torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        empty = ~mask.any(-1)
        if self.empty == "self":
            eye = torch.eye(N, dtype=torch.bool, device=q.device)
            mask = mask | (empty[..., :, None] & eye)
        return mask, empty

    # ------------------------------------------------------------------ attention
    def forward(self, q, k, v, x) -> AttentionOutput:
        # q: [B, Hq, N, D], k/v: [B, Hkv, N, D] -> y: [B, Hq, N, D]
        mask, empty = self.attention_mask(q, k)
        s = self.scores(q, k).float().masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        if self.empty == "zero":
            p = p.masked_fill(empty[..., None], 0.0)  # rows of -inf only: NaN -> 0, so y_i = 0
        y = p.to(v.dtype) @ _expand_kv(v, q.shape[1])
        N = q.shape[-2]
        allowed = N * (N + 1) / 2 if self.dims.causal else N * N
        with torch.no_grad():
            stats = {
                # fraction of the (causally) allowed query-key pairs that ANNA attends to
                "anna_density": mask.sum(dim=(-1, -2)).float().mean() / allowed,
                "anna_empty": empty.float().mean(),  # fraction of queries with no colliding key
            }
        return AttentionOutput(y, stats=stats)

    def extra_repr(self) -> str:
        return (
            f"l={self.l}, z={self.z}, beta={self.beta}, seed={self.seed}, empty={self.empty}, causal={self.dims.causal}"
        )


# ---------------------------------------------------------------------- swapping cores in a trained model
def swap_attention(model, attention: Mapping[str, Any], inplace: bool = False):
    """Replace the attention core of every block of a `GPT` by the one `attention` names (e.g.
    `{"name": "anna", "l": 8, "z": 1, "beta": 10.0}`), keeping all weights and the output gate.

    Returns a deep copy (or `model` itself with inplace=True), in the mode (train/eval) of `model`; its
    `config.attention` records the new core.
    """
    new = model if inplace else copy.deepcopy(model)
    cfg = dict(attention)
    gate = cfg.pop("output_gate", None)
    old_gate = new.config.attention.get("output_gate", "none")
    if gate is not None and gate != old_gate:
        raise ValueError(f"swap_attention swaps the core only; the model's output_gate is {old_gate!r}, not {gate!r}")
    for block in new.blocks:
        old = block.attn.core
        device = next((t.device for t in list(old.parameters()) + list(old.buffers())), None)
        if device is None:
            device = next(new.parameters()).device
        core = build_attention(cfg, old.dims).to(device)
        core.train(old.training)
        block.attn.core = core
    new.config.attention = {**cfg, "output_gate": old_gate}
    return new


def use_anna(
    model, l: int, z: int, beta: float | None = None, seed: int = 0, empty: str = "self", inplace: bool = False
):
    """A copy of `model` (a GPT trained with `softmax_surrogate`, usually) with ANNA attention in every layer.

    beta: ANNA's inverse temperature; None takes the one of the model's current cores (a surrogate's).
    """
    if beta is None:
        betas = {getattr(block.attn.core, "beta", None) for block in model.blocks}
        if None in betas or len(betas) != 1:
            raise ValueError(
                "use_anna(beta=None) takes beta from the model's cores, which must all be softmax_surrogate "
                f"(or anna) with one beta; found {betas}: pass beta explicitly"
            )
        beta = betas.pop()
    return swap_attention(
        model, {"name": "anna", "l": l, "z": z, "beta": beta, "seed": seed, "empty": empty}, inplace=inplace
    )
