"""The fine-tuning application of NAtS on pretrained transformers models, built on the adapter `nats.hf`.

* `nats.finetune.lit` (`LitNAtSDistill`) and `nats.finetune.datamodule` (`LongContextDataModule`): fine-tune a
  pretrained model's NAtS scorers by distillation (``nats-train experiment=finetune_smollm2_nats``,
  docs/hf_finetune.md);
* `nats.finetune.evaluate`: long-context accuracy against KV budget, NAtS and the KV-cache baselines on one decode
  path (the library of ``nats-eval-hf``, whose entry point is `nats.eval_hf`; docs/hf_eval.md), with
  `nats.finetune.kvpress_methods`, NVIDIA's kvpress presses as further methods (docs/kvpress.md);
* `nats.finetune.analysis`: the tables and plots of a ``nats-eval-hf`` run and of a fine-tuning run
  (notebooks/hf_kv_budgets.ipynb).

`nats.hf` (attaching the scorers, the attention function, the caches, loading) never imports this package.
"""
