"""Checkpointing: atomic directories (`store`), state capture (`state`, `rng`), and the collective
save/resume protocol (`manager`)."""

from .manager import load, save

__all__ = ["load", "save"]
