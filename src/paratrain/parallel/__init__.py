"""The parallel engines, one folder per part: `dims` (degrees and the mesh), `data_parallel/` (DDP, FSDP),
`tensor/` (tensor-parallel plans), `pipeline/` (splitting, balancing, the schedule table, both pipeline
engines), and what they share (layout-independent dropout, BatchNorm over split batches, micro-batches).

The strategies are thin layers over these pieces; the pipeline ones are also usable directly (e.g.
`split_into_stages(layers_of(model), balance)` or `profile_layers`).
"""

from .microbatch import Search, search, sweep
from .pipeline.balance import LayerCost, choose_balance, profile_layers, solve, stage_sums
from .pipeline.partition import Stage, equal_balance, layers_of, split_into_stages
from .plan import Plan

__all__ = [
    "LayerCost", "Plan", "Search", "Stage", "choose_balance", "equal_balance", "layers_of", "profile_layers",
    "search", "solve", "split_into_stages", "stage_sums", "sweep",
]
