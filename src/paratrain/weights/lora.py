"""LoRA models (the `peft` package) built on the meta device: their adapters' own initialisation, a base model's
checkpoint as their `init_from`, and their adapters' names in the files `save_pretrained` writes.

A peft model wraps its base: `get_peft_model(base, LoraConfig(...))` names the base's `q_proj.weight`
`base_model.model.<...>.q_proj.base_layer.weight` and adds `q_proj.lora_A.default.weight` and `.lora_B.`. Here:

- `LoraInit`: the values peft's `reset_lora_parameters` gives an adapter (B zeros, A Kaiming-uniform or Gaussian),
  computed for one module at a time with the generator `OwnInit` seeds from the module's name;
- `base_names`, `adapter_tensors`: a checkpoint of the base model (plain `save_pretrained`) fits the peft model, its
  adapters (absent from such a file) coming from their own initialisation;
- `peft_root`, `adapter_keys`, `save_config`: what `run.export` needs to write `adapter_model.safetensors` and
  `adapter_config.json` as `PeftModel.save_pretrained` does.

Every function here answers "no peft" (None, empty) for a model without peft layers, and imports nothing then.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ParatrainError

ADAPTER_FILE = "adapter_model.safetensors"
"""peft's SAFETENSORS_WEIGHTS_NAME: the file `PeftModel.from_pretrained` reads."""


def _peft() -> Any:
    """The peft package when the model can hold its layers (it is imported already), else None."""
    return sys.modules.get("peft")


def _tuner_layer() -> Any:
    peft = _peft()
    if peft is None:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


def _lora_layer() -> Any:
    if _peft() is None:
        return None
    from peft.tuners.lora.layer import LoraLayer

    return LoraLayer


def _configs(module: nn.Module) -> dict[str, Any] | None:
    """The module's adapters' configs by adapter name (a PeftModel, a peft tuner, a model peft injected into)."""
    peft = _peft()
    try:
        configs = getattr(module, "peft_config", None)
    except Exception:  # a PeftModel's __getattr__ may raise anything on a module it does not wrap
        return None
    if peft is None or not isinstance(configs, dict) or not configs:
        return None
    return configs if all(isinstance(c, peft.PeftConfig) for c in configs.values()) else None


def peft_root(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost module holding peft adapters' configs (a PeftModel), with its name in `model`; None when the
    model has no peft adapters."""
    if _peft() is None:
        return None
    for name, module in model.named_modules():  # parents before children
        if _configs(module) is not None:
            return name, module
    return None


# -- own initialisation -----------------------------------------------------------------------------------------


class LoraInit:
    """Which modules hold a LoRA adapter's own tensors, and the initialiser peft gives them.

    peft sets an adapter's values in its layer (`LoraLayer.reset_lora_parameters(adapter, init_lora_weights)`:
    `lora_A.<adapter>` Kaiming-uniform as `nn.Linear` (or Gaussian), `lora_B.<adapter>` zeros), not in the
    `nn.Linear` that holds them, whose own `reset_parameters` (or a Hugging Face model's `_init_weights`) would make B
    nonzero and the wrapped model differ from its base. Here that method runs on a shadow of the layer whose adapter
    modules are the shadows `OwnInit` gives (tensors whole and blank), and the module asked for keeps its values."""

    def __init__(self, model: nn.Module) -> None:
        self.layers: dict[str, tuple[Any, dict[str, Any]]] = {}  # layer name -> (LoraLayer, its configs)
        self.owners: dict[str, tuple[str, str, str | None]] = {}
        """module name -> (its LoraLayer's name, the layer's attribute holding it, the adapter: None for a
        ParameterDict holding every adapter's tensor)"""
        kind = _lora_layer()
        if kind is None:
            return
        configs: dict[str, dict[str, Any]] = {}  # module name -> the nearest enclosing adapters' configs
        module: Any
        for name, module in model.named_modules():
            own = _configs(module)
            parent = name.rpartition(".")[0]
            if own is not None:
                configs[name] = own
            elif name and parent in configs:
                configs[name] = configs[parent]
            if not isinstance(module, kind) or name not in configs:
                continue
            self.layers[name] = (module, configs[name])
            for attr, holder, at in _holders(module, name):
                if isinstance(holder, nn.ModuleDict):
                    for adapter in holder:
                        self.owners[f"{at}.{adapter}"] = (name, attr, adapter)
                else:
                    self.owners[at] = (name, attr, None)

    def adapter_tensors(self, model: nn.Module) -> set[str]:
        """Names of the tensors adapters hold (in `model`'s state-dict names)."""
        return {name for name, _ in (*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False))
                if name.rpartition(".")[0] in self.owners}

    def initialiser(self, path: str, shadow: nn.Module,
                    blank: Callable[[str], nn.Module]) -> Callable[[], None] | None:
        """What sets the tensors of the module `path` (its `shadow`, tensors whole and blank), or None where it holds
        no adapter; `blank(name)` is another module's shadow."""
        owner = self.owners.get(path)
        if owner is None:
            return None
        layer_name, attr, adapter = owner
        layer, configs = self.layers[layer_name]
        adapters = [adapter] if adapter is not None else [a for a in shadow._parameters if a in configs]
        for a in adapters:
            _check_computable(path, attr, a, configs)
        twin = copy.copy(layer)  # the layer's own attributes (r, scaling, lora_bias), its adapter modules shadows
        twin._modules = dict(layer._modules)
        for name, holder, at in _holders(layer, layer_name):
            if isinstance(holder, nn.ModuleDict):
                entries = copy.copy(holder)
                entries._modules = dict(holder._modules)
                for a in adapters:
                    if a in holder._modules:
                        entries._modules[a] = shadow if (name, a) == (attr, adapter) else blank(f"{at}.{a}")
                twin._modules[name] = entries
            else:
                twin._modules[name] = shadow if name == attr else blank(at)

        def run() -> None:
            for a in adapters:
                twin.reset_lora_parameters(a, configs[a].init_lora_weights)  # type: ignore[operator]

        return run


def _holders(layer: Any, name: str) -> Iterator[tuple[str, nn.Module, str]]:
    """A LoRA layer's children that hold adapters: (attribute, the child, its module name)."""
    for attr in layer.adapter_layer_names:
        holder = layer._modules.get(attr)
        if holder is not None:
            yield attr, holder, f"{name}.{attr}" if name else attr


def _check_computable(path: str, attr: str, adapter: str, configs: dict[str, Any]) -> None:
    config = configs.get(adapter)
    init = getattr(config, "init_lora_weights", True)
    fix = ("give run.prepare(..., init_from=CHECKPOINT) holding the adapters (a peft model's state dict, or "
           "run.export(model, PATH, adapters_only=False) of it)")
    if attr == "lora_magnitude_vector":
        raise ParatrainError(f"{path}: DoRA's magnitude is computed from the base layer's weights, which a model "
                             f"built on the meta device has not yet when its adapters are initialised; {fix}")
    if init not in (True, False) and not (isinstance(init, str) and init.lower() == "gaussian"):
        raise ParatrainError(f"{path}: LoraConfig(init_lora_weights={init!r}) computes adapter {adapter!r} from the "
                             "base layer's weights, which a model built on the meta device has not yet when its "
                             f"adapters are initialised; build it with init_lora_weights=True or 'gaussian', or {fix}")


# -- a base model's checkpoint --------------------------------------------------------------------------------


def base_names(model: nn.Module) -> dict[str, str]:
    """tensor name -> its name in the model peft wrapped (`base_model.model.x.q_proj.base_layer.weight` ->
    `x.q_proj.weight`), for the tensors of a peft model's base; empty for a model without peft layers."""
    root = peft_root(model)
    tuner_layer = _tuner_layer()
    if root is None or tuner_layer is None:
        return {}
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils.other import AuxiliaryTrainingWrapper

    out: dict[str, str] = {}
    for name, _ in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        module: Any = model
        kept: list[str] = []
        parts = name.split(".")
        skip_next = False
        for i, part in enumerate(parts):
            if skip_next:  # the adapter's name under a wrapper's `modules_to_save`
                skip_next = False
                module = module._modules[part] if part in module._modules else module
                continue
            last = i == len(parts) - 1
            dropped = (isinstance(module, PeftModel) and part == "base_model"
                       or isinstance(module, BaseTuner) and part == "model"
                       or isinstance(module, tuner_layer) and part == "base_layer"
                       or isinstance(module, AuxiliaryTrainingWrapper) and part in ("original_module",
                                                                                    "modules_to_save"))
            if dropped and not last:
                skip_next = isinstance(module, AuxiliaryTrainingWrapper) and part == "modules_to_save"
            else:
                kept.append(part)
            if not last:
                module = module._modules[part]
        base = ".".join(kept)
        if base != name:
            out[name] = base
    return out


# -- export in peft's names -----------------------------------------------------------------------------------


def adapter_keys(root: nn.Module, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 adapter: str) -> list[tuple[str, str]]:
    """(the key `save_pretrained` writes, the tensor's name in `root`) for each tensor of `adapter`, in peft's
    order. peft's own `get_peft_model_state_dict` chooses and renames them: it is given a stand-in per tensor (no
    storage, on the meta device), and each key it returns is traced back to its tensor by the stand-in's identity."""
    from peft import get_peft_model_state_dict

    stand_ins = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    names = {id(t): name for name, t in stand_ins.items()}
    chosen = get_peft_model_state_dict(root, state_dict=stand_ins, adapter_name=adapter)
    out = []
    for key, value in chosen.items():
        if id(value) not in names:
            raise ParatrainError(f"peft computes {key!r} of adapter {adapter!r} rather than taking a tensor of the "
                                 "model, which run.export cannot write a tensor at a time; export the whole model "
                                 "(run.export(model, PATH, adapters_only=False)) and extract it with peft")
        out.append((key, names[id(value)]))
    return out


def adapter_folder(folder: Path, adapter: str) -> Path:
    """Where `save_pretrained` puts an adapter: the folder for "default", a subfolder named after any other."""
    return folder if adapter == "default" else folder / adapter


def save_config(root: nn.Module, adapter: str, folder: str | os.PathLike[str]) -> None:
    """`adapter_config.json` as `PeftModel.save_pretrained` writes it: inference mode on, the base model's name and,
    for a config with no task type, the base model's class."""
    peft_model: Any = root
    config = copy.deepcopy(peft_model.peft_config[adapter])
    base = peft_model.get_base_model() if callable(getattr(root, "get_base_model", None)) else root
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    mapping = None
    if config.task_type is None:
        mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    config.save_pretrained(str(folder), auto_mapping_dict=mapping)
