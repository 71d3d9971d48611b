"""Checkpointing: atomic directories (`store`), state capture (`state`, `rng`), and the collective
save/resume protocol (`manager`)."""

from .manager import find, load, save
from .store import is_checkpoint_dir

__all__ = ["find", "is_checkpoint_dir", "load", "save"]
