"""Windows of a token file as datasets, their samplers over the ranks, and the loader Lightning resumes.

Batches
    ``(x, y)``: two int64 tensors of shape ``[B, block_size]``, ``y`` is ``x`` shifted left by one token.

    * train: windows of ``block_size + 1`` tokens at random offsets. Sample number ``s`` (a global counter over
      the whole run) has offset ``default_rng([seed, s]).integers(0, n - block_size)``, so the stream is a pure
      function of ``(seed, s)``: rank ``r`` of ``W`` reads ``s = start + r, start + r + W, ...`` with
      ``start = global_step * accumulate_grad_batches * micro_batch_size * W`` (the samples already consumed),
      which makes resumption from a checkpoint exact and independent of the number of dataloader workers.
    * validation / test: the consecutive windows ``tokens[k*N : k*N + N + 1]``, ``N = block_size``, in order;
      window ``k`` predicts tokens ``k*N + 1 ... k*N + N``, so every token after the first is predicted exactly
      once. Rank ``r`` takes windows ``r, r + W, ...`` (the count is cut to a multiple of ``W`` so that all ranks
      run the same number of batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nats.data.token_file import _TokenFile

__all__ = [
    "TrainWindows",
    "ResumableSampler",
    "EvalWindows",
    "StridedSampler",
    "ResumableDataLoader",
]


def _too_short(file: _TokenFile, block_size: int) -> ValueError:
    return ValueError(
        f"{file.path} holds {file.num_tokens} tokens, fewer than block_size + 1 = {block_size + 1} (one window; "
        "block_size is the model's context, model.block_size): use a model with a shorter context, or more data"
    )


def _xy(window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(window.astype(np.int64))  # [N + 1]
    return t[:-1], t[1:]  # x, y: [N] each


class TrainWindows(Dataset):
    """Random training windows: item ``s`` is the window of ``block_size + 1`` tokens at a pseudo-random offset
    that depends on ``(seed, s)`` only. ``len`` is nominal: any non-negative ``s`` is valid."""

    def __init__(self, file: _TokenFile, block_size: int, seed: int, length: int) -> None:
        if file.num_tokens < block_size + 1:
            raise _too_short(file, block_size)
        self.file, self.block_size, self.seed, self.length = file, block_size, seed, length

    def offset(self, s: int) -> int:
        """Start of window ``s``: uniform over the ``n - block_size`` offsets where a full window fits."""
        return int(np.random.default_rng([self.seed, s]).integers(0, self.file.num_tokens - self.block_size))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _xy(self.file.window(self.offset(s), self.block_size + 1))


class ResumableSampler(Sampler[int]):
    """Yields the global sample numbers of one rank: ``start + rank, start + rank + world_size, ...``.

    ``start`` may be a callable, evaluated at each ``iter()`` (each epoch, each resumption), so that the stream
    continues where the consumed-sample counter stands. ``len`` (``num_samples`` per rank) is fixed.
    """

    def __init__(
        self, num_samples: int, rank: int = 0, world_size: int = 1, start: int | Callable[[], int] = 0
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.num_samples, self.rank, self.world_size, self.start = num_samples, rank, world_size, start

    def __iter__(self) -> Iterator[int]:
        start = self.start() if callable(self.start) else self.start
        first = start + self.rank
        return iter(range(first, first + self.num_samples * self.world_size, self.world_size))

    def __len__(self) -> int:
        return self.num_samples


EVAL_WINDOWS = ("spread", "first")  # which windows a cap of max_windows takes (EvalWindows)


def check_eval_windows(value: str, key: str = "eval_windows") -> str:
    if value not in EVAL_WINDOWS:
        raise ValueError(
            f"{key}={value!r} is not a window choice: use spread (max_windows windows spread evenly over the split) "
            "or first (the split's first max_windows windows)"
        )
    return value


class EvalWindows(Dataset):
    """Validation/test windows: ``tokens[k*N : k*N + N + 1]`` with ``N = block_size``, for every ``k`` of the split
    in order, or, capped at ``max_windows`` below the split's count ``n``, ``m = max_windows`` of them:

    * ``windows="spread"`` (default): spread evenly over the whole split (``k_i = floor(i * n / m)``,
      deterministic): a quick evaluation then samples every part of the split (all its books, in proportion to
      their length), not its first few books;
    * ``windows="first"``: ``k = 0 .. m - 1``, the split's first books (the protocol of results computed before
      the evenly spread choice existed; the studies keep it so that their tables stay comparable)."""

    def __init__(self, file: _TokenFile, block_size: int, max_windows: int | None = None, windows: str = "spread"):
        if file.num_tokens < block_size + 1:
            raise _too_short(file, block_size)
        self.file, self.block_size = file, block_size
        n = (file.num_tokens - 1) // block_size
        self.num_windows = n if max_windows is None else min(n, max_windows)
        self.starts: np.ndarray | None = None  # window numbers k when capped and spread; None = k = 0, 1, ...
        if self.num_windows < n and check_eval_windows(windows, "windows") == "spread":
            self.starts = (np.arange(self.num_windows, dtype=np.int64) * n) // self.num_windows

    def window_index(self, i: int) -> int:
        """The window number ``k`` of item ``i`` (``tokens[k*N : k*N + N + 1]``)."""
        return i if self.starts is None else int(self.starts[i])

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        return _xy(self.file.window(self.window_index(i) * self.block_size, self.block_size + 1))

    def targets(self, num_windows: int | None = None) -> np.ndarray:
        """The predicted tokens of the first ``num_windows`` items (all by default), in order."""
        n = self.num_windows if num_windows is None else num_windows
        if self.starts is None:
            return self.file.window(1, n * self.block_size)
        offsets = (self.starts[:n, None] * self.block_size + np.arange(1, self.block_size + 1)).ravel()
        return self.file.check(self.file.tokens[offsets], 0)


class StridedSampler(Sampler[int]):
    """Indices ``rank, rank + world_size, ...`` below ``length`` cut to a multiple of ``world_size``: every rank
    gets the same number of windows, none twice (at most ``world_size - 1`` trailing windows are dropped)."""

    def __init__(self, length: int, rank: int = 0, world_size: int = 1) -> None:
        self.used = length - length % world_size
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.used, self.world_size))

    def __len__(self) -> int:
        return self.used // self.world_size


def worker_context(num_workers: int):
    """The multiprocessing start method for a DataLoader's worker processes: None (the process' default) unless
    that default is not one of the platform's own methods, as inside a job of Hydra's joblib launcher, whose
    loky workers make loky's start method the default and cannot start a DataLoader's workers with it; then the
    platform's default method."""
    if num_workers == 0:
        return None
    import multiprocessing as mp  # noqa: PLC0415

    own = mp.get_all_start_methods()
    method = mp.get_start_method(allow_none=True)
    return None if method is None or method in own else own[0]


def worker_options(num_workers: int) -> dict[str, Any]:
    """A DataLoader's worker settings, the same for every loader of the project: ``num_workers`` processes, kept
    across epochs, started by `worker_context`'s method."""
    return {
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
        "multiprocessing_context": worker_context(num_workers),
    }


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as resumable (``state_dict``/``load_state_dict``): its position is derived
    from ``trainer.global_step`` by :class:`ResumableSampler`, so there is no state to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
