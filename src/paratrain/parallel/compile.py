"""`setup(compile=...)`: torch.compile applied per block, in the parallelize order.

Each block FSDP would shard (a ModuleList's items, else the top-level children with parameters) is compiled in
place (`nn.Module.compile`, so parameter names, state dicts and checkpoints do not change) after activation
checkpointing and before FSDP, DDP or tensor parallelism wrap the model, as torchtitan orders it: repeated
blocks share one compiled graph, and the collectives the wrappers add between blocks stay outside the graphs.
Under layouts that cut the model into pipeline stages each layer of a stage is the unit, compiled after the
split (the blocks themselves were traced into the stages' graphs).

paratrain's dropout layers run eagerly between the compiled pieces (parallel/randomness.py): their masks depend
on the step and the rows, Python state the compiler would otherwise bake into the graph and recompile for at
every step. BatchNorm and the rest compile as they are.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ParatrainError

if TYPE_CHECKING:  # imported by the options' check, which runs before torch is loaded
    import torch
    from torch import nn

CPP_COMPILERS = ("c++", "g++", "clang++")


def backend_of(option: bool | str) -> str | None:
    """The torch.compile backend `setup(compile=...)` asks for: None (off), "inductor" for True, else the name."""
    if option is False:
        return None
    return "inductor" if option is True else str(option)


def check_backend(option: object) -> None:
    """A bool or a backend torch knows, refused with the list before anything is built."""
    if isinstance(option, bool):
        return
    if not isinstance(option, str) or not option:
        raise ParatrainError(f"compile must be True, False or a torch.compile backend name, got {option!r}")
    from torch._dynamo import list_backends

    known = sorted(set(list_backends(exclude_tags=())) | {"inductor"})
    if option not in known:
        raise ParatrainError(f"compile={option!r} is not a torch.compile backend here; use True (inductor) or one of "
                             f"{', '.join(known)}")


def missing_toolchain(backend: str, device: torch.device) -> str | None:
    """Why inductor cannot build CPU kernels on this machine, if it cannot (it compiles C++ for them)."""
    if backend != "inductor" or device.type != "cpu":
        return None
    compilers = [c for c in (os.environ.get("CXX"), *CPP_COMPILERS) if c]
    if not any(shutil.which(c) for c in compilers):
        return ("torch.compile's inductor builds CPU kernels with a C++ compiler and none is on PATH (c++, g++ or "
                "clang++); install one (Debian: apt-get install g++), or use compile='aot_eager', which compiles "
                "the graphs without generating code")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return ("torch.compile's inductor needs Python's headers to build CPU kernels and Python.h is missing; "
                "install them (Debian: apt-get install python3-dev), or use compile='aot_eager'")
    return None


def apply(units: list[tuple[str, nn.Module]], option: bool | str, device: torch.device) -> int:
    """Compile each unit in place; returns how many were compiled."""
    backend = backend_of(option)
    if backend is None:
        return 0
    why = missing_toolchain(backend, device)
    if why:
        raise ParatrainError(why)
    from . import randomness

    randomness.eager_under_compile()
    for _, unit in units:
        for piece in _pieces(unit):
            piece.compile(backend=backend)
    return len(units)


def _pieces(unit: nn.Module) -> list[nn.Module]:
    """A traced pipeline segment is compiled graph by graph (GraphSegment.compile_pieces), others whole."""
    pieces = getattr(unit, "compile_pieces", None)
    return pieces() if callable(pieces) else [unit]


def is_compiled(unit: nn.Module) -> bool:
    return all(getattr(piece, "_compiled_call_impl", None) is not None for piece in _pieces(unit))


def compiled(model: nn.Module) -> int:
    """How many modules of `model` run compiled (set by `nn.Module.compile`)."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


__all__ = ["apply", "backend_of", "check_backend", "compiled", "is_compiled", "missing_toolchain"]
