"""Checks of pipeline options against the job's shape (stages, workers), shared by every pipeline strategy.

Values on their own (a positive micro-batch count, a known schedule) are checked once in
`paratrain.config.validate`; what needs the number of stages is checked here, before any process waits.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..errors import ParatrainError
from .pipeline import schedules


def check_balance_entries(balance: Any, stages: int, where: str) -> None:
    """An explicit balance gives one layer count per stage."""
    if not isinstance(balance, str) and balance and all(isinstance(b, str) for b in balance):
        if len(balance) + 1 != stages:
            raise ParatrainError(
                f"{where}: split_points {list(balance)} cut the model into {len(balance) + 1} stages but there are "
                f"{stages}; give {stages - 1} name(s), one before each stage after the first")
        return
    if not isinstance(balance, str) and len(balance) != stages:
        raise ParatrainError(
            f"{where}: balance {list(balance)} has {len(balance)} entries but there are {stages} stages; "
            f"give one layer count per stage, or balance='time'"
        )


def example_needed(where: str, why: str) -> ParatrainError:
    """The error for a split that needs an example batch which `prepare` was not given."""
    return ParatrainError(
        f"{where}: {why}, which needs an example batch: call run.prepare(model, optimizer, example=inputs) "
        "with one batch of model inputs as the loader yields them (e.g. the first batch's inputs)"
    )


def check_pipeline(cfg: Config, pp: int, where: str) -> None:
    """What every multi-process pipeline (pp, ddp+pp) needs from the options, given `pp` pipeline ranks."""
    schedules.check(cfg.schedule, pp, cfg.stages_per_worker, cfg.microbatches, cfg.activation_checkpointing,
                    cfg.compiling)
    check_balance_entries(cfg.balance, pp * cfg.stages_per_worker, where)
    if cfg.precision == "16":
        raise ParatrainError(
            f"{where}: precision='16' needs a GradScaler on the loss, which the pipeline schedule computes "
            "and differentiates itself; use precision='bf16' (no scaler needed) or '32'"
        )
