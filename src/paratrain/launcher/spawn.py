"""`paratrain.launch(fn, ...)`: run a function on N workers from a script, a REPL or a notebook.

`mp.spawn` pickles `fn` by reference, so a function defined in a notebook cell (module `__main__`) cannot
be found by the workers ("Can't get attribute 'demo_basic' on <module '__main__'>"). Here `fn` travels by
value (cloudpickle) to fresh worker processes (see `_procs`), which also means a script needs no
`if __name__ == "__main__"` guard. The world size is `nproc` by construction, and the rendezvous store is
hosted by the launching process itself on a port it already holds (as torchrun's agent does), so no
"free" port can be taken by someone else before rank 0 binds it. The first failing worker's traceback
is raised in the caller and the others are ended; a timeout or Ctrl-C ends them too.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
import tempfile
import time
import types
from collections import ChainMap
from pathlib import Path
from typing import Any

import cloudpickle
import torch.distributed as dist

from .. import file_store
from ..errors import ParatrainError
from ..runtime import warm_modules, worker_count
from . import _procs, _zygote
from .failures import ranks_text

_SETTLE_S = 2.0
"""Seconds to wait, after a first failure, for the other workers' reports: an error raised on every rank
(a batch that does not split) then comes back once, naming all of them. Peers waiting in a collective on
the failed rank usually fail within moments too, so the wait is rarely this long."""


class WorkerFailed(ParatrainError):
    """A worker raised or died. `rank` is the first to fail, `detail` its traceback, `error` its exception
    (when it could be sent back), `others` the one-line reports of ranks that failed after it. Ranks whose
    report is the first one's (`summary`) are named together with it, and its traceback is shown once."""

    def __init__(self, rank: int, nproc: int, detail: str, error: BaseException | None = None,
                 others: dict[int, str] | None = None, summary: str | None = None) -> None:
        others = others or {}
        same = [r for r, line in others.items() if summary is not None and line == summary]
        differ = sorted(set(others) - set(same))
        who = ranks_text([rank, *same]) + f" of {nproc} failed" + (" with the same error" if same else "")
        also = f" (then rank(s) {differ} too)" if differ else ""
        # The worker's own exception stays the last line: callers quote it as the reason.
        super().__init__(f"worker {who}{also}; all workers were stopped:\n{detail.rstrip()}")
        self.rank = rank
        self.detail = detail
        self.error = error
        self.others = others


def launch(
    fn: Any, *args: Any, nproc: int | None = None, timeout: float | None = None, init: str | None = None,
    all_ranks: bool = False, accelerator: str = "auto", threads_per_worker: int = 1,
    env: dict[str, str] | None = None, prefix_output: bool = True, **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` on `nproc` workers; return rank 0's result, or every rank's with all_ranks=True.

    Inside `fn`, `paratrain.setup()` (or plain `dist.init_process_group()`) finds rank, world size and the
    store. Default `nproc`: one worker per visible GPU, else 1; `accelerator="cpu"` hides the GPUs from the
    workers. CPU workers get `threads_per_worker` threads each. `init="file:///path"` makes setup() use a
    file store there. A failing worker raises `WorkerFailed` here; `timeout` (seconds) bounds the whole run.
    """
    nproc = worker_count(nproc, accelerator)
    store_path = file_store.path_of(init) if init else None
    if store_path:
        file_store.preflight(store_path, expect_idle=True)
    try:
        payload = _dumps((fn, args, kwargs, all_ranks))
    except Exception as exc:
        raise ParatrainError(f"paratrain.launch: the function or its arguments cannot be sent to the workers "
                             f"({type(exc).__name__}: {exc}); create such objects inside the function") from exc
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    workdir = Path(tempfile.mkdtemp(prefix="paratrain-launch-"))
    workers: list[_procs.Worker] = []
    try:
        (workdir / "payload.pkl").write_bytes(payload)
        base = _worker_env(nproc, store.port, init, accelerator, threads_per_worker, env)
        template = _zygote.template_for(warm_modules())
        for rank in range(nproc):
            argv = [sys.executable, "-m", "paratrain.launcher._worker", str(workdir), str(rank)]
            workers.append(_procs.start(rank, argv, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                        prefix_output, template))
        _wait(workers, workdir, timeout)
        results = [_load(workdir / f"result-{r}.pkl") for r in (range(nproc) if all_ranks else [0])]
        return results if all_ranks else results[0]
    finally:
        _procs.stop(workers)
        del store  # frees the port now, even if a notebook keeps this frame alive in its last traceback
        if store_path:
            file_store.remove_if_unused(store_path)  # every worker has ended: a file left now is this run's
        shutil.rmtree(workdir, ignore_errors=True)


def _worker_env(nproc: int, port: int, init: str | None, accelerator: str, threads: int,
                extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PARATRAIN_INIT"))}
    # Modules importable here (the notebook's folder, a script's siblings) stay importable in the workers.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "PARATRAIN_LAUNCHER": "launch",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": str(threads)})
    if accelerator == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if init:
        env["PARATRAIN_INIT"] = init
    env.update(extra or {})
    return env


def _code_keeping_its_file(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the file name it blanks out (since 3.1.3, for
    deterministic payloads) put back: a worker's traceback then names the user's script and line."""
    constructor, fields = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_keeping_its_file}, cloudpickle.Pickler.dispatch_table)


def _dumps(obj: Any) -> bytes:
    """`fn` and its arguments by value (cloudpickle), tracebacks keeping the file names."""
    if not hasattr(cloudpickle.cloudpickle, "_code_reduce"):
        return cloudpickle.dumps(obj)
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait(workers: list[_procs.Worker], workdir: Path, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [w.code for w in workers]
        if any(c not in (None, 0) for c in codes):
            settle = time.monotonic() + _SETTLE_S
            while any(w.code is None for w in workers) and time.monotonic() < settle:
                time.sleep(0.02)
            raise _failure(workers, workdir)
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            alive = [w.rank for w in workers if w.code is None]
            raise ParatrainError(
                f"paratrain.launch: worker rank(s) {alive} still running after timeout={timeout:g}s and were "
                "stopped; raise the timeout, or look for a rank waiting in a collective its peers never reach"
            )
        time.sleep(0.02)


def _failure(workers: list[_procs.Worker], workdir: Path) -> WorkerFailed:
    """Name the rank that failed first: its peers usually fail afterwards, of the broken connection. A worker
    writes its report before it tears its process group down, so the first report is already there."""
    reports = {w.rank: _load(p) for w in workers if (p := workdir / f"error-{w.rank}.pkl").exists()}
    if reports:
        rank = min(reports, key=lambda r: reports[r]["time"])
        error = None
        try:
            error = pickle.loads(reports[rank]["error"]) if reports[rank]["error"] else None
        except Exception:
            pass
        others = {r: rep["summary"] for r, rep in reports.items() if r != rank}
        others.update({w.rank: _died(w.code) for w in workers if w.rank not in reports and w.code not in (None, 0)})
        return WorkerFailed(rank, len(workers), reports[rank]["traceback"], error, others, reports[rank]["summary"])
    worker = next(w for w in workers if w.code not in (None, 0))
    return WorkerFailed(worker.rank, len(workers), f"the process {_died(worker.code)} (out of memory? a crash in "
                        "native code? its output above shows where)")


def _died(code: int | None) -> str:
    """How a worker that left no Python error ended: a rank killed outright is often the cause of its peers'
    broken connections, so it is named beside them."""
    code = code or 0
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{how} without a Python error"
