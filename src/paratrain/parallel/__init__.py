"""Model and pipeline parallelism: partitioning, balancing, micro-batching, schedules, memory.

The strategies `mp`, `pp`, `ddp+pp` and `ddp+mp` are thin layers over these pieces; they are also
usable directly (e.g. `split_into_stages(layers_of(model), balance)` or `profile_layers`).
"""

from .balance import LayerCost, choose_balance, profile_layers, solve, stage_sums
from .microbatch import Search, search, sweep
from .partition import Stage, equal_balance, layers_of, split_into_stages
from .plan import Plan

__all__ = [
    "LayerCost", "Plan", "Search", "Stage", "choose_balance", "equal_balance", "layers_of", "profile_layers",
    "search", "solve", "split_into_stages", "stage_sums", "sweep",
]
