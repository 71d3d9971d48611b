"""Worker processes of `paratrain.launch`: started, forwarded, watched and always ended.

Each worker is a fresh `python -m paratrain.launcher._worker` (or a fork of a warm template, `_zygote`) in its
own session, so that it and anything it forks (data-loader workers) can be ended as one process group. Its
stdin is a pipe the launching process never writes: when the launcher goes away for any reason (an exception,
Ctrl-C, a notebook kernel restarted or SIGKILLed), the pipe closes and the worker ends its own group, so
nothing is orphaned.
"""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from ._zygote import ForkedProcess, Template


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes] | ForkedProcess
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def code(self) -> int | None:
        return self.proc.poll()


def start(rank: int, argv: list[str], env: dict[str, str], prefix: bool, template: Template | None = None) -> Worker:
    proc: subprocess.Popen[bytes] | ForkedProcess
    if template is not None:
        proc = template.fork(argv, env)
    else:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    worker = Worker(rank, proc)
    label = f"[rank{rank}] " if prefix else ""
    for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        assert stream is not None
        pump = threading.Thread(target=_pump, args=(stream, name, label), daemon=True,
                                name=f"paratrain-rank{rank}-{name}")
        pump.start()
        worker.pumps.append(pump)
    return worker


def _pump(stream: IO[bytes], name: str, label: str) -> None:
    """Copy a worker's output to ours line by line, each line labelled with its rank; whole lines only, so
    ranks never interleave within a line (a last unterminated line is copied at exit). `sys.stdout` is
    looked up per write, so in a notebook the text lands in the cell that called launch."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    fd = stream.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        *lines, pending = (pending + decoder.decode(chunk, final=not chunk)).split("\n")
        if not chunk and pending:
            lines.append(pending)
        if lines:
            out = getattr(sys, name)
            out.write("".join(f"{label}{line}\n" for line in lines))
            out.flush()
        if not chunk:
            break
    stream.close()


def stop(workers: list[Worker], grace: float = 3.0) -> None:
    """End every worker and its children: SIGTERM, then SIGKILL after `grace` seconds. The lifeline pipes are
    closed in any case, so even an interrupted stop leaves workers that end themselves."""
    try:
        _signal(workers, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(w.code is None for w in workers):
            time.sleep(0.02)
    finally:
        for worker in workers:
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        _signal(workers, signal.SIGKILL, everyone=True)
        for worker in workers:
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a hung filesystem): nothing more to do
                pass
        for worker in workers:
            for pump in worker.pumps:
                pump.join(timeout=2)


def _signal(workers: list[Worker], sig: int, everyone: bool = False) -> None:
    """Signal each worker's process group; `everyone` also reaches groups whose leader has exited but whose
    children (a data loader's) live on."""
    for worker in workers:
        if everyone or worker.code is None:
            try:
                os.killpg(worker.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
