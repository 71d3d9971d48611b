"""paratrain: one PyTorch training loop, any parallel strategy, measured.

    run = paratrain.setup(strategy="ddp")
    model, optimizer = run.prepare(model, optimizer)
    loader = run.prepare_loader(loader)

The names below are imported on first use, so `paratrain run`/`plan`/`bench` can parse their flags and
refuse bad input before torch is imported (seconds of a CLI's start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, CollectiveTimeout, ParatrainError

if TYPE_CHECKING:
    from .api import Run, setup
    from .data import ShardedLoader
    from .launcher.spawn import WorkerFailed
    from .observe import Profile, profile  # type: ignore[no-redef]
    from .parallel.expert import global_rows
    from .weights import empty_init

__version__ = "0.1.0"

_LAZY = {"Run": "api", "setup": "api", "ShardedLoader": "data", "WorkerFailed": "launcher.spawn",
         "Profile": "observe", "profile": "observe", "empty_init": "weights", "global_rows": "parallel.expert"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:  # a subpackage asked for as an attribute (paratrain.strategies.get(...))
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Start `fn` on N worker processes from Python or a notebook; see `paratrain.launcher.spawn.launch`."""
    from .launcher.spawn import launch as _launch

    return _launch(*args, **kwargs)


__all__ = ["CheckpointError", "CollectiveTimeout", "ParatrainError", "Profile", "Run", "ShardedLoader", "WorkerFailed",
           "empty_init", "global_rows", "launch", "profile", "setup"]
