"""Long-context examples as Lightning batches, for fine-tuning the NAtS scorers of a pretrained model.

`LongContextDataModule` builds (or reads from its cache) the examples of `nats.data.longctx.load_or_build_examples`
with the model's own tokenizer, found from the same ``hf_model`` config node as the model (`load_tokenizer`).

* **Train / validation**: two sets built with different seeds (validation: ``val_seed``, default ``seed + 1``), and
  from different PG-19 splits (``train_split`` / ``val_split``), so no example is in both.
* **Batches**: ``(input_ids [B, N] int64, loss_mask [B, N] bool, sample_ids: list[int])``. ``loss_mask`` marks the
  positions whose hidden states predict the answer tokens: ``P - 1 ... N - 2`` for a prompt of ``P`` tokens and an
  answer ending at ``N - 1`` (the positions a language-model loss on the answer would use). ``sample_ids`` are the
  global sample numbers (a plain list, so Lightning leaves them on the host): the module seeds its Gumbel noise
  with them (exact resume).
* **Micro-batch**: NAtS runs on unpadded sequences only, so ``micro_batch_size`` is 1 unless every example (train
  and validation) has the same length (e.g. ``tasks=[pg19_continuation]`` with ``min_length == max_length``); any
  other setting is refused at ``setup`` with what to change. Larger global batches are gradient accumulation.
* **Sampling**: training sample ``s`` (a global counter over the run) is example ``perm_e[s % n]``, ``e = s // n``,
  with ``perm_e`` a permutation drawn from ``(seed, e)``: every epoch visits every example once, in an order that
  is a function of the seed alone. Rank ``r`` of ``W`` reads ``s = start + r, start + r + W, ...`` with ``start`` the
  samples already consumed (``global_step x accumulation x micro_batch x W``), so a resumed run reads exactly what
  the uninterrupted one would have (no state to save). Validation: rank ``r`` takes examples ``r, r + W, ...``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nats.data.datamodule import ResumableDataModule
from nats.data.longctx import TASKS, LongContextExample, load_or_build_examples
from nats.data.windows import ResumableDataLoader, worker_options
from nats.hf.pretrained import load_tokenizer, pretrained_kwargs

log = logging.getLogger(__name__)

__all__ = ["LongContextDataModule", "answer_mask", "collate"]


def answer_mask(example: LongContextExample) -> torch.Tensor:
    """``[N]`` bool: True at the positions whose hidden states predict the answer tokens (``P - 1 ... N - 2``)."""
    n, p = len(example), len(example.prompt_ids)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[p - 1 : n - 1] = True
    return mask


class _Examples(Dataset):
    """Item ``k``: ``(input_ids [N], loss_mask [N], k)``."""

    def __init__(self, examples: Sequence[LongContextExample]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def item(self, index: int, sample: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        ex = self.examples[index]
        return torch.tensor(ex.input_ids, dtype=torch.long), answer_mask(ex), sample

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.item(k, k)


class _TrainSamples(_Examples):
    """Item ``s`` (any sample number >= 0): the example ``perm_e[s % n]``, ``e = s // n``, ``perm_e`` drawn from
    ``(seed, e)``. ``len`` is nominal."""

    def __init__(self, examples: Sequence[LongContextExample], seed: int, length: int) -> None:
        super().__init__(examples)
        self.seed, self.length = seed, length
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def index(self, s: int) -> int:
        n = len(self.examples)
        epoch = s // n
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return int(self._perm[1][s % n])

    def __getitem__(self, s: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.item(self.index(s), s)


def collate(items: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Stack examples of one length (NAtS takes no padding): ``(input_ids, loss_mask, sample_ids)``."""
    lengths = {len(x) for x, _, _ in items}
    if len(lengths) > 1:
        raise ValueError(
            f"a batch of examples of different lengths {sorted(lengths)}: NAtS runs over unpadded sequences only; "
            "set data.micro_batch_size=1 (the global batch is reached by gradient accumulation)"
        )
    return torch.stack([x for x, _, _ in items]), torch.stack([m for _, m, _ in items]), [s for _, _, s in items]


class LongContextDataModule(ResumableDataModule):
    """Training and validation examples of `nats.data.longctx` for NAtS distillation (module docstring).

    Args:
        hf_model: the ``hf_model`` config node (conf/hf_model/*.yaml): the tokenizer comes from its
            ``name_or_path`` / ``gguf_file``; ``max_context`` (if set) bounds ``max_length``.
        tasks: `nats.data.longctx.TASKS` to draw from (``pg19_continuation`` needs ``pg19_path``).
        num_examples / num_val_examples: examples per task, training / validation.
        max_length / min_length: example lengths (prompt + answer), drawn in ``[min_length or max_length // 2,
            max_length]``.
        seed / val_seed: the example seeds (``val_seed`` None: ``seed + 1``) and, ``seed``, the training order.
        pg19_path, train_split, val_split, max_books, answer_tokens: as in `load_or_build_examples` (``None``
            path: no PG-19; the splits are read from ``pg19_path`` for the training / validation examples).
        cache_dir: where the example files are cached (``nats.data.longctx.cache_path``).
        micro_batch_size: examples per batch; > 1 only when all examples have one length (NAtS takes no padding).
        num_workers: DataLoader workers.
        tokenizer: a tokenizer object to use instead of loading the model's (tests, notebooks).
    """

    def __init__(
        self,
        hf_model: Mapping[str, Any],
        tasks: Sequence[str] = TASKS,
        num_examples: int = 64,
        num_val_examples: int = 8,
        max_length: int = 4096,
        min_length: int | None = None,
        seed: int = 0,
        val_seed: int | None = None,
        pg19_path: str | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        max_books: int = 32,
        answer_tokens: int = 64,
        cache_dir: str = "data/hf_longctx",
        micro_batch_size: int = 1,
        num_workers: int = 0,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        for name, value in [
            ("num_examples", num_examples),
            ("num_val_examples", num_val_examples),
            ("max_length", max_length),
            ("micro_batch_size", micro_batch_size),
        ]:
            if int(value) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        self.hf_model = dict(hf_model)
        max_context = self.hf_model.get("max_context")
        if max_context and max_length > max_context:
            raise ValueError(
                f"data.max_length={max_length} is longer than the model's context hf_model.max_context="
                f"{max_context}: set data.max_length <= {max_context}"
            )
        self.tasks = list(tasks)
        if "pg19_continuation" in self.tasks and pg19_path is None:
            raise ValueError(
                "the task pg19_continuation needs data.pg19_path (the PG-19 subset); set it, or drop the task: "
                "data.tasks=[passkey,niah,variable_tracking]"
            )
        # read only when the examples are built (nats.data.longctx.tasks._read_pg19 says what is missing): a cached
        # example file needs no PG-19 copy (e.g. examples built on one machine and copied to another)
        self.pg19_path = pg19_path
        self.num_examples, self.num_val_examples = int(num_examples), int(num_val_examples)
        self.max_length, self.min_length = int(max_length), min_length
        self.seed = int(seed)
        self.val_seed = self.seed + 1 if val_seed is None else int(val_seed)
        self.train_split, self.val_split = train_split, val_split
        self.max_books, self.answer_tokens = int(max_books), int(answer_tokens)
        self.cache_dir = cache_dir
        self.micro_batch_size = int(micro_batch_size)
        self.num_workers = int(num_workers)
        self._tokenizer = tokenizer
        self.examples: dict[str, list[LongContextExample]] = {}

    # -- examples --------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(**pretrained_kwargs(self.hf_model))
        return self._tokenizer

    def _load(self, split: str) -> list[LongContextExample]:
        train = split == "train"
        examples, path = load_or_build_examples(
            self.tokenizer,
            cache_dir=self.cache_dir,
            tasks=self.tasks,
            num_examples=self.num_examples if train else self.num_val_examples,
            max_length=self.max_length,
            min_length=self.min_length,
            seed=self.seed if train else self.val_seed,
            pg19_path=self.pg19_path,
            split=self.train_split if train else self.val_split,
            max_books=self.max_books,
            answer_tokens=self.answer_tokens,
        )
        log.info(f"{split}: {len(examples)} long-context examples ({path})")
        return examples

    def prepare_data(self) -> None:
        """Build the example files once (Lightning calls this on one process per node)."""
        for split in ("train", "validation"):
            self._load(split)

    def setup(self, stage: str | None = None) -> None:
        for split in ("train", "validation"):
            if split not in self.examples:
                self.examples[split] = self._load(split)
        if self.micro_batch_size > 1:
            lengths = sorted({len(ex) for split in self.examples.values() for ex in split})
            if len(lengths) > 1:
                raise ValueError(
                    f"data.micro_batch_size={self.micro_batch_size} needs examples of one length (NAtS takes no "
                    f"padding), but they have {len(lengths)} lengths in [{lengths[0]}, {lengths[-1]}]: set "
                    "data.micro_batch_size=1 (global_batch_size is reached by gradient accumulation)"
                )

    # -- loaders ---------------------------------------------------------------------------------------------
    def _one_pass_batches(self, world: int) -> int:
        """Every training example once (the last micro-batch of the pass may wrap into the next)."""
        return -(-len(self.examples["train"]) // (self.micro_batch_size * world))

    def _loader(self, dataset: Dataset, sampler, cls: type = DataLoader) -> DataLoader:
        return cls(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            collate_fn=collate,
            pin_memory=torch.cuda.is_available(),
            **worker_options(self.num_workers),
        )

    def train_dataloader(self) -> DataLoader:
        if "train" not in self.examples:
            self.setup("fit")
        sampler = self.resumable_sampler()
        dataset = _TrainSamples(self.examples["train"], self.seed, length=len(sampler) * sampler.world_size)
        return self._loader(dataset, sampler, cls=ResumableDataLoader)

    def val_dataloader(self) -> DataLoader:
        if "validation" not in self.examples:
            self.setup("validate")
        dataset = _Examples(self.examples["validation"])
        return self._loader(dataset, self.strided_sampler(len(dataset)))
