"""Model and optimizer state of sharded strategies, through torch.distributed.checkpoint (DCP).

When ranks hold different parts of the model (pipeline stages, FSDP shards) no rank has the whole
state to write. DCP writes every rank's tensors plus one global index and, on load, hands each rank
the slices it asks for, so a sharded run resumes even on another world size as long as the
strategy's state-dict keys are the original model's parameter names (FSDP's are; a pipeline split
that keeps the original module names is too). Optimizer state goes through torch's
`get_optimizer_state_dict`, which keys it by parameter name instead of the per-rank integer ids a
plain `optimizer.state_dict()` uses (those would collide between stages), flattened: every
parameter carries its own copy of its group's options (lr, betas, ...). Unflattened, the groups
are one list per rank that DCP stores once, so a stage of another split found no group naming its
parameters and stepped with no options.

Everything else in the user's state (schedulers, the loader position, plain values) is small and
written per rank by the manager with torch.save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, is_comm_failure
from . import strided
from .state import Unwrap

_DIR = "model"
"""Subdirectory of a checkpoint holding the DCP files."""


def base_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def split(state: dict[str, Any], unwrap: Unwrap) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, Any]]]:
    """The modules and the (module, optimizer) pairs of `state` that DCP handles. An optimizer with no parameter on
    this rank is left out here (torch's state-dict API refuses an empty one); the ranks that hold some write it."""
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers: dict[str, tuple[nn.Module, Any]] = {}
    for key, value in state.items():
        if not isinstance(value, torch.optim.Optimizer):
            continue
        optimizer = base_optimizer(value)
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not params:  # a pipeline rank whose stages hold only frozen layers (LoRA's embeddings): nothing to keep
            continue
        owners = [m for m in modules.values() if any(id(p) in params for p in m.parameters())]
        if not owners:
            raise CheckpointError(
                f"state[{key!r}] is an optimizer whose parameters belong to no model in the state; a sharded "
                "checkpoint stores optimizer state by parameter name, so put its model in the state dict too"
            )
        optimizers[key] = (owners[0], optimizer)
    return modules, optimizers


def handled(state: dict[str, Any]) -> set[str]:
    return {k for k, v in state.items() if isinstance(v, nn.Module | torch.optim.Optimizer)}


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def _without_zero_step(optimizer: torch.optim.Optimizer, saved_state: bool = False) -> Iterator[None]:
    """torch's optimizer state-dict API gives an optimizer with no state yet a zero gradient for every parameter
    and steps it, to create the state it would save or load into: a second copy of the rank's share of the model
    for the duration (+B/N under FSDP with SGD). Where there is no state to save, nor any saved to load into it
    (`saved_state`), one tiny zero gradient on one parameter tells torch so and nothing is allocated."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or saved_state or not params or any(p.grad is not None for p in params):
        yield
        return
    smallest = min(params, key=lambda p: p.numel())
    smallest.grad = torch.zeros_like(smallest)
    try:
        yield
    finally:
        smallest.grad = None


def _state_dicts(modules: dict[str, nn.Module], optimizers: dict[str, tuple[nn.Module, Any]],
                 saved_state: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The model and optimizer state dicts DCP reads and writes; `saved_state`: the optimizers (by key) whose
    state the checkpoint to load holds."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {f"model.{k}": get_model_state_dict(m) for k, m in modules.items()}
    for k, (m, o) in optimizers.items():
        with _without_zero_step(o, k in saved_state):
            out[f"optim.{k}"] = get_optimizer_state_dict(m, o, options=_options())
    return out


def _with_state(checkpoint: Path, optimizers: dict[str, tuple[nn.Module, Any]]) -> frozenset[str]:
    """The optimizers whose state (not only their options) the checkpoint holds, read from DCP's index."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(str(checkpoint / _DIR)).read_metadata().state_dict_metadata
    except Exception:
        return frozenset(optimizers)  # `_check_fits` names the unreadable index; assume state, as torch does
    return frozenset(k for k in optimizers if any(key.startswith(f"optim.{k}.state.") for key in saved))


def gather(state: dict[str, Any], unwrap: Unwrap) -> dict[str, Any]:
    """This rank's model and optimizer state dicts, as DCP writes them (`save`); no collective, so a rank that
    fails here can say so before any rank enters DCP's."""
    return _state_dicts(*split(state, unwrap))


def save(checkpoint: Path, state_dicts: dict[str, Any], process_group: Any = None) -> None:
    """Collective over `process_group` (the default one if None): every rank writes its shards (from `gather`,
    through `strided.for_save`) into `checkpoint/model/`."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dicts, checkpoint_id=str(checkpoint / _DIR), process_group=process_group)


def _check_fits(checkpoint: Path, target: dict[str, Any]) -> None:
    """CheckpointError naming the model entries the checkpoint lacks or holds in another shape (read from
    DCP's index on every rank, so every rank raises before the collective load)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = FileSystemReader(str(checkpoint / _DIR)).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"sharded checkpoint {str(checkpoint)!r} has no readable index: {exc}") from None
    for key, sd in target.items():
        if not key.startswith("model."):
            continue
        missing, shapes = [], []
        for name, value in sd.items():
            entry = saved.get(f"{key}.{name}")
            if entry is None:
                missing.append(name)
            elif (isinstance(entry, TensorStorageMetadata) and torch.is_tensor(value)
                  and tuple(entry.size) != tuple(value.shape)):
                shapes.append(f"{name} {tuple(entry.size)} vs {tuple(value.shape)}")
        if missing or shapes:
            what = (f"it has no {missing[:5]}" if missing else "") + ("; " if missing and shapes else "") + (
                f"shapes differ: {shapes[:3]}" if shapes else "")
            raise CheckpointError(f"sharded checkpoint {checkpoint.name} does not fit this model (state[{key[6:]!r}]): "
                                  f"{what}; resume with the model that saved it")


def load(checkpoint: Path, state: dict[str, Any], unwrap: Unwrap) -> None:
    """Collective: every rank reads the slices of the saved tensors that its own state dicts hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    modules, optimizers = split(state, unwrap)
    saved_state = _with_state(checkpoint, optimizers)
    target = _state_dicts(modules, optimizers, saved_state)
    _check_fits(checkpoint, target)
    aside = strided.ForLoad(target)
    try:
        dcp.load(target, checkpoint_id=str(checkpoint / _DIR))
    except (Exception, CheckpointException) as exc:
        if is_comm_failure(exc):
            raise
        raise CheckpointError(
            f"sharded checkpoint {str(checkpoint)!r} does not fit this model: {str(exc).strip()[:800]}"
        ) from exc
    aside.restore()
    for key, module in modules.items():
        set_model_state_dict(module, target[f"model.{key}"])
    for key, (module, optimizer) in optimizers.items():
        with _without_zero_step(optimizer, key in saved_state):
            set_optimizer_state_dict(module, optimizer, target[f"optim.{key}"], options=_options())
