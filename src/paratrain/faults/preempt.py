"""SIGTERM as a request to stop at the next step boundary, with a checkpoint.

Schedulers (Slurm, Kubernetes, spot instances) and torchrun's agent announce the end with SIGTERM
and follow with SIGKILL some seconds later. Saving from inside the signal handler is unsafe: the
handler runs between two bytecodes of the training step, perhaps mid-collective, and only on the
ranks that got the signal. So the handler only records the request; `Run.should_stop` all-reduces
the flag at a step boundary, every rank sees the same answer at the same step, and the loop saves
and leaves together:

    if step % every == 0 or run.should_stop:
        run.save(state)
    if run.should_stop:
        break

A script that never reads `should_stop` keeps SIGTERM's usual meaning (the process ends at once),
so an old script is not left running when its launcher asks it to stop. Nor is a rank that is stuck
(hung in user code, or waiting on a dead peer): if no step boundary answers the request within
`grace_s` (the collective timeout), the process ends as SIGTERM would have ended it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any


class StopRequest:
    """The SIGTERM flag of one process."""

    def __init__(self, grace_s: float = 600.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.answered = False
        """Set when `should_stop` has told the loop to stop: the checkpoint is being written."""
        self.polled = False
        """Set once the script reads `Run.should_stop`: from then on SIGTERM is deferred to a step boundary."""
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.polled and not self.requested:
            self.requested = True
            timer = threading.Timer(self.grace_s, self._expire)
            timer.daemon = True
            timer.start()
            return
        # Not polled, or asked twice: behave as if we had never installed a handler.
        self.uninstall()
        if callable(self._previous):
            self._previous(signum, frame)
        else:  # the default action, set here too: a handler of a run closed out of order may still be installed
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _expire(self) -> None:
        if not self.answered:
            sys.stderr.write(f"paratrain: SIGTERM received {self.grace_s:.0f} s ago and no step boundary reached "
                             "since (stuck in user code or in a collective?); exiting without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)
