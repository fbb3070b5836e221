"""`burstrl eval` of SWE tasks: kept for its public names; the runner is `burstrl.eval.run`,
which evaluates any environment (`EvalSpec.env`, "swe" by default, with `tasks` a task file and
the environment's options in `EvalSpec.options.swe`)."""

from __future__ import annotations

from burstrl.eval.run import (
    INFRA_RETRIES,
    EvalSpec,
    checkpoint_adapters,
    evaluate,
    evaluate_version,
    load_eval_tasks,
    run_eval,
)

__all__ = ["INFRA_RETRIES", "EvalSpec", "checkpoint_adapters", "evaluate", "evaluate_version", "load_eval_tasks",
           "run_eval"]
