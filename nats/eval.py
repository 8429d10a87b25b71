"""`nats-eval`: perplexity against KV-cache budget of a nats-train checkpoint (NATS_SPEC.md sections 6-8); the work
is `nats.evaluation.run`.

    nats-eval ckpt_path=logs/train/runs/<date>/checkpoints/last.ckpt
    nats-eval ckpt_path=... data=pg19 data.path=/data/pg19 device=cuda precision=bfloat16
    nats-eval ckpt_path=... methods=[full,h2o] budgets=[0.25,64] max_windows=50

The protocol and the outputs: `nats.evaluation`.
"""

from __future__ import annotations

from nats.cli import hydra_script
from nats.evaluation import run

main = hydra_script("nats-eval", "eval", run, __name__)


if __name__ == "__main__":
    main()
