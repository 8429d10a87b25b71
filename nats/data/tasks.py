"""Synthetic reasoning tasks as LightningDataModules: Match2 and k-hop induction heads.

Every split is generated from the data seed and the split's index (numpy `default_rng([split, seed])`, split
0 = train, 1 = validation, 2 = test), so the three sets come from disjoint random streams and are the same on
every run and every process. Batches are `(x [B, N] int64, y [B, N] int64)` tuples with -100 = no target, as for
the language-model data; the model is a classifier over positions (`model.n_out = data.n_classes`).

**Match2** (Sanford, Hsu, Telgarsky 2023): x uniform in [M]^N = {0, ..., M-1}^N;
y_i = 1 iff some j in [N] has x_i + x_j = 0 (mod M). As in the original definition j ranges over all
positions, j = i included: with M odd that only matters for x_i = 0, which is always labelled 1.
Label balance: for x_i != 0, P(y_i = 0) = ((M-1)/M)^(N-1) (no other position holds -x_i), so with N = 32,
M = 37 about 57.7% of the labels are 1 (`match2_positive_rate`); the error is over all positions.

**k-hop induction heads** (Sanford, Hsu, Telgarsky 2024): x in [A]^N with no immediate repeats (x_0 uniform,
x_t uniform over the A - 1 tokens other than x_{t-1}). find(i) = j + 1 for the most recent earlier
occurrence j < i of x_i (the position *after* it), undefined if x_i has not occurred before; hop_k(i) =
x[find^k(i)]. With k = 1 the target is the token that followed the most recent earlier occurrence of x_i
(the induction head). Positions where find^k is undefined get -100 (no loss, no error).

`pair_input=True` feeds position i the pair (x_{i-1}, x_i) as one token, id = x_i + A * (x_{i-1} + 1)
(id = x_0 at i = 0; vocabulary A * (A + 1)). A one-layer transformer cannot implement an induction head on
plain tokens (the head must find a key whose *previous* token matches, which needs a second layer or this
input), so the one-layer experiment (`experiment=anna_induction`) uses pair inputs; with plain tokens use two
layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

# the resumable training stream, rank split and loader of the token datamodule (written once there)
from nats.data.datamodule import ResumableDataModule
from nats.data.windows import ResumableDataLoader, worker_options

__all__ = [
    "match2",
    "match2_positive_rate",
    "khop_induction",
    "TaskDataModule",
    "Match2DataModule",
    "InductionHeadsDataModule",
]

SPLITS = {"train": 0, "validation": 1, "test": 2}


def _rng(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng([SPLITS[split], int(seed)])


# ---------------------------------------------------------------------- generators
def match2(n: int, seq_len: int = 32, modulus: int = 37, rng: np.random.Generator | int = 0):
    """n Match2 samples: (x [n, seq_len] int64 in [0, modulus), y [n, seq_len] int64 in {0, 1})."""
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    x = rng.integers(0, modulus, size=(n, seq_len), dtype=np.int64)
    present = np.zeros((n, modulus), dtype=bool)  # present[s, a]: token a occurs in sample s
    np.put_along_axis(present, x, True, axis=1)
    y = np.take_along_axis(present, (-x) % modulus, axis=1).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def match2_positive_rate(seq_len: int = 32, modulus: int = 37) -> float:
    """Expected fraction of 1-labels of Match2 (j = i allowed)."""
    p_zero_token = 1.0 / modulus
    return p_zero_token + (1 - p_zero_token) * (1 - ((modulus - 1) / modulus) ** (seq_len - 1))


def khop_induction(n: int, seq_len: int = 100, alphabet: int = 4, k: int = 1, rng: np.random.Generator | int = 0):
    """n k-hop induction-heads samples: (tokens [n, seq_len] int64 in [0, alphabet), y [n, seq_len] int64,
    -100 where find^k is undefined). The tokens are the plain sequence (see `pair_tokens`)."""
    if alphabet < 2 or k < 1:
        raise ValueError(f"need alphabet >= 2 (no immediate repeats) and k >= 1, got {alphabet}, {k}")
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    first = rng.integers(0, alphabet, size=(n, 1))
    steps = rng.integers(1, alphabet, size=(n, seq_len - 1))  # +1..A-1 mod A: never the same token again
    x = (np.concatenate([first, steps], axis=1).cumsum(axis=1) % alphabet).astype(np.int64)
    # find[s, i] = 1 + the most recent j < i with x[s, j] == x[s, i], or -1
    find = np.full((n, seq_len), -1, dtype=np.int64)
    last = np.full((n, alphabet), -1, dtype=np.int64)  # last position of each token so far
    rows = np.arange(n)
    for t in range(seq_len):  # a loop over positions, vectorised over samples
        prev = last[rows, x[:, t]]
        find[:, t] = np.where(prev >= 0, prev + 1, -1)
        last[rows, x[:, t]] = t
    pos = np.broadcast_to(np.arange(seq_len), (n, seq_len)).copy()
    for _ in range(k):
        pos = np.where(pos >= 0, np.take_along_axis(find, np.maximum(pos, 0), axis=1), -1)
    y = np.where(pos >= 0, np.take_along_axis(x, np.maximum(pos, 0), axis=1), -100).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def pair_tokens(x: torch.Tensor, alphabet: int) -> torch.Tensor:
    """Token ids of the pairs (x_{i-1}, x_i): x_i + alphabet * (x_{i-1} + 1), and x_0 at i = 0."""
    prev = torch.cat([torch.full_like(x[:, :1], -1), x[:, :-1]], dim=1)
    return x + alphabet * (prev + 1)


# ---------------------------------------------------------------------- data modules
class _TrainStream(Dataset):
    """Global sample number s -> index into the training set: data epoch e = s // n reads the training set in
    the order of a permutation drawn from (seed, e); `len` is nominal, any s >= 0 is valid."""

    def __init__(self, n: int, seed: int, length: int):
        self.n, self.seed, self.length = n, seed, length
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([len(SPLITS), self.seed, epoch]).permutation(self.n)
        return self._perm

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: int) -> int:
        return int(self.permutation(s // self.n)[s % self.n])


class _Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Gather:
    """collate_fn: a list of sample indices -> (x[idx], y[idx]) (picklable, for worker processes)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __call__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(idx)
        return self.x[i], self.y[i]


class TaskDataModule(ResumableDataModule):
    """A fixed training set of `n_train` samples and validation and test sets of `n_test` samples.

    Training reads a stream of samples: pass e over the training set is a permutation drawn from (seed, e),
    and global sample s goes to rank s % world (the trainer is built with use_distributed_sampler=False).
    The stream position is derived from `trainer.global_step`, so a run resumed from a checkpoint reads the
    same batches as an uninterrupted one, through the samplers and loader of `nats.data.windows` (as
    `TokenDataModule` does). One Lightning epoch covers all of `trainer.max_steps` when set. Evaluation reads
    every sample once, in order (`StridedSampler`: with several ranks each gets the same number, so up to
    world - 1 trailing samples are left out, as for the language-model windows).

    `vocab_size` and `n_classes` may be given to check them against the task (the configs pass them on to
    the model: `model.vocab_size: ${data.vocab_size}`).
    """

    def __init__(
        self,
        n_train: int = 10000,
        n_test: int = 256,
        micro_batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        vocab_size: int | None = None,
        n_classes: int | None = None,
    ):
        super().__init__()
        if min(n_train, n_test, micro_batch_size) < 1:
            raise ValueError("n_train, n_test and micro_batch_size must be >= 1")
        self.n_train, self.n_test = int(n_train), int(n_test)
        self.micro_batch_size, self.seed, self.num_workers = int(micro_batch_size), int(seed), int(num_workers)
        for name, given in (("vocab_size", vocab_size), ("n_classes", n_classes)):
            if given is not None and int(given) != getattr(self, name):
                raise ValueError(f"data.{name}={given}, but this task has {name}={getattr(self, name)}")
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # subclasses: vocab_size, n_classes, seq_len properties and generate(n, rng)
    vocab_size: int
    n_classes: int
    seq_len: int

    def generate(self, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of a whole split ("train", "validation", "test"), generated once."""
        if name not in self._data:
            n = self.n_train if name == "train" else self.n_test
            self._data[name] = self.generate(n, _rng(self.seed, name))
        return self._data[name]

    def setup(self, stage: str | None = None) -> None:
        for name in SPLITS:
            self.split(name)

    def _one_pass_batches(self, world: int) -> int:
        return self.n_train // (self.micro_batch_size * world)

    def train_dataloader(self) -> DataLoader:
        x, y = self.split("train")
        sampler = self.resumable_sampler()
        return ResumableDataLoader(
            _TrainStream(len(x), self.seed, length=len(sampler) * sampler.world_size),
            batch_size=self.micro_batch_size,
            sampler=sampler,
            collate_fn=_Gather(x, y),
            **worker_options(self.num_workers),
        )

    def _eval_loader(self, name: str) -> DataLoader:
        x, y = self.split(name)
        return DataLoader(
            _Indices(len(x)),
            batch_size=self.micro_batch_size,
            sampler=self.strided_sampler(len(x)),
            collate_fn=_Gather(x, y),
            **worker_options(self.num_workers),
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


class Match2DataModule(TaskDataModule):
    """Match2 with sequence length `seq_len` (N = 32) and modulus `modulus` (M = 37); 2 classes."""

    def __init__(self, seq_len: int = 32, modulus: int = 37, **kwargs: Any):
        self.seq_len, self.modulus = int(seq_len), int(modulus)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.modulus

    @property
    def n_classes(self) -> int:
        return 2

    def generate(self, n, rng):
        return match2(n, self.seq_len, self.modulus, rng)

    def positive_rate(self, name: str = "train") -> float:
        return float(self.split(name)[1].float().mean())


class InductionHeadsDataModule(TaskDataModule):
    """k-hop induction heads (k = 1: the induction head) over `alphabet` tokens, length `seq_len` (N = 100);
    `pair_input` feeds (x_{i-1}, x_i) pairs as tokens. Classes: the `alphabet` tokens."""

    def __init__(self, seq_len: int = 100, alphabet: int = 4, k: int = 1, pair_input: bool = True, **kwargs: Any):
        self.seq_len, self.alphabet, self.k, self.pair_input = int(seq_len), int(alphabet), int(k), bool(pair_input)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.alphabet * (self.alphabet + 1) if self.pair_input else self.alphabet

    @property
    def n_classes(self) -> int:
        return self.alphabet

    def generate(self, n, rng):
        x, y = khop_induction(n, self.seq_len, self.alphabet, self.k, rng)
        return (pair_tokens(x, self.alphabet) if self.pair_input else x), y
