"""`comm_hook="auto"`: DDP's exact communication settings chosen by measuring them on the example batch.

Where gradients dominate a step (many parameters for little compute), how DDP sends them decides the
speedup, and the best choice depends on the machine: on GPUs overlapping small buckets with backward
wins; on CPU workers the all-reduce's threads share the cores with the backward they would overlap,
so one bucket sent after backward can win. Every candidate here gives the same gradients as plain DDP
(no compression: the lossy hooks "bf16", "fp16" and "powersgd" are only used when asked for by name):

    default          torch's 25 MiB buckets, gradients copied into them
    views            the same buckets, gradients being views into them (one copy less per step)
    one-bucket       views, and one bucket for all gradients: sent once, after the whole backward
    small-buckets    views, 4 MiB buckets: more overlap with backward

Each candidate wraps the model in its own DDP, runs warm-up and timed trial steps (forward on the
example, a sum of the outputs as the loss, backward) that leave no trace, and is destroyed before the
next (its reducer's hooks go with it). All ranks agree on the slowest rank's time, so all choose the same.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...collectives import max_over_world
from ...config import Config
from ...errors import ParatrainError
from ..trial import no_trace, step_time


@dataclass
class Choice:
    """What `comm_hook="auto"` measured and chose (`model.ddp_tuning` after `run.prepare`)."""

    best: str
    options: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    """Candidate -> trial step time (the slowest rank's, fastest of the repeats)."""

    def describe(self) -> str:
        return (f"comm_hook auto -> {self.best} {self.options or '(torch defaults)'} (trial steps: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items()) + ")")


def candidates(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The exact settings worth trying for this model's gradient size."""
    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return {
        "default": {},
        "views": {"gradient_as_bucket_view": True},
        "one-bucket": {"gradient_as_bucket_view": True, "bucket_cap_mb": grad_mb + 1.0},
        "small-buckets": {"gradient_as_bucket_view": True, "bucket_cap_mb": 4.0},
    }


def _trial_loss(out: Any) -> torch.Tensor:
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise ParatrainError("comm_hook='auto' times trial steps on the model's outputs, but they hold no floating "
                             "tensor; pass comm_hook=None with bucket_cap_mb/gradient_as_bucket_view set by hand")
    return sum(x.float().sum() for x in leaves)  # type: ignore[return-value]


def choose(model: nn.Module, cfg: Config, example: Any, device: torch.device, wrap: Any,
           repeats: int = 3) -> tuple[nn.Module, Choice]:
    """The model wrapped in DDP with the fastest exact settings; `wrap(model, cfg)` builds one DDP."""
    seconds: dict[str, float] = {}
    options = candidates(model)
    with no_trace([model]):
        for name, opts in options.items():
            trial = wrap(model, replace(cfg, comm_hook=None, **opts))

            def step(trial: nn.Module = trial) -> None:
                _trial_loss(trial(example)).backward()
                for p in model.parameters():
                    p.grad = None

            seconds[name] = max_over_world(step_time(step, repeats=repeats, warmup=1, devices=[device]), device)
            del trial, step
            gc.collect()  # the reducer's autograd hooks go with it, before the next candidate's trial
    best = min(seconds, key=seconds.__getitem__)
    chosen = Choice(best=best, options=options[best], seconds=seconds)
    return wrap(model, replace(cfg, comm_hook=None, **options[best])), chosen
