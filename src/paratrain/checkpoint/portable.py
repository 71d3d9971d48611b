"""A replicated checkpoint (`shared.pt`: whole state dicts) loaded into a layout that splits the model.

A pipeline stage holds some of the model's parameters and FSDP / tensor-parallel ranks hold slices, so
torch's `load_state_dict` of the whole dicts fails there. The whole dicts go through torch's
`set_model_state_dict` / `set_optimizer_state_dict` with `full_state_dict=True` instead, which take the
entries this rank's modules hold and slice them into DTensors. A plain `optimizer.state_dict()` keys
its state by integer position, which means nothing to another layout's optimizer, so a replicated
save records the parameter names in that order (`names`) and they key the state here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from . import sharded
from .state import Unwrap


def optimizer_names(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> list[str] | None:
    """The name of each parameter of `optimizer` in state-dict order, or None if a model in the state
    does not hold them all."""
    names: dict[int, str] = {}
    for module in modules:
        for name, param in module.named_parameters():
            names.setdefault(id(param), name)
    params = [p for group in sharded.base_optimizer(optimizer).param_groups for p in group["params"]]
    if not all(id(p) in names for p in params):
        return None
    return [names[id(p)] for p in params]


def record_names(payload: dict[str, Any], state: dict[str, Any], unwrap: Unwrap) -> None:
    """Add `names` to each optimizer entry of a replicated payload (see the module docstring)."""
    modules = [unwrap(v) for v in state.values() if isinstance(v, nn.Module)]
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer) and key in payload:
            payload[key]["names"] = optimizer_names(value, modules)


def _by_name(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in saved["param_groups"]]
    return {"state": {names[i]: value for i, value in saved["state"].items()}, "param_groups": groups}


def check_whole(saved: dict[str, Any], state: dict[str, Any], unwrap: Unwrap, source: str) -> None:
    """CheckpointError unless `load_whole` can fill this rank's modules and optimizers (local: call it
    where the ranks agree on errors, before the collective load)."""
    modules, optimizers = sharded.split(state, unwrap)
    for key, module in modules.items():
        missing = [k for k in module.state_dict() if key in saved and k not in saved[key]["value"]]
        if missing:
            raise CheckpointError(f"checkpoint {source} does not fit state[{key!r}]: it has no {missing[:5]}")
    for key in optimizers:
        if key in saved and saved[key].get("names") is None:
            raise CheckpointError(
                f"checkpoint {source} stores state[{key!r}] without its parameter names (an optimizer over "
                "parameters of no model in the state), so it loads only under a layout that keeps every "
                "parameter on every rank (single, ddp, mp, ddp+mp)"
            )


def load_whole(saved: dict[str, Any], state: dict[str, Any], unwrap: Unwrap) -> None:
    """Load the models and optimizers of a replicated payload into this rank's (split) modules; collective
    where the modules hold DTensors. `check_whole` first."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    modules, optimizers = sharded.split(state, unwrap)
    for key, module in modules.items():
        if key in saved:
            full = saved[key]["value"]
            set_model_state_dict(module, {k: full[k] for k in module.state_dict()}, options=whole)
    for key, (module, optimizer) in optimizers.items():
        if key in saved:
            by_name = _by_name(saved[key]["value"], saved[key]["names"])
            set_optimizer_state_dict(module, optimizer, by_name, options=whole)
