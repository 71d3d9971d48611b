"""What a model-parallel strategy decided and measured, kept on the prepared model as `model.plan`.

Users and benchmarks read the balance, the micro-batch curve and the memory report from here instead
of parsing logs; rank 0 also prints each decision once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .microbatch import Search
from .pipeline.balance import LayerCost
from .pipeline.memory import StageMemory


@dataclass
class Plan:
    strategy: str
    stages: int
    microbatches: int | str | None
    """The count, "auto" until measured, None until the first step chooses the default (`ScheduleRow.fewest`)."""
    schedule: str | None = None
    balance: list[int] | None = None
    layer_costs: list[LayerCost] | None = None
    """Measured per-layer costs behind a "time"/"memory" balance (None for explicit or equal)."""
    search: Search | None = None
    """The measured micro-batch curve when microbatches="auto"."""
    schedule_curve: dict[str, float] | None = None
    """With schedule="auto": seconds per trial step of every (schedule, micro-batch count) measured."""
    memory: list[StageMemory] | None = None
    """Per worker (pp) or per device (mp): parameters, activations and the schedule's bound."""
    notes: list[str] = field(default_factory=list)
    verbose: bool = True

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.verbose:
            print(f"paratrain: {self.strategy}: {text}", flush=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "stages": self.stages, "microbatches": self.microbatches,
            "schedule": self.schedule, "balance": self.balance,
            "layer_costs": [c.as_dict() for c in self.layer_costs] if self.layer_costs else None,
            "search": self.search.as_dict() if self.search else None,
            "schedule_curve": self.schedule_curve,
            "memory": [m.as_dict() for m in self.memory] if self.memory else None,
            "notes": list(self.notes),
        }
