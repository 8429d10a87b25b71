"""``nats-prepare``: download and tokenise a data source into the token cache, then print its size.

    nats-prepare                                   # the embedded Gutenberg corpus
    nats-prepare data=pg19 data.path=/data/pg19    # a local PG-19 copy
    nats-prepare data=pg19 data.hf_name=emozilla/pg19
    nats-prepare data=text_dir data.path=/my/corpus

Training does the same on first use (``TokenDataModule.prepare_data``); running it ahead keeps the
tokenisation out of a (multi-GPU) job's time.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from nats.cli import hydra_script


def prepare(cfg: DictConfig) -> None:
    """Instantiate ``cfg.data``, prepare and set it up, print token counts per split."""
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup()
    print(f"token cache: {datamodule.cache_path}")
    for split, n in datamodule.token_counts.items():
        print(f"  {split:<10} {n:>14,d} tokens")
    try:
        ppl = f"{datamodule.unigram_perplexity('validation'):.2f}"
    except ValueError as err:  # a validation split shorter than one window of this block_size: not an error here
        ppl = f"not computed ({err})"
    print(f"unigram perplexity (validation, block_size={datamodule.block_size}): {ppl}")


main = hydra_script("nats-prepare", "prepare", prepare, __name__)


if __name__ == "__main__":
    main()
