"""Checkpointing: atomic directories (`store`), state capture (`state`, `rng`), the collective
save/resume protocol (`manager`), and checkpoints written while training goes on (`background`)."""

from .background import Writer
from .manager import find, load, save, stage, write
from .store import is_checkpoint_dir

__all__ = ["Writer", "find", "is_checkpoint_dir", "load", "save", "stage", "write"]
