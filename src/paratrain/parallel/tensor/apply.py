"""Tensor parallelism on torch's DTensor (`parallelize_module` with Colwise/RowwiseParallel), and the check
that makes it safe: the sharded blocks must compute what the whole blocks computed.

A plan is only names and styles; whether a block's forward survives having 1/tp of its heads is a property of
its code: `view(b, t, self.heads, d)` with the full head count fails, and `view(b, t, self.heads, -1)` runs and
silently computes attention over the wrong head width. So in `prepare`, one no-grad forward of the example
batch runs through the sharded model, and the first block of each kind (each parent of planned layers, by
class) is run again unsharded on the same input: a difference, or an error inside the block, is refused with
the block's name and the fix.
"""

from __future__ import annotations

import copy
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..._tree import tensors_in
from ...errors import ParatrainError
from ..options import example_needed

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}


def _parents(plan: dict[str, str]) -> list[str]:
    """The first module of each kind that holds planned layers (blocks.0.attn, blocks.0.mlp, ...)."""
    seen: list[str] = []
    for name in plan:
        parent = name.rpartition(".")[0]
        if parent not in seen:
            seen.append(parent)
    return seen


def apply_tp(model: nn.Module, mesh: Any, plan: dict[str, str], example: Any) -> nn.Module:
    """Shard the planned Linears of `model` in place over the tensor mesh, then check them on `example`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if example is None:
        raise example_needed("tensor parallelism", "each sharded block is checked against the whole block")
    kinds: dict[type, str] = {}
    for parent in _parents(plan):
        kinds.setdefault(type(model.get_submodule(parent)), parent)
    originals = {name: copy.deepcopy(model.get_submodule(name)) for name in kinds.values()}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    check(model, originals, plan, example)
    return model


def check(model: nn.Module, originals: dict[str, nn.Module], plan: dict[str, str], example: Any) -> None:
    """One no-grad forward in eval mode; each checked block's sharded output against its unsharded copy."""
    seen: dict[str, tuple[Any, Any, Any]] = {}
    handles = [model.get_submodule(name).register_forward_hook(
        lambda m, a, k, out, n=name: seen.setdefault(n, (a, k, out)) and None, with_kwargs=True)
        for name in originals]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example)
    except Exception as exc:
        where = _raised_in(model, originals, exc.__traceback__) or next(iter(originals))
        raise _refusal(where, plan, f"its forward failed on the sharded layers ({type(exc).__name__}: {exc})") \
            from exc
    finally:
        for handle in handles:
            handle.remove()
        model.train(was)
    for name, (a, k, out) in seen.items():
        whole = originals[name].to(_device_of(out))
        whole.eval()
        with torch.no_grad():
            want = whole(*a, **k)
        diff = _max_diff(out, want)
        if diff is None or diff > _TOLERANCE.get(_dtype_of(out), 1e-2):
            said = "its outputs differ in structure" if diff is None else f"its output differs by {diff:.3g}"
            raise _refusal(name, plan, f"{said} from the unsharded block on the same input")


def _raised_in(model: nn.Module, originals: dict[str, nn.Module], tb: TracebackType | None) -> str | None:
    """The checked block whose forward was running when the error was raised (the innermost one)."""
    blocks = {id(model.get_submodule(name)): name for name in originals}
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in blocks:
            found = blocks[id(owner)]
        tb = tb.tb_next
    return found


def _refusal(name: str, plan: dict[str, str], what: str) -> ParatrainError:
    layers = ", ".join(n for n in plan if n.rpartition(".")[0] == name or n.startswith(f"{name}."))
    block = name or "the model's own forward"
    return ParatrainError(
        f"tensor parallelism cannot shard {block} ({layers}): {what}. Each rank holds 1/tp of the heads and "
        "features, so a forward must not hard-code the full sizes: reshape with view(b, t, -1, head_dim) "
        "instead of view(b, t, self.heads, c // self.heads), and split fused projections by their local size; "
        "or pass setup(tp_plan=...) without this block")


def _device_of(value: Any) -> torch.device:
    tensors = tensors_in(value)
    return tensors[0].device if tensors else torch.device("cpu")


def _dtype_of(value: Any) -> torch.dtype:
    tensors = tensors_in(value)
    return tensors[0].dtype if tensors else torch.float32


def _max_diff(got: Any, want: Any) -> float | None:
    a, b = tensors_in(got), tensors_in(want)
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x = x.full_tensor() if hasattr(x, "full_tensor") else x
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        if x.shape != y.shape:
            return None
        worst = max(worst, (x.float() - y.float()).abs().max().item() if x.numel() else 0.0)
    return worst
