"""The modules' own initialisation, one module at a time, the same values under every layout.

A module's tensors are made whole on this rank (bounded by the largest module's own tensors, not the model), its
initialiser runs on them with torch's generator seeded from (seed, the module's name), and each rank keeps the
piece it holds. The initialiser is the one its library uses: a Hugging Face model's `_init_weights` (which also
computes rotary frequencies), else the module's `reset_parameters`; a LoRA adapter's (peft) its layer's
`reset_lora_parameters`, so B starts at zero (weights/lora.py). A tensor no initialiser writes is refused by
name: values left from `torch.empty` are never trained on.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ParatrainError
from .lora import LoraInit
from .names import canonical_names, named_tensors

_UNSET = -(2**31)


def _hf_owner(model: nn.Module) -> dict[str, nn.Module]:
    """module name -> the nearest enclosing Hugging Face PreTrainedModel (whose `_init_weights` applies)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return {}
    owner: dict[str, nn.Module] = {}
    for name, module in model.named_modules():  # parents before children
        if isinstance(module, PreTrainedModel):
            owner[name] = module
        elif name and name.rpartition(".")[0] in owner:
            owner[name] = owner[name.rpartition(".")[0]]
    return owner


def _key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _blank(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Whole, on the CPU, filled with a value no initialiser writes (NaN, or the dtype's most negative integer)."""
    out = torch.empty(shape, dtype=dtype)
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    return out.fill_(torch.iinfo(out.dtype).min if out.dtype != torch.bool else False)


def _unset(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or not t.numel():
        return False
    return bool((t == torch.iinfo(t.dtype).min).all())


class OwnInit:
    """Whole initial values of a model's tensors, computed per module on demand."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model, self.seed = model, seed
        self.canonical = canonical_names(model)
        self.specs = {name: (t.shape, t.dtype) for name, t in named_tensors(model)}
        """Shapes as built: a layout then empties the tensors other ranks hold (a pipeline's other stages)."""
        self._hf = _hf_owner(model)
        self.lora = LoraInit(model)
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def full(self, name: str) -> torch.Tensor:
        path, _, attr = self.canonical.get(name, name).rpartition(".")
        if self._cached is None or self._cached[0] != path:
            self._cached = None  # the previous module's values go before the next one's are made
            self._cached = (path, self._initialised(path))
        return self._cached[1][attr]

    def _shadow(self, path: str) -> nn.Module:
        """The module's own attributes (sizes, config, padding_idx), its own tensors whole and blank."""
        module = self.model.get_submodule(path)
        shadow = copy.copy(module)
        named = lambda k: f"{path}.{k}" if path else k  # noqa: E731
        shadow._parameters = {k: None if p is None else nn.Parameter(_blank(*self.specs[named(k)]),
                                                                     requires_grad=p.requires_grad)
                              for k, p in module._parameters.items()}
        shadow._buffers = {k: None if b is None else _blank(*self.specs[named(k)]) for k, b in module._buffers.items()}
        shadow._modules = dict(module._modules)
        return shadow

    def _initialised(self, path: str) -> dict[str, torch.Tensor]:
        module = self.model.get_submodule(path)
        shadow = self._shadow(path)
        how = self._initialiser(path, shadow)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(_key(self.seed, path))
            if how is not None:
                how()
        values = {k: t.detach() for k, t in (*shadow._parameters.items(), *shadow._buffers.items()) if t is not None}
        for attr, value in values.items():
            if how is None or _unset(value):  # nothing ran, or it left this tensor as blank as it found it
                raise _nothing_sets(f"{path}.{attr}" if path else attr, module, how is not None)
        return values

    def _initialiser(self, path: str, shadow: nn.Module) -> Callable[[], Any] | None:
        adapter = self.lora.initialiser(path, shadow, self._shadow)
        if adapter is not None:  # a LoRA adapter's tensors: peft's rule, run by their layer (weights/lora.py)
            def run_adapter() -> None:
                adapter()
                if _any_unset(shadow) and hasattr(shadow, "reset_parameters"):
                    shadow.reset_parameters()  # type: ignore[operator]  # init_lora_weights=False: the module's own
            return run_adapter
        hf = self._hf.get(path)
        if hf is not None and hasattr(hf, "_init_weights"):
            def run() -> None:
                hf._init_weights(shadow)  # type: ignore[operator]
                if _any_unset(shadow) and hasattr(shadow, "reset_parameters"):
                    shadow.reset_parameters()  # type: ignore[operator]  # a torch module in a Hugging Face model
            return run
        for method in ("reset_parameters", "_reset_parameters"):
            if callable(getattr(shadow, method, None)):
                return getattr(shadow, method)  # type: ignore[no-any-return]
        return None


def _any_unset(module: nn.Module) -> bool:
    return any(t is not None and _unset(t) for t in (*module._parameters.values(), *module._buffers.values()))


def _user_class(module: nn.Module) -> str:
    """The module's own class name, not the subclass FSDP2 makes of it (`FSDPDecoder` for `Decoder`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return type(module).__name__
    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _nothing_sets(name: str, module: nn.Module, had: bool) -> ParatrainError:
    kind = _user_class(module)
    why = (f"its initialiser leaves {name} unset" if had
           else f"{kind} has no reset_parameters() and is in no Hugging Face model")
    return ParatrainError(
        f"{name} ({kind}) was built on the meta device and nothing computes its values: {why}. Give {kind} a "
        "reset_parameters() that sets every tensor it owns, pass run.prepare(..., init_from=CHECKPOINT) holding it "
        "(a buffer outside the state dict must be computed), or build the model under paratrain.empty_init(), "
        "which keeps buffers real")
