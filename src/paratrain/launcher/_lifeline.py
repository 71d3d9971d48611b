r"""Nothing outlives its launcher: a process `paratrain run` starts is killed when its parent dies, SIGKILL included.

torchrun's agent starts each worker in its own session, so that the worker and what it forks can be signalled
as one process group. The price: a SIGKILL of the launcher's process group (a shell's, a scheduler's, the OOM
killer's) does not reach the workers, which would train on, writing checkpoints into the folder the rerun
resumes from. So each process is tied to its parent by Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG,
SIGKILL)`), set by the process itself and then checked against the race it leaves open: a parent that died
before the signal was set has already handed us to another (`getppid()` changed), and we end at once.

    paratrain run (torchrun's agent) --> python _lifeline.py SCRIPT --exec--> python SCRIPT  (cold workers)
                                     --> _warm_client.py  ~~socket~~>  template --fork--> worker  (warm)

Each arrow to the right is a tie: the agent's death kills a cold worker or a warm client; a client's death
makes the template kill its worker; a template's death kills the workers it forked (`_warm_run`).

The kernel sends the signal when the *thread* that forked the child ends, not the process: a tie holds only to
a parent that starts its children from a thread that lives as long as they do, as the agent's main thread and a
single-threaded template do. `paratrain.launch` needs none of this: its workers watch a pipe from the launcher
(`_worker`), which closes however the launcher ends. Elsewhere than Linux there is no such signal; `end_with`
then polls the parent instead, which lasts only while the process runs our code (not across `exec`).

Standard library only: `_warm_client.py` and this file's own `main` run by path, before anything is imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENTRY = os.path.abspath(__file__)
"""The agent's entry point for each cold worker: `python -u _lifeline.py SCRIPT ARGS` ties, then runs SCRIPT."""

AGENT_VARIABLE = "PARATRAIN_AGENT_PID"
"""Set by `paratrain run` to its own pid: the agent, whose death must end the processes it starts."""

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def end_with(parent: int) -> None:
    """Be killed (SIGKILL) when process `parent`, which started us, ends; end now if it already has."""
    tied = _set_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the signal was set (or we were not its child): we are orphans
        os.kill(os.getpid(), signal.SIGKILL)
    if not tied:
        threading.Thread(target=_poll, args=(parent,), name="paratrain-lifeline", daemon=True).start()


def agent() -> int:
    """The pid of the `paratrain run` whose process this is, else our parent's."""
    value = os.environ.get(AGENT_VARIABLE, "")
    return int(value) if value.isdigit() else os.getppid()


def _set_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _poll(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """`python -u _lifeline.py SCRIPT ARGS`: tie this process to the agent, then become `python -u SCRIPT ARGS`
    (same pid, so the agent watches and signals the script itself; the death signal survives `exec`)."""
    end_with(agent())
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


if __name__ == "__main__":
    main()
