"""Tensor parallelism applied: the plan's layers sharded over the tensor mesh in the ways the check settled
(`check.choose`), every block of a kind alike, then the whole model run once more on the example against its
unsharded output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import collectives
from ...errors import ParatrainError
from ...weights.streamed import streamed
from .. import step_state
from ..options import example_needed
from ..trial import no_trace
from . import check, local_sizes
from .plan import owner_of, without_ties
from .styles import LocalShards, experts, make, own_parameters


def _blocks(model: nn.Module, plan: dict[str, str]) -> dict[str, list[str]]:
    """Blocks (parents of planned layers) by kind, in order: the first of each kind is the one checked."""
    kinds: dict[type, list[str]] = {}
    for name in plan:
        if owner_of(plan, name) is not None:
            continue
        parent = name.rpartition(".")[0]
        same = kinds.setdefault(type(model.get_submodule(parent)), [])
        if parent not in same:
            same.append(parent)
    return {names[0]: names for names in kinds.values()}


def _sharder(mesh: Any, plan: dict[str, str], prefix: str) -> check.Shard:
    """shard(module, {name inside it: style}) for blocks under `prefix` in the model (expert weights' declared styles
    are read from the plan by their full names)."""
    from torch.distributed.tensor.parallel import parallelize_module

    def shard(module: nn.Module, styles: dict[str, str]) -> None:
        own = {n: s for n, s in styles.items() if n in module._parameters}  # the module's own (a sink per head)
        for name, style in styles.items():
            if name in own:
                continue
            layer = module.get_submodule(name)
            full = f"{prefix}{name}"
            if style == "experts":
                declared = {n.rpartition(".")[2]: s for n, s in plan.items() if owner_of(plan, n) == full}
                parallelize_module(layer, mesh, experts(layer, full, declared))
            else:
                parallelize_module(layer, mesh, make(style, layer, full))
        if own:  # after its layers: its forward, run on its own local pieces, calls theirs
            parallelize_module(module, mesh, own_parameters(module, prefix.rstrip(".") or "the model", own))

    return shard


def apply_tp(model: nn.Module, mesh: Any, plan: dict[str, str], example: Any) -> tuple[dict[str, str], list[str]]:
    """Shard the planned layers of `model` in place over the tensor mesh, checked on `example`; returns the plan as
    applied (fused projections resolved) and what the check settled, in words (fused projections' layout, size
    attributes set to the rank's share)."""
    if example is None:
        raise example_needed("tensor parallelism", "each sharded block is checked against the whole block")
    with torch.compiler.set_stance("force_eager"):  # the checks' forwards compile nothing the training would not
        return _apply(model, mesh, plan, example)


def _apply(model: nn.Module, mesh: Any, plan: dict[str, str], example: Any) -> tuple[dict[str, str], list[str]]:
    from torch.distributed.tensor.parallel import parallelize_module

    tp, rank = mesh.size(), mesh.get_local_rank()
    plan, notes = without_ties(model, plan)
    if not plan:
        raise ParatrainError(f"tensor parallelism has nothing to shard in {type(model).__name__}: {'; '.join(notes)}; "
                             "name its attention and MLP layers in setup(tp_plan=...), or use a data-parallel layout")
    blocks = _blocks(model, plan)
    seen, whole = check.capture(model, list(blocks), example)
    missing = [name for name, s in seen.items() if s.args is None]
    if missing:
        raise check.refusal(missing[0], plan, "the example batch's forward never runs it, so it cannot be checked")
    calls = step_state.active().random_calls
    drawn = _trained(model, example, calls, record=True)
    device = torch.device(mesh.device_type)
    chosen = check.choose(model, plan, seen, tp, rank, mesh.get_group(), _sharder(mesh, plan, ""),
                          lambda ok: _agree(ok, device))
    applied = dict(plan)
    for first, names in blocks.items():
        choice = chosen[first]
        for name in names:
            prefix = f"{name}." if name else ""
            inside = check.resolved(check._inside(plan, name), choice.way)
            applied.update({f"{prefix}{n}": style for n, style in inside.items()})
            _sharder(mesh, plan, prefix)(model.get_submodule(name), inside)
            if choice.sizes:
                local_sizes.scale(model.get_submodule(name), choice.sizes)
            for param in choice.partial:  # whole weights computed on the local heads: their gradients summed
                owner, _, attr = f"{prefix}{param}".rpartition(".")
                parallelize_module(model.get_submodule(owner), mesh, LocalShards({}, sum_grads=frozenset({attr})))
        kind = type(model.get_submodule(first)).__name__
        if choice.partial:
            notes.append(f"{kind}: the gradients of {', '.join(choice.partial)} (computed on the local heads) summed "
                         "over the tensor ranks")
        if choice.sizes:
            notes.append(local_sizes.describe(kind, choice.sizes))
        fused = [n for n, s in check._inside(plan, first).items() if s == "fused"]
        if fused:
            layout = "packed per part" if choice.way.fused == "packed_colwise" else "interleaved per head"
            notes.append(f"{kind}.{', '.join(fused)} fused, {layout}")
    _check_whole(model, plan, example, whole, tp, rank)
    if drawn is not None:
        calls.tp_rank, calls.tp = rank, tp
        diff = check.max_diff(_trained(model, example, calls, record=False), drawn, rank, tp)
        if diff is None or diff > 1e-3 * max(1.0, _scale(drawn)):
            raise ParatrainError(
                f"tensor parallelism: {type(model).__name__} in training mode computes other values sharded than "
                f"whole on the example batch (by {diff if diff is None else f'{diff:.3g}'}), although it matches in "
                "eval mode: a random call of its forward draws differently on a slice (docs/parallelism.md, "
                "Randomness); set its probability to 0, or use a data-parallel layout")
    return applied, notes


def _trained(model: nn.Module, example: Any, calls: Any, record: bool) -> Any:
    """The model's output on the example in training mode, random calls drawn by the rule (recording the whole
    model's shapes when `record`), leaving no trace; None when nothing in it draws."""
    if calls is None:
        return None
    with no_trace([model]), torch.no_grad(), check._train(model):
        if record:
            with calls.recorded(), calls.active(example), streamed(model):
                out = model(example)
            return out if calls.whole or calls.other else None
        with calls.active(example), streamed(model):
            return model(example)


def _agree(passed: list[bool], device: torch.device) -> list[bool]:
    """What passed on every rank (the ranks must shard alike, whatever their examples)."""
    flags = collectives.all_reduce(torch.tensor([float(p) for p in passed]), "min", device=device)
    return [bool(f) for f in flags.tolist()]


def _check_whole(model: nn.Module, plan: dict[str, str], example: Any, whole: Any, tp: int, rank: int) -> None:
    """The sharded model on the example, against its unsharded output: code outside the checked blocks (the other
    blocks of a kind, the model's own forward) must be right too."""
    try:
        with check._eval(model), torch.no_grad(), streamed(model):
            out = model(example)
    except Exception as exc:
        blocks = [name for names in _blocks(model, plan).values() for name in names]
        where = check.raised_in(model, blocks, exc)
        raise check.refusal(where, plan, f"its forward fails on the sharded layers: {check.raised_at(exc)}") from exc
    diff = check.max_diff(out, whole, rank, tp)
    if diff is None or diff > 1e-3 * max(1.0, _scale(whole)):
        said = "differs in structure" if diff is None else f"differs by {diff:.3g}"
        raise ParatrainError(
            f"tensor parallelism: {type(model).__name__}'s output on the example batch {said} from the unsharded "
            "model's, although each checked block matched its whole one: a later block of the same kind, or the "
            "model's own forward, computes with the whole sizes; pass setup(tp_plan=...) naming only the blocks "
            "that shard")


def _scale(value: Any) -> float:
    from ..._tree import tensors_in

    tensors = [t for t in tensors_in(value) if t.is_floating_point() and t.numel()]
    return max((float(t.abs().max()) for t in tensors), default=1.0)
