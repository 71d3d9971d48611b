"""One `paratrain.launch` worker: load the function, run it, leave its result or its failure for the launcher.

Usage (by `spawn.launch` only): python -m paratrain.launcher._worker WORKDIR RANK
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any


def _end_with_launcher() -> None:
    """The launcher holds our stdin open and never writes: end of file means it is gone, however it died,
    so end this worker and everything it started (our session's process group)."""

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="paratrain-lifeline", daemon=True).start()


def _write(workdir: Path, name: str, data: bytes) -> None:
    """Atomically, so the launcher never reads half a file."""
    tmp = workdir / f".{name}"
    tmp.write_bytes(data)
    tmp.rename(workdir / name)


def _report(workdir: Path, rank: int, exc: BaseException) -> None:
    import cloudpickle

    failed_at = time.time()
    text = traceback.format_exc()
    summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    try:
        error: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        error = None
    _write(workdir, f"error-{rank}.pkl",
           cloudpickle.dumps({"time": failed_at, "traceback": text, "summary": summary, "error": error}))
    from paratrain.errors import ParatrainError

    if not isinstance(exc, ParatrainError):  # those name their fix; the launcher says it once for all ranks
        sys.stderr.write(f"failed: {summary} (traceback raised in the launching process)\n")


def _close_process_group() -> None:
    if "torch.distributed" not in sys.modules:
        return  # the function never touched torch.distributed; skip importing it
    try:
        from paratrain import runtime

        runtime.destroy_process_group()
    except Exception:
        pass


def main(workdir: Path, rank: int) -> int:
    _end_with_launcher()
    faulthandler.enable()  # a crash in native code (a segfault, an abort) still prints where Python was
    try:
        import cloudpickle

        fn, args, kwargs, all_ranks = cloudpickle.loads((workdir / "payload.pkl").read_bytes())
        result: Any = None
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        if all_ranks or rank == 0:
            try:
                data = cloudpickle.dumps(result)
            except Exception as exc:
                raise TypeError(f"rank {rank}'s return value cannot be sent back ({exc}); return plain data "
                                "such as numbers, lists, dicts or CPU tensors") from exc
            _write(workdir, f"result-{rank}.pkl", data)
        return 0
    except BaseException as exc:
        _report(workdir, rank, exc)
        return 1
    finally:
        _close_process_group()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
