"""torch's clip_grad_norm_ handed a pipeline rank's parameters is refused by name.

A pipeline rank holds only its stages, so `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` there clips
by the stage's norm: each stage is scaled by its own factor and the run trains to other weights than one
process, with no error (the line is in almost every LLM loop). Multi-rank pipelines mark their stages'
parameters (an attribute on each parameter, so the mark lives and dies with it); from the first mark on,
torch's function (`torch.nn.utils.clip_grad_norm_` and `torch.nn.utils.clip_grad.clip_grad_norm_`) raises a
ParatrainError pointing at `run.clip_grad_norm_` when given one of them, and is torch's own, unchanged, for any
other parameters. A name bound before `prepare` (`from torch.nn.utils import clip_grad_norm_` at the top of a
script) keeps torch's function and is not seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...errors import ParatrainError

_ORIGINAL = torch.nn.utils.clip_grad.clip_grad_norm_
_MARK = "_paratrain_pipeline_rank"


def register(parameters: Iterable[torch.Tensor], pp_rank: int) -> None:
    """Mark these as one pipeline rank's parameters, and put the guard in front of torch's function."""
    for p in parameters:
        setattr(p, _MARK, pp_rank)
    torch.nn.utils.clip_grad_norm_ = _guarded
    torch.nn.utils.clip_grad.clip_grad_norm_ = _guarded


def stage_rank(p: torch.Tensor) -> int | None:
    """The pipeline rank holding `p`, if it is a stage parameter."""
    return getattr(p, _MARK, None)


def _guarded(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, *args: Any, **kwargs: Any) -> Any:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    ranks = {r for r in map(stage_rank, params) if r is not None}
    if ranks:
        raise ParatrainError(
            f"torch.nn.utils.clip_grad_norm_ was given the parameters of pipeline rank {min(ranks)}'s stages: it "
            "would clip them by that rank's norm alone, each stage by its own factor, and the run would train to "
            "other weights than one process. Call run.clip_grad_norm_(model, max_norm) instead: the whole model's "
            "norm under every layout (docs/usage.md, Gradient clipping)")
    return _ORIGINAL(params, max_norm, *args, **kwargs)
