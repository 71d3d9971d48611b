"""FSDP2 over pipeline stages (`fsdp+pp`, `fsdp+tp+pp`, HSDP with `ddp+fsdp+pp`): torchtitan's order, split first,
then shard each stage.

Each stage this rank holds becomes one FSDP2 unit over the data-parallel mesh: its parameters are gathered when
torch's PipelineStage calls it, and torch's stage drives the reduce-scatter itself (gradients accumulate unsharded
over the micro-batches of a step and are reduced once, after the last one). A traced stage reads its weights
through its graphs' own attributes rather than through the blocks' forwards, so its segments are told to read them
from their modules at every call, where FSDP2 has just put the gathered tensors.

A parameter tied across stages (an LM head sharing the embedding's weight) is one shard per holder: the holders'
sharded gradients are summed over the pipeline's ranks, each rank with the same data-parallel coordinate holding
the same rows. Two stages of one rank cannot both shard the same parameter, so a schedule that puts both ends of a
tie on one rank (a V schedule) is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ParatrainError
from ..data_parallel.fsdp import apply_fsdp
from .graph_split import GraphSegment
from .partition import Stage
from .tied import TiedGradients


def _check_ties(stages: Sequence[Stage]) -> None:
    seen: dict[int, int] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            other = seen.setdefault(id(p), stage.index)
            if other != stage.index:
                raise ParatrainError(
                    f"FSDP over pipeline stages: parameter {name!r} is tied between stages {other} and "
                    f"{stage.index}, which this rank both holds, and one parameter cannot be sharded by two FSDP "
                    "units; use a schedule with one stage per worker (stages_per_worker=1), or untie the weights")


def shard_stages(stages: Sequence[Stage], mesh: Any, precision: str, tied: TiedGradients,
                 unsharded: set[Any] | None = None) -> None:
    """Shard each of this rank's stages in place over `mesh` and point the tied-gradient sums at the shards;
    `unsharded` parameters (experts, which expert parallelism reduces itself) are left out."""
    _check_ties(stages)
    before = {id(p): (stage, name) for stage in stages for name, p in stage.named_parameters()}
    for stage in stages:
        held = {p for p in stage.parameters() if p in (unsharded or set())}
        apply_fsdp(stage, mesh, units=[], precision=precision, ignored=held or None)
        for module in stage._chain:
            if isinstance(module, GraphSegment):
                module.read_through = True
    now = {old: stage.get_parameter(name) for old, (stage, name) in before.items()}
    shard_dim = mesh.ndim - 1  # HSDP shards over its last dimension and replicates over the first
    tied.follow(now, mesh.get_local_rank(shard_dim), mesh.size(shard_dim))
