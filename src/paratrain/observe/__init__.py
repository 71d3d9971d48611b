"""Watching a run: `run.log` (metrics.py: reduce, JSON lines, TensorBoard, progress bar), the per-rank step
breakdown (breakdown.py, profile.py), slow ranks named while training (stragglers.py) and the progress bar
itself (progress.py, also used by `paratrain bench`)."""

from .breakdown import Breakdown
from .metrics import MetricLog
from .profile import Profile, profile
from .stragglers import StragglerWatch

__all__ = ["Breakdown", "MetricLog", "Profile", "StragglerWatch", "profile"]
