"""A `paratrain run` worker as torchrun's agent sees it: has the real worker forked from the warm template.

Usage (by `paratrain run` only, as torchrun's entry point): python -u _warm_client.py SCRIPT ARGS...
Run by path with the standard library only, so it starts in milliseconds; see `_warm_run` for the design.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

import _lifeline  # run by path: this folder is sys.path[0]

_WAIT_S = 300.0
"""How long to wait for the template to fork us (it may still be importing torch on a busy machine)."""

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _fork_remote(argv: list[str]) -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(_WAIT_S)
    sock.connect(os.environ["PARATRAIN_WARM_SOCKET"])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    reply = sock.recv(1 << 16)
    if not reply:
        raise ConnectionError("the template ended")
    sock.settimeout(None)
    return sock, int(json.loads(reply)["started"])


def _forward(pid: int) -> None:
    """The agent signals our process group; the worker leads its own, so it gets what we get."""

    def handler(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, handler)


def _exit_like(code: int) -> None:
    if code < 0:  # the worker was ended by a signal: so are we, for the agent's report
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main() -> None:
    argv = sys.argv[1:]
    _lifeline.end_with(_lifeline.agent())  # the agent's death kills us, and through our connection, the worker
    # A signal that arrives before the worker exists (or before we know its pid) waits, then is passed on:
    # a preemption's SIGTERM must reach the worker's own handler, not end us and, through the lifeline, it.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        sock, pid = _fork_remote(argv)
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"paratrain run: no warm worker ({exc}); starting {argv[0]} as a new process\n")
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # a new program inherits the mask
        os.execv(sys.executable, [sys.executable, "-u", *argv])
    _forward(pid)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    while True:
        data = sock.recv(1 << 16)
        if not data:
            sys.stderr.write("paratrain run: the warm worker template ended before the worker did\n")
            _exit_like(1)
        message = json.loads(data)
        if "exited" in message:
            _exit_like(int(message["code"]))


if __name__ == "__main__":
    main()
