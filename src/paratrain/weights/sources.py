"""Where a meta-built model's values come from: a checkpoint (`init_from`), else the modules' own initialisation.

A checkpoint is matched against the model before anything is read: every tensor of its state dict present
(a tied weight under any of its names), nothing the model lacks, every shape equal; otherwise one refusal lists
what is missing, unexpected and of another shape. Buffers a state dict does not hold (rotary frequencies) come
from the modules' own initialisation either way. A LoRA model (peft) also takes its base model's checkpoint (plain
`save_pretrained` of the base: `x.q_proj.weight` for `base_model.model.x.q_proj.base_layer.weight`); the adapters
such a file lacks come from their own initialisation (peft's: B zeros), any other missing tensor is refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ParatrainError
from . import lora
from .files import Checkpoint
from .own_init import OwnInit


def _listed(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


class Source:
    """Values by the model's own tensor names: `piece(name, index)` reads only the slice asked for."""

    def __init__(self, model: nn.Module, seed: int, init_from: str | os.PathLike[str] | None = None) -> None:
        self.own = OwnInit(model, seed)
        self.canonical = self.own.canonical
        self.stored: dict[str, str] = {}  # canonical name -> name in the checkpoint
        self.checkpoint = Checkpoint(init_from) if init_from is not None else None
        if self.checkpoint is not None:
            self._match(model, self.checkpoint)

    def _match(self, model: nn.Module, ckpt: Checkpoint) -> None:
        shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
        aliases: dict[str, list[str]] = {}  # canonical name -> its names in the state dict, in its order
        for name in shapes:
            aliases.setdefault(self.canonical[name], []).append(name)
        in_file = ckpt.names()
        base = lora.base_names(model)  # a peft model's base tensors under the base model's names
        adapters = self.own.lora.adapter_tensors(model)
        every = set(self.canonical) | set(base.values())  # every name of every parameter and buffer
        missing, differ = [], []
        for first, names in aliases.items():
            found = next((n for n in (first, *names, *(base[n] for n in (first, *names) if n in base))
                          if n in in_file), None)
            if found is None:
                if first not in adapters:  # a base model's checkpoint has no LoRA adapters: their own init
                    missing.append(first)
                continue
            stored, want = ckpt.shape(found), shapes[names[0]]
            if stored != want:
                differ.append(f"{found} {list(stored)} (the model's {list(want)})")
            self.stored[first] = found
        unexpected = sorted(in_file - every)  # a non-persistent buffer stored anyway (old rotary tables) is ignored
        if missing or unexpected or differ:
            said = [f"{len(missing)} missing ({_listed(missing)})" if missing else "",
                    f"{len(unexpected)} unexpected ({_listed(unexpected)})" if unexpected else "",
                    f"{len(differ)} of another shape ({_listed(differ, 4)})" if differ else ""]
            raise ParatrainError(
                f"init_from={str(ckpt.path)!r} does not fit {type(model).__name__}: its tensors are "
                f"{'; '.join(s for s in said if s)}. Keys are the module's own state-dict names (model.state_dict()"
                "; a peft model's also its base model's): load the checkpoint of this architecture and size, saved "
                "from this class (save_pretrained of the same model class, or run.export)")

    def holds(self, name: str) -> bool:
        """The checkpoint gives this tensor's values."""
        return self.canonical.get(name, name) in self.stored

    def piece(self, name: str, index: Sequence[slice] | None = None) -> torch.Tensor:
        first = self.canonical.get(name, name)
        if self.checkpoint is not None and first in self.stored:
            return self.checkpoint.read(self.stored[first], index)
        whole = self.own.full(first)
        return whole[tuple(index)] if index is not None else whole


def source_for(model: nn.Module, seed: int, init_from: str | os.PathLike[str] | None) -> Source:
    return Source(model, seed, init_from)
