"""From text to batches: :class:`TokenDataModule`, on :class:`ResumableDataModule`.

The token file format is :mod:`nats.data.token_file`, the cache of tokenised sources :mod:`nats.data.token_cache`,
the windows, samplers and loader (with the layout of a batch and the rule of exact resumption)
:mod:`nats.data.windows`. :class:`ResumableDataModule` is the training stream that resumes exactly, shared with the
task and long-context datamodules.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nats.data.sources import SPLITS, get_source
from nats.data.token_cache import _CACHE_NAME, cache_folder, prepare_token_cache
from nats.data.token_file import _TokenFile
from nats.data.tokenizer import EOT, get_tokenizer
from nats.data.windows import (
    EvalWindows,
    ResumableDataLoader,
    ResumableSampler,
    StridedSampler,
    TrainWindows,
    check_eval_windows,
    worker_options,
)

__all__ = ["ResumableDataModule", "TokenDataModule"]


def _check_not_empty(file: _TokenFile, split: str) -> None:
    """Raise ``ValueError`` when the documents of a split were all empty (the file holds only the end-of-text
    separators that follow each document), naming the split and the fix. Checked on files of < 1M tokens only
    (an empty split is small; a large one is not read for this)."""
    if file.num_tokens >= 1 << 20 or not file.num_tokens:
        return
    tokens = np.asarray(file.tokens)
    if (tokens == EOT).all():
        raise ValueError(
            f"the {split} split is empty: its {file.num_tokens} document(s) hold no text ({file.path} has only their "
            f"end-of-text separators). Put text into the source's {split} files (or point the data config at "
            f"another corpus), then delete the token cache {file.path.parent} so that it is tokenised again"
        )


class ResumableDataModule(L.LightningDataModule):
    """The training stream of a datamodule that resumes exactly: global sample ``s`` goes to rank ``s % world``,
    and the stream starts at the samples already consumed (`consumed_samples`, from ``trainer.global_step``), so
    a run resumed from a checkpoint reads what the uninterrupted one would have, with no loader state to save
    (`ResumableSampler`, `ResumableDataLoader`). Evaluation reads every item once (`StridedSampler`).

    Subclasses set ``micro_batch_size`` and give `_one_pass_batches`; `TokenDataModule`,
    `nats.data.tasks.TaskDataModule` and `nats.finetune.datamodule.LongContextDataModule` are written on it.
    """

    micro_batch_size: int

    def _rank_world(self) -> tuple[int, int]:
        t = getattr(self, "trainer", None)
        return (int(t.global_rank), int(t.world_size)) if t is not None else (0, 1)

    def _accumulation(self) -> int:
        t = getattr(self, "trainer", None)
        return int(getattr(t, "accumulate_grad_batches", 1)) if t is not None else 1

    def consumed_samples(self) -> int:
        """Training samples already consumed by all ranks: ``global_step * accumulate * micro_batch * world``
        when attached to a trainer, else 0."""
        t = getattr(self, "trainer", None)
        if t is None:
            return 0
        return int(t.global_step) * self._accumulation() * self.micro_batch_size * int(t.world_size)

    def _one_pass_batches(self, world: int) -> int:  # pragma: no cover - each subclass gives its own
        """Micro-batches per rank of about one pass over the training data (before whole optimizer steps)."""
        raise NotImplementedError

    def _train_samples_per_rank(self) -> int:
        """Nominal samples per rank per epoch: all of ``trainer.max_steps`` when set, else about one pass over the
        training data (`_one_pass_batches`); a whole number of optimizer steps either way."""
        t = getattr(self, "trainer", None)
        _, world = self._rank_world()
        accum = self._accumulation()
        max_steps = getattr(t, "max_steps", None) if t is not None else None
        if max_steps is not None and max_steps > 0:
            batches = int(max_steps) * accum
        else:
            batches = max(1, self._one_pass_batches(world))
            batches = math.ceil(batches / accum) * accum
        return batches * self.micro_batch_size

    def resumable_sampler(self) -> ResumableSampler:
        """This rank's sampler of the training stream (`_train_samples_per_rank` samples from the consumed ones)."""
        rank, world = self._rank_world()
        return ResumableSampler(self._train_samples_per_rank(), rank, world, start=self.consumed_samples)

    def strided_sampler(self, length: int) -> StridedSampler:
        """This rank's share of ``length`` evaluation items."""
        rank, world = self._rank_world()
        return StridedSampler(length, rank, world)


# --------------------------------------------------------------------------------------------------------------
# the datamodule
# --------------------------------------------------------------------------------------------------------------


class TokenDataModule(ResumableDataModule):
    """Language-modelling batches from a tokenised text source.

    Args:
        source: registered source name (``gutenberg``, ``pg19``, ``text_dir``).
        cache_dir: folder of the token caches and raw downloads.
        block_size: tokens per training/eval sequence ``N``; windows hold ``N + 1`` tokens.
        micro_batch_size: sequences per training batch (per process).
        eval_batch_size: sequences per validation/test batch (default: ``micro_batch_size``).
        num_workers: DataLoader workers.
        seed: seed of the training-window stream.
        tokenizer: tokenizer name (see :func:`nats.data.tokenizer.get_tokenizer`).
        max_eval_windows: cap on the number of validation/test windows (quick runs); ``None`` = all.
        eval_windows: which windows the cap takes: ``"spread"`` evenly over the split, or its ``"first"`` ones
            (`EvalWindows`).
        cache_name: prefix of the token cache folder's name (default: the source name), e.g. ``pg19-subset``.
        cache_path: an explicit token cache folder (written by ``nats-prepare``, perhaps on another machine) to
            train from; it must be complete, nothing is tokenised. Default: ``<cache_dir>/<name>-<hash>-<tok>``,
            found from the configuration alone, so copying that folder is enough too.
        **source_options: passed to the source, e.g. ``path``, ``hf_name``, ``text_field``, ``sdist_path``.

    Without the raw data (e.g. on a GPU node that received only the cache folder), a complete cache is used as it
    is; with it, the cache is checked against it (a mismatch is an error that says to delete and re-prepare).
    """

    def __init__(
        self,
        source: str,
        cache_dir: str,
        block_size: int = 1024,
        micro_batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
        tokenizer: str = "gpt2",
        max_eval_windows: int | None = None,
        eval_windows: str = "spread",
        cache_name: str | None = None,
        cache_path: str | None = None,
        **source_options: Any,
    ) -> None:
        super().__init__()
        for name, value in [("block_size", block_size), ("micro_batch_size", micro_batch_size)]:
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1 or None, got {eval_batch_size}")
        if max_eval_windows is not None and max_eval_windows < 1:
            raise ValueError(f"max_eval_windows must be >= 1 or None, got {max_eval_windows}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        get_tokenizer(tokenizer)  # unknown names fail here
        self.save_hyperparameters()
        self.source_name = source
        self.cache_dir = Path(cache_dir)
        self.block_size = int(block_size)
        self.micro_batch_size = int(micro_batch_size)
        self.eval_batch_size = int(eval_batch_size or micro_batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.max_eval_windows = max_eval_windows
        self.eval_windows = check_eval_windows(eval_windows)
        self.text_source = get_source(source, cache_dir=self.cache_dir, **source_options)
        self.source_options = {k: v for k, v in source_options.items() if v is not None}
        if getattr(self.text_source, "path", None) is not None:  # recorded in meta.json: where the data was
            self.source_options["path"] = str(self.text_source.path)
        if cache_name is not None and not _CACHE_NAME.fullmatch(cache_name):
            raise ValueError(f"cache_name {cache_name!r} must be letters, digits, '.', '_' or '-' (a folder name)")
        self.cache_name = cache_name
        self._explicit_cache = Path(cache_path).expanduser() if cache_path is not None else None
        self._folder: Path | None = self._explicit_cache
        self._files: dict[str, _TokenFile] = {}
        self._unigram_logp: np.ndarray | None = None
        self._prepared = False

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary (50257 for GPT-2)."""
        return get_tokenizer(self.tokenizer).n_vocab

    @property
    def eot(self) -> int:
        """Id of the end-of-text token that separates documents (50256 for GPT-2)."""
        return get_tokenizer(self.tokenizer).eot_token

    @property
    def cache_path(self) -> Path:
        """The cache folder of this source and tokenizer."""
        if self._folder is None:
            self._folder = cache_folder(self.cache_dir, self.text_source, self.tokenizer, self.cache_name)
        return self._folder

    @property
    def token_counts(self) -> dict[str, int]:
        """Tokens per split (after :meth:`setup`)."""
        return {split: f.num_tokens for split, f in self._files.items()}

    # -- Lightning hooks -------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download and tokenise (once; Lightning calls this on one process per node, at every fit and validate:
        the cache is found and checked once per process)."""
        if self._prepared:
            return
        self._folder = prepare_token_cache(
            self.text_source, self.cache_dir, self.tokenizer, name=self.cache_name, folder=self._explicit_cache,
            options=self.source_options,
        )  # fmt: skip
        self._prepared = True

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the three splits (validates their headers); attached to a trainer, check that the model's
        vocabulary holds the data's (:meth:`check_vocab`)."""
        for split in SPLITS:
            path = self.cache_path / f"{split}.bin"
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} does not exist: run `nats-prepare data={self.source_name}` (or call prepare_data()) first"
                )
            if split not in self._files:
                self._files[split] = _TokenFile(path, self.tokenizer)
                _check_not_empty(self._files[split], split)
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        model_vocab = getattr(getattr(module, "config", None), "vocab_size", None)  # LitGPT.config: GPTConfig
        if isinstance(model_vocab, int):
            self.check_vocab(model_vocab)

    def check_vocab(self, model_vocab_size: int, fix: str | None = None) -> None:
        """Raise ``ValueError`` (naming the cache and the fix) if a model with ``model_vocab_size`` embeddings
        cannot read every token id of the cache (ids < the vocabulary size in its headers). ``fix`` replaces the
        default advice (set model.vocab_size), e.g. for a trained checkpoint."""
        for split in SPLITS:
            data_vocab = self._file(split).vocab_size
            if model_vocab_size < data_vocab:
                padded = math.ceil(data_vocab / 64) * 64
                raise ValueError(
                    f"model.vocab_size={model_vocab_size} is smaller than the vocabulary of the token cache "
                    f"{self.cache_path} ({data_vocab} ids, tokenizer {self.tokenizer!r}): the model has no "
                    f"embedding for ids >= {model_vocab_size}. "
                    + (
                        fix
                        or f"Set model.vocab_size={padded} (>= {data_vocab}, padded to a multiple of 64), or "
                        "train on data of a smaller vocabulary"
                    )
                )

    def _file(self, split: str) -> _TokenFile:
        if split not in self._files:
            self.setup()
        return self._files[split]

    def _one_pass_batches(self, world: int) -> int:
        return self._file("train").num_tokens // (self.block_size * self.micro_batch_size * world)

    def _loader(self, dataset: Dataset, sampler: Sampler[int], batch_size: int, cls: type = DataLoader) -> DataLoader:
        return cls(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=False,
            pin_memory=torch.cuda.is_available(),
            **worker_options(self.num_workers),
        )

    def train_dataloader(self) -> DataLoader:
        sampler = self.resumable_sampler()
        length = len(sampler) * sampler.world_size
        dataset = TrainWindows(self._file("train"), self.block_size, self.seed, length=length)
        return self._loader(dataset, sampler, self.micro_batch_size, cls=ResumableDataLoader)

    def eval_dataset(self, split: str = "validation") -> EvalWindows:
        """The windows of a held-out split (capped by ``max_eval_windows``)."""
        if split not in ("validation", "test"):
            raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
        return EvalWindows(self._file(split), self.block_size, self.max_eval_windows, self.eval_windows)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.eval_dataset(split)
        return self._loader(dataset, self.strided_sampler(len(dataset)), self.eval_batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    # -- baseline --------------------------------------------------------------------------------------------
    def unigram_perplexity(self, split: str = "validation") -> float:
        """Perplexity of ``split`` under a unigram model fitted on train (add-one smoothing over the vocabulary),
        over the tokens the validation/test loaders predict (same windows, same cap, all ranks together)."""
        if self._unigram_logp is None:
            counts = np.ones(self.vocab_size, dtype=np.float64)  # add-one
            train = self._file("train").tokens
            for i in range(0, len(train), 1 << 24):  # chunks of 16M tokens: bounded memory for PG-19
                chunk = self._file("train").check(train[i : i + (1 << 24)], i)
                counts += np.bincount(chunk, minlength=self.vocab_size)
            self._unigram_logp = np.log(counts / counts.sum())
        dataset = self.eval_dataset(split)
        _, world = self._rank_world()
        targets = dataset.targets(len(dataset) - len(dataset) % world)
        return float(np.exp(-self._unigram_logp[targets].mean()))
