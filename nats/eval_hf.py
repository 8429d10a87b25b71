"""`nats-eval-hf`: long-context accuracy against KV budget of a Hugging Face model (docs/hf_eval.md); the work is
`nats.finetune.evaluate.run`.

    nats-eval-hf scorers=logs/finetune_smollm2_nats/runs/<run>/scorers.pt
    nats-eval-hf hf_model=smollm2_135m scorers=<run>/scorers.pt methods=[full,nats,snapkv,h2o,streaming_llm] \
        budgets=[0.5,0.25,0.125]
    nats-eval-hf resume=logs/eval_hf/runs/<run>       # continue an interrupted run in its folder
"""

from __future__ import annotations

from omegaconf import DictConfig

from nats.checks import check_hf_model
from nats.cli import hydra_script
from nats.finetune.evaluate import check_inputs, run
from nats.runs import resume_argv


def _job(cfg: DictConfig) -> dict:
    check_hf_model(cfg)  # a model not on this machine: one line with the fix, before transformers' retries
    return run(cfg)


def _resume(argv: list[str], notes: list[str]) -> list[str]:
    """``resume=<run folder>`` continues that run in its folder."""
    return resume_argv(argv, None, notes, program="nats-eval-hf", checkpoint=False)


# the methods, budgets and scorers checked before Hydra makes the run folder (and again in run, before the model load)
main = hydra_script("nats-eval-hf", "eval_hf", _job, __name__, _resume, check=check_inputs)


if __name__ == "__main__":
    main()
