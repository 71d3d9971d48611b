"""paratrain: one PyTorch training loop, any parallel strategy, measured.

    run = paratrain.setup(strategy="ddp")
    model, optimizer = run.prepare(model, optimizer)
    loader = run.prepare_loader(loader)
"""

from .api import Run, setup
from .data import ShardedLoader
from .errors import CheckpointError, CollectiveTimeout, ParatrainError
from .launcher.spawn import WorkerFailed
from .observe import Profile, profile

__version__ = "0.1.0"


def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Start `fn` on N worker processes from Python or a notebook; see `paratrain.launcher.spawn.launch`."""
    from .launcher.spawn import launch as _launch

    return _launch(*args, **kwargs)


__all__ = ["CheckpointError", "CollectiveTimeout", "ParatrainError", "Profile", "Run", "ShardedLoader", "WorkerFailed",
           "launch", "profile", "setup"]
