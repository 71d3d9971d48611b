"""`paratrain.launch(fn, ...)`: run a function on N workers from a script, a REPL or a notebook.

`mp.spawn` pickles `fn` by reference, so a function defined in a notebook cell (module `__main__`)
cannot be found by the workers. Here `fn` travels by value (cloudpickle) to fresh `python -m` worker
processes, each in its own process group so that it and its children can always be killed. The
parent polls; the first failing worker's traceback is raised in the caller and the rest are ended.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import cloudpickle

from ..errors import ParatrainError
from ..runtime import cuda_count, free_port


class WorkerFailed(ParatrainError):
    """A worker raised or died; carries its rank and traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"worker rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


def _pump(stream: IO[bytes], rank: int, prefix: bool) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sys.stdout.write(f"[rank{rank}] {text}" if prefix else text)
        sys.stdout.flush()


def _kill(procs: list[subprocess.Popen[bytes]], grace: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for proc in procs:
        try:  # children the worker left behind (data loader workers) share its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _default_nproc() -> int:
    return cuda_count() or 1


def launch(
    fn: Any, *args: Any, nproc: int | None = None, timeout: float | None = None, init: str | None = None,
    all_ranks: bool = False, env: dict[str, str] | None = None, threads_per_worker: int = 1,
    prefix_output: bool = True, **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` on `nproc` workers; returns rank 0's result (a list of all with all_ranks=True).

    Inside `fn`, `paratrain.setup()` finds the world size, rank and a free master port. A worker that
    raises makes this raise `WorkerFailed` with its rank and traceback within seconds; `timeout`
    (seconds) bounds the whole run.
    """
    gpus = cuda_count()
    nproc = nproc if nproc is not None else _default_nproc()
    if nproc < 1:
        raise ParatrainError(f"nproc must be >= 1, got {nproc}")
    if gpus and nproc > gpus and (env or {}).get("PARATRAIN_ACCELERATOR", "auto") != "cpu":
        raise ParatrainError(
            f"nproc={nproc} but only {gpus} GPU(s) are visible; use nproc<={gpus} (one worker per GPU)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="paratrain-launch-"))
    (workdir / "payload.pkl").write_bytes(cloudpickle.dumps((fn, args, kwargs)))
    port = free_port()
    base = dict(os.environ)
    base.update(env or {})
    base["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [base.get("PYTHONPATH", "")])
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                 "LOCAL_WORLD_SIZE": str(nproc), "PARATRAIN_LAUNCHER": "launch", "PYTHONUNBUFFERED": "1"})
    if init:
        base["PARATRAIN_INIT"] = init
    if not gpus:
        base.setdefault("OMP_NUM_THREADS", str(threads_per_worker))
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            proc = subprocess.Popen(
                [sys.executable, "-m", "paratrain.launcher._worker", str(workdir)],
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append(proc)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, rank, prefix_output), daemon=True)
            pump.start()
            pumps.append(pump)
        _wait(procs, workdir, timeout)
        results = [_read(workdir / f"result-{r}.pkl") for r in range(nproc)]
        return results if all_ranks else results[0]
    finally:
        _kill(procs)
        for pump in pumps:
            pump.join(timeout=2)
        for file in workdir.iterdir():
            file.unlink()
        workdir.rmdir()


def _read(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait(procs: list[subprocess.Popen[bytes]], workdir: Path, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # Name the rank that failed first: peers usually die afterwards of the broken connection.
            time.sleep(0.3)  # let peers that failed at about the same moment write their reports
            reports = {r: json.loads(p.read_text()) for r in range(len(procs))
                       if (p := workdir / f"error-{r}.json").exists()}
            rank = min(reports, key=lambda r: reports[r]["time"]) if reports else failed[0]
            detail = reports[rank]["traceback"] if reports else (
                f"exited with code {codes[rank]} without a Python error (killed, or out of memory?)")
            _kill(procs)
            raise WorkerFailed(rank, detail)
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            _kill(procs)
            alive = [r for r, c in enumerate(codes) if c is None]
            raise ParatrainError(f"workers {alive} did not finish within {timeout:.0f}s; they were stopped")
        time.sleep(0.02)
