"""Failing fast and saying why: heartbeats and the collective guard (`watch`), the report that names the
missing rank and its line (`diagnose`), and SIGTERM as a request to checkpoint and stop (`preempt`)."""

from .preempt import StopRequest
from .watch import INACTIVE, Watch

__all__ = ["INACTIVE", "StopRequest", "Watch"]
