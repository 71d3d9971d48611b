"""Failing fast and saying why: heartbeats and the collective guard (`watch`), the report that names the
missing rank and its line (`diagnose`), SIGTERM as a request to checkpoint and stop (`preempt`), and replica
groups that outlive each other's failures (`replica_groups`: torchft is imported only in a worker launched so)."""

from .preempt import StopRequest
from .watch import INACTIVE, Watch

__all__ = ["INACTIVE", "StopRequest", "Watch"]
