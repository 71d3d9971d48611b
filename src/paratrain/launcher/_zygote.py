r"""Warm workers for `paratrain.launch`: fork them from a template process that has already imported torch.

A fresh worker spends seconds importing torch (2.6 s a process on a 2-core machine), which dominates a short
launch from a notebook or a test suite. With `PARATRAIN_WARM_WORKERS=torch,transformers` (read by
`runtime.warm_modules`), the launching process starts one template per module list, which imports those
modules once and then forks each worker on request: the forkserver idea of `multiprocessing`. The worker's
stdin, stdout and stderr pipes travel over a Unix socket (SCM_RIGHTS), so the launcher watches, labels and
ends a forked worker exactly as a spawned one (`_procs`); the template reports each worker's exit status.

The template computes nothing and starts no threads of its own, so forking it is safe; every worker is a new
fork, so nothing one launch changes reaches the next. The template ends when the launching process does
(its socket closes). Where it cannot start, launches fall back to spawning and say so once.

    launcher --socket--> template (imports torch ...) --fork--> worker rank 0 (stdin/out/err = launcher's pipes)
                     <-- "started pid" / "exited pid code"  \--fork--> worker rank 1
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

_READY_TIMEOUT_S = 300.0
"""How long a template may take to import its modules (torchvision alone takes seconds on a busy machine, and a
module may do work at import that every worker then inherits)."""


# ---------------------------------------------------------------------------------------------------------
# The template process: python -m paratrain.launcher._zygote FD MODULES


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork a worker per request and report exits; returns only in a forked worker, with its request."""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02 if children else None)  # idle: sleep until asked
        _reap(sock, children)
        if not ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        except OSError:
            message, fds = b"", []
        if not message:
            sys.exit(0)  # the launching process is gone; its workers end by their own lifelines
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(json.dumps({"started": pid}).encode())


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def adopt(request: dict[str, Any], fds: list[int]) -> None:
    """In a fork: become the process the launcher would have spawned (its pipes, environment and directory)."""
    os.setsid()  # its own process group, as `start_new_session=True` gives a spawned worker
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))


def _become_worker(request: dict[str, Any], fds: list[int]) -> int:
    """In the fork: take the launcher's pipes, environment and directory, then run the worker's main."""
    adopt(request, fds)
    sys.argv = list(request["argv"])
    from . import _worker

    workdir, rank = request["argv"][-2:]  # the spawned worker's command line: ... _worker WORKDIR RANK
    return _worker.main(Path(workdir), int(rank))


def load(modules: str) -> None:
    """Import a template's modules, then move everything they made out of the garbage collector's sight
    (`gc.freeze`): a forked worker's full collection (paratrain collects before its process group ends) then
    walks only what the worker made, not torch's whole heap (0.25 s a collection), and touches no template
    page, which stays shared."""
    for name in filter(None, modules.split(",")):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def _main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    load(sys.argv[2])
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    request, fds = _serve(sock)
    code = 1
    try:
        code = _become_worker(request, fds)
    finally:
        exit_forked(code)


def exit_forked(code: int) -> None:
    """End a forked worker without tearing down the template's modules: its threads are joined, exit handlers
    run and output is flushed, but the interpreter's final collection (seconds, touching every inherited page)
    is skipped. A negative code ends it by that signal, as an unhandled KeyboardInterrupt does."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what a normal exit does first
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
    finally:
        os._exit(code if code >= 0 else 128 - code)


# ---------------------------------------------------------------------------------------------------------
# The launcher's side


class ForkedProcess:
    """A worker forked by a template, with the part of `subprocess.Popen` that `_procs` uses."""

    def __init__(self, template: Template, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.template, self.pid = template, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self.template.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


class Template:
    """One template process and what it reported: the exit code of every worker it forked."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from paratrain.launcher._zygote import _main; _main()", str(theirs.fileno()),
             ",".join(modules)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        theirs.close()
        self.sock = ours
        self._codes: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._gone = False
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="paratrain-template", daemon=True).start()
        self._reply("ready", _READY_TIMEOUT_S)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._gone = True
                elif "exited" in (message := json.loads(data)):
                    self._codes[message["exited"]] = message["code"]
                else:
                    self._replies.append(message)
                self._changed.notify_all()
            if not data:
                return

    def _reply(self, key: str, timeout: float) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: self._replies or self._gone, timeout) or not self._replies:
                raise RuntimeError(f"the worker template did not answer ({key}) within {timeout:g}s"
                                   if not self._gone else "the worker template ended")
            return int(self._replies.pop(0)[key])

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            code = self._codes.get(pid)
            if code is None and self._gone and not _exists(pid):
                return 1  # the template died first and could not report it: the worker has ended all the same
            return code

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """A new worker with pipes for its stdin (the lifeline), stdout and stderr, as `Popen` would give it."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        request = {"argv": argv, "env": env, "cwd": os.getcwd()}
        try:
            with self._lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [stdin_r, stdout_w, stderr_w])
                pid = self._reply("started", 60.0)
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        return ForkedProcess(self, pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"), os.fdopen(stderr_r, "rb"))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_TEMPLATES: dict[tuple[str, ...], Template | None] = {}
"""This process's templates by module list (None: it failed to start; spawn instead). Process-wide like the
`multiprocessing` forkserver, since every launch from this process may share one."""


def template_for(modules: tuple[str, ...]) -> Template | None:
    """The running template for `modules`, started on first use; None where warm workers are off or broken."""
    if not modules:
        return None
    template = _TEMPLATES.get(modules)
    if template is not None and template.alive:
        return template
    if modules in _TEMPLATES and template is None:
        return None
    try:
        template = Template(modules)
    except Exception as exc:
        warnings.warn(f"paratrain.launch: warm workers are off ({exc}); workers start as new processes",
                      stacklevel=3)
        template = None
    _TEMPLATES[modules] = template
    return template


def template_pids() -> set[int]:
    """The templates' own process ids (a test that checks for leftover processes must not count them)."""
    return {t.proc.pid for t in _TEMPLATES.values() if t is not None and t.alive}


if __name__ == "__main__":
    _main()
