"""Build the long-context example files (data/hf_longctx/longctx-<hash>.jsonl) that a fine-tune or an evaluation
reads, without loading the model: the tokenizer alone, from the same configs and overrides as the run.

Build them on a machine that has the PG-19 subset and copy `data/hf_longctx/` to one that has not, e.g. a GPU
machine (docs/hf_finetune.md):

    python experiments/build_hf_examples.py finetune                         # experiment=finetune_smollm2_nats
    python experiments/build_hf_examples.py eval data.split=validation data.num_examples=16 data.seed=20241123
    python experiments/build_hf_examples.py eval data.num_examples=32         # the test examples, 32 per task

`finetune` composes train.yaml with experiment=finetune_smollm2_nats (plus overrides) and builds its training and
validation sets as `nats.finetune.datamodule.LongContextDataModule` does; `eval` composes eval_hf.yaml (plus overrides)
and builds `data` as `nats-eval-hf` does. Each prints the file and its example count; an existing file is read.
"""

from __future__ import annotations

import argparse
import logging

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from nats.utils import CONF_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["finetune", "eval"], help="whose examples: nats-train's or nats-eval-hf's")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of that run")
    args = parser.parse_args()
    from nats.data.longctx import load_or_build_examples
    from nats.hf.pretrained import load_tokenizer, pretrained_kwargs

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        if args.kind == "finetune":
            cfg = compose("train", overrides=["experiment=finetune_smollm2_nats", *args.overrides])
            dm = instantiate(cfg.data, _recursive_=False)
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            dm.prepare_data()  # logs each split's file and count
        else:
            cfg = compose("eval_hf", overrides=args.overrides)
            tokenizer = load_tokenizer(**pretrained_kwargs(cfg.hf_model))
            data = OmegaConf.to_container(cfg.data, resolve=True)
            examples, path = load_or_build_examples(tokenizer, **data)
            print(f"{path}: {len(examples)} examples")


if __name__ == "__main__":
    main()
