"""`nats-eval`: perplexity against KV-cache budget of a nats-train checkpoint (NATS_SPEC.md sections 6-8); the work
is `nats.evaluation.run`.

    nats-eval ckpt_path=logs/train/runs/<date>/checkpoints/last.ckpt
    nats-eval ckpt_path=... data=pg19 data.path=/data/pg19 device=cuda precision=bfloat16
    nats-eval ckpt_path=... methods=[full,h2o] budgets=[0.25,64] max_windows=50

The protocol and the outputs: `nats.evaluation`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from nats.cli import console, guarded
from nats.evaluation import run
from nats.utils import CONF_DIR


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    guarded("nats-eval", cfg, run)  # one line on the console for a failure (nats.cli)


def main() -> None:
    """`nats-eval`: the overrides checked (nats.cli.console), then the Hydra app."""
    console("nats-eval", "eval", _hydra_main)


if __name__ == "__main__":
    main()
