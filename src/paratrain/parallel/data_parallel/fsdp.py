"""FSDP2 (`fully_shard`) applied the way torchtitan shards a transformer: one unit per block, then the root.

A unit's parameters are all-gathered just before its forward and freed after it, so the units decide
the peak memory. The blocks are the elements of the model's containers (`ModuleList`, `Sequential`,
a `ModuleDict` of one kind of module), found by descending from the root through containers and
through modules that hold a `ModuleList`/`ModuleDict` somewhere below (`blocks.3`, `layer1.0`,
`GPT2LMHeadModel`'s `transformer.h.0`; nanoGPT's `transformer` ModuleDict is a namespace, not blocks).
Everything else (embeddings, final norm, head) belongs to the root unit, which stays gathered from
the start of the forward to the end of the backward:

    GPT                                 units
    ├── tok_emb ───────────┐ tied       root (with pos_emb, ln_f, head)
    ├── pos_emb            │
    ├── blocks: ModuleList │
    │   ├── 0 ─────────────┼─────────── unit "blocks.0"
    │   └── 1 ─────────────┼─────────── unit "blocks.1"
    ├── ln_f               │
    └── head ──────────────┘ (head.weight is tok_emb.weight: one Parameter, in one unit)

A model without containers gets one unit per child that has parameters. A candidate whose parameter
is also registered outside it (a tied weight, a module reused elsewhere) is left to the root, so a
tied pair stays one Parameter in one unit and trains exactly as in one process; torch would
otherwise refuse it at the first forward. Units given by name are checked against the same rules,
and every error names the module and the fix instead of torch's raw message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ParatrainError, unknown_name

_PRECISION = {"bf16": torch.bfloat16, "16": torch.float16}
"""The low dtype FSDP2 gathers and computes in for `setup(precision=...)`."""


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _no_forward(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.ModuleDict) and type(module).forward is nn.Module.forward


def _holds_blocks(module: nn.Module) -> bool:
    """Its elements are blocks: a `ModuleList` or `Sequential`, or a `ModuleDict` of one kind of module
    (torchtitan's `layers`); a `ModuleDict` of different kinds is a namespace (nanoGPT's `transformer`)."""
    if isinstance(module, nn.ModuleList | nn.Sequential):
        return True
    if isinstance(module, nn.ModuleDict):
        return len({type(m) for m in module.values() if _has_params(m)}) == 1
    return False


def _has_list_below(module: nn.Module) -> bool:
    """A `ModuleList`/`ModuleDict` somewhere below `module` (a `Sequential` alone is usually an MLP)."""
    return any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in module.modules())


def _blocks(module: nn.Module, prefix: str, in_container: bool) -> Iterator[str]:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if not _has_params(child):
            continue
        if _holds_blocks(child):
            yield from _blocks(child, f"{path}.", True)
        elif not in_container and _has_list_below(child):
            yield from _blocks(child, f"{path}.", False)
        elif in_container:
            yield path


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """Every name each Parameter is registered under (more than one: tied or reused)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _outside(model: nn.Module, path: str, owners: dict[int, list[str]]) -> list[tuple[str, str]]:
    """(inside, outside) name pairs of parameters of `path` that are also registered outside it."""
    inside = f"{path}."
    pairs = []
    for p in model.get_submodule(path).parameters():
        names = owners[id(p)]
        mine = next(n for n in names if n.startswith(inside))
        pairs += [(mine, n) for n in names if not n.startswith(inside)]
    return pairs


def find_units(model: nn.Module) -> list[str]:
    """The module paths to shard one by one (the root comes last and is not listed)."""
    candidates = list(_blocks(model, "", _holds_blocks(model)))
    if not candidates:
        candidates = [name for name, child in model.named_children() if _has_params(child) and not _no_forward(child)]
    owners = _owners(model)
    return [c for c in candidates if not _outside(model, c, owners)]


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy for `setup(precision=...)`: gather and compute in the low dtype, reduce in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = _PRECISION.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _check_not_sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            where = repr(name) if name else "the model itself"
            raise ParatrainError(
                f"fsdp: the model is already sharded (fully_shard was applied to {where}); pass the plain "
                "module to run.prepare, which shards it"
            )


def _check_unit(model: nn.Module, path: str, units: Sequence[str], owners: dict[int, list[str]]) -> None:
    """A named unit torch would refuse, refused here with the fix (torch says so only at the first forward)."""
    names = dict(model.named_modules())
    if path not in names:
        raise unknown_name(f"fsdp unit (a module of {type(model).__name__})", path, [n for n in names if n])
    module = names[path]
    if _no_forward(module):
        elements = [f"{path}.{n}" for n, _ in module.named_children()]
        shown = ", ".join(repr(e) for e in elements[:3]) + (", ..." if len(elements) > 3 else "")
        raise ParatrainError(
            f"fsdp unit {path!r} is a {type(module).__name__}, which has no forward of its own, so FSDP "
            f"cannot gather its parameters when it runs; name its elements instead ({shown})"
        )
    for inside, outside in _outside(model, path, owners):
        other = next((u for u in units if outside.startswith(f"{u}.")), None)
        where = f"unit {other!r}" if other else "the root"
        raise ParatrainError(
            f"fsdp unit {path!r}: parameter {inside!r} is the same Parameter as {outside!r} (tied weights), "
            f"which would be sharded twice, in {path!r} and in {where}; a tied pair must live in one unit: "
            f"leave {path!r}{' and ' + repr(other) if other else ''} out of the unit list (the root then "
            "holds the pair)"
        )


def _check_dtypes(model: nn.Module, units: Sequence[str]) -> None:
    """FSDP2 all-gathers a unit as one flat buffer, so its trainable parameters must share one dtype.
    `units` bottom-up, as they are sharded: a parameter belongs to the first unit that holds it."""
    seen: set[int] = set()
    for path in [*units, ""]:
        module = model.get_submodule(path)
        dtypes: dict[torch.dtype, str] = {}
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                dtypes.setdefault(p.dtype, f"{path}.{name}" if path else name)
        if len(dtypes) > 1:
            found = ", ".join(f"{n} is {d}" for d, n in dtypes.items())
            where = f"unit {path!r}" if path else "the root unit"
            raise ParatrainError(
                f"fsdp: {where} of {type(model).__name__} mixes parameter dtypes ({found}); FSDP gathers a "
                "unit as one buffer of one dtype: keep the model in float32 (model.float()) and use "
                "setup(precision='bf16') for mixed precision"
            )


def apply_fsdp(model: nn.Module, mesh: Any = None, *, units: Sequence[str] | None = None,
               precision: str = "32", ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard `model` in place: each unit (`find_units`, or the module paths given), then the root. `ignored`
    parameters stay as they are (experts, which expert parallelism already splits and reduces)."""
    from torch.distributed.fsdp import fully_shard

    _check_not_sharded(model)
    if _no_forward(model):
        raise ParatrainError(
            f"fsdp: the model is a {type(model).__name__}, which has no forward; pass the module whose "
            "forward runs its elements"
        )
    owners = _owners(model)
    if units is None:
        units = find_units(model)
    else:
        for path in units:
            _check_unit(model, path, units, owners)
    units = sorted(units, key=lambda p: -p.count("."))  # bottom-up, as fully_shard requires
    _check_dtypes(model, units)
    policy = mixed_precision(precision)
    for path in units:
        _shard(fully_shard, model.get_submodule(path), path, mesh, policy, ignored)
    _shard(fully_shard, model, "", mesh, policy, ignored)
    return model


def _placement(param: nn.Parameter) -> Any:
    """FSDP's dimension for a parameter: dim 0, unless tensor parallelism already splits dim 0 as a strided slice
    (a fused or expert weight, `parallel.tensor.styles`): DTensor cannot gather two strided splits of one dimension
    back into the whole tensor, so FSDP splits the next one."""
    from torch.distributed.tensor import Shard

    strided = [getattr(p, "dim", None) for p in getattr(param, "placements", ()) if type(p).__name__ == "_StridedShard"]
    return Shard(1) if 0 in strided and param.dim() > 1 else Shard(0)


def _shard(fully_shard: Any, module: nn.Module, path: str, mesh: Any, policy: Any,
           ignored: set[nn.Parameter] | None = None) -> None:
    try:
        fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=_placement, ignored_params=ignored or None)
    except (ValueError, RuntimeError, AssertionError) as exc:
        where = f"unit {path!r}" if path else "the root module"
        raise ParatrainError(f"fsdp could not shard {where} ({type(module).__name__}): {exc}") from exc


def set_fsdp_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward of an FSDP2 model reduce-scatters its gradients (False: accumulate)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(sync)
