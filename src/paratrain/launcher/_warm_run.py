r"""Warm workers for `paratrain run`: torchrun's agent starts a tiny client per worker, and the client has the
worker forked from a template process that has already imported torch.

torchrun's agent owns the workers (it starts, watches, signals and restarts them); we do not replace it. With
`PARATRAIN_WARM_WORKERS=torch,...` its entry point becomes `_warm_client.py SCRIPT ARGS`, a standard-library
program that starts in milliseconds. The client sends its command line, environment, directory and stdin,
stdout and stderr to the template over a Unix socket; the template forks, the fork runs the script as
`python -u SCRIPT ARGS` would, and the client passes on the signals the agent sends it and exits with the
worker's status. An elastic restart then costs a fork instead of importing torch again in every worker
(7.8 s of CPU a worker on a 2-core machine).

    agent --Popen--> client (rank r) --socket--> template (imports torch ...) --fork--> worker (rank r)
          <-- exit status ----------  <-- "started pid" / "exited code" --

Lifelines (`_lifeline`): a client dies with the agent (the kernel's parent-death signal), and a client that dies
(even by SIGKILL) closes its connection, so the template kills its worker's process group; a worker dies with the
template that forked it; the template stops taking requests when the agent's pipe closes and ends with its last
worker. So a SIGKILL of the agent alone or of its process group (which holds neither clients, template nor
workers: each leads its own session) ends them all within moments.
Where the template is not there, the client starts the script as a new process, so a run never depends on it.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import _lifeline, _zygote

CLIENT = str(Path(__file__).with_name("_warm_client.py"))
"""The agent's entry point for each worker (run by path, so it imports neither paratrain nor torch)."""

SOCKET_VARIABLE = "PARATRAIN_WARM_SOCKET"

KEPT_VARIABLE = "PARATRAIN_WARM_TEMPLATE"
"""The socket of a template that the caller keeps running (`keep`): a test suite or a job that starts many short
runs then pays the template's imports once, not once per run. Each run's workers are still new forks, so
nothing one run changes reaches the next."""


class WarmRun:
    """The agent's side: the template process, its listening socket and the pipe whose end is its lifeline."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.folder = tempfile.mkdtemp(prefix="paratrain-warm-")
        self.path = os.path.join(self.folder, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.path)
        listener.listen(256)  # clients queue here while the template imports
        lifeline_r, self._lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from paratrain.launcher._warm_run import _main; _main()",
                 str(listener.fileno()), str(lifeline_r), ",".join(modules)],
                pass_fds=[listener.fileno(), lifeline_r], stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            # Only the template holds the listener: if it dies, clients are refused and start the script anew.
            listener.close()
            os.close(lifeline_r)

    def close(self) -> None:
        """Stop the template taking requests; it ends when its last worker has (normally at once)."""
        os.close(self._lifeline)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # workers still running (the agent was interrupted): they and their clients end together
        shutil.rmtree(self.folder, ignore_errors=True)


class _Kept:
    """A run's view of a template kept by its caller: the caller, not the run, ends it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def close(self) -> None:
        pass


def start(modules: tuple[str, ...]) -> WarmRun | _Kept | None:
    """The template this run's workers fork from: the caller's (PARATRAIN_WARM_TEMPLATE, if its socket is
    there; a client that still cannot reach it starts its script as a new process), else one of its own."""
    kept = os.environ.get(KEPT_VARIABLE, "")
    if kept and _is_socket(kept):
        return _Kept(kept)
    return WarmRun(modules) if modules else None


def keep(modules: tuple[str, ...]) -> WarmRun:
    """A template for many runs: pass `PARATRAIN_WARM_TEMPLATE=<.path>` to each `paratrain run`; it ends when
    `.close()` is called or the calling process exits."""
    return WarmRun(modules)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------
# The template process: python -c ... LISTEN_FD LIFELINE_FD MODULES


def _serve(listener: socket.socket, lifeline: int) -> tuple[dict[str, Any], list[int]]:
    """Fork a worker per client and report its exit; returns only in a forked worker, with its request."""
    workers: dict[socket.socket, int] = {}
    orphans: set[socket.socket] = set()
    accepting = True
    while accepting or workers:
        watched: list[Any] = [c for c in workers if c not in orphans]
        if accepting:
            watched += [listener, lifeline]
        ready, _, _ = select.select(watched, [], [], 0.02 if workers else None)
        _reap(workers, orphans)
        for source in ready:
            if source is listener:
                request = _accept(listener)
                if request is None:
                    continue
                conn, message, fds = request
                template = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _lifeline.end_with(template)
                    listener.close()
                    os.close(lifeline)
                    for other in workers:
                        other.close()
                    conn.close()
                    return json.loads(message), fds
                for fd in fds:
                    os.close(fd)
                workers[conn] = pid
                _send(conn, {"started": pid})
            elif source == lifeline:
                accepting = False  # the agent is done (or gone): no new workers
                listener.close()
                os.close(lifeline)
            elif isinstance(source, socket.socket):
                # A client sends one request only: a readable connection has closed, so its client is gone.
                orphans.add(source)
                _kill_group(workers[source])
    sys.exit(0)


def _accept(listener: socket.socket) -> tuple[socket.socket, bytes, list[int]] | None:
    conn, _ = listener.accept()
    conn.settimeout(10.0)
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
    except OSError:
        message, fds = b"", []
    if not message or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    conn.settimeout(None)
    return conn, message, fds


def _reap(workers: dict[socket.socket, int], orphans: set[socket.socket]) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for conn, worker in list(workers.items()):
            if worker == pid:
                _send(conn, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                conn.close()
                del workers[conn]
                orphans.discard(conn)


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the client is gone; its worker has been (or is being) killed


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_script(request: dict[str, Any], fds: list[int]) -> int:
    """In the fork: run the script as `python -u SCRIPT ARGS` would, and return its exit status."""
    _zygote.adopt(request, fds)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return _status(exc)
    except KeyboardInterrupt as exc:
        _print_error(exc)
        return -signal.SIGINT
    except BaseException as exc:
        _print_error(exc)
        return 1
    return 0


def _print_error(exc: BaseException) -> None:
    """The traceback `python SCRIPT` prints: from the script's own frames, without ours and runpy's."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # a hook may read either (torch's reads the first)


def _status(exc: SystemExit) -> int:
    """What the interpreter does with `sys.exit(x)`: None is 0, a number is the status, anything else is
    printed and exits with 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    lifeline = int(sys.argv[2])
    _zygote.load(sys.argv[3])
    request, fds = _serve(listener, lifeline)
    code = 1
    try:
        code = _run_script(request, fds)
    finally:
        _zygote.exit_forked(code)
